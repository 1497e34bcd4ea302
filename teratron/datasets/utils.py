"""Small shared pieces of the data pipeline: the Split enum, weight normalisation, the parsers of
`--data-path` and `--split`, the per-split sample counts, and atomic file writes."""

import math
import os
import re
import tempfile
from contextlib import contextmanager
from enum import Enum
from typing import List, Optional, Tuple

import numpy
import torch

Blend = Tuple[List[str], Optional[List[float]]]


class Split(Enum):
    train = 0
    valid = 1
    test = 2


def normalize(weights: List[float]) -> List[float]:
    """Scale weights to sum to one (float64, as Megatron, so blends are bitwise identical)."""
    w = numpy.array(weights, dtype=numpy.float64)
    return (w / w.sum()).tolist()


def _as_weight(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def get_blend_from_list(blend: Optional[List[str]], flag: str = "--data-path") -> Optional[Blend]:
    """Parse `["0.3", "prefA", "0.7", "prefB"]` into `(["prefA", "prefB"], [0.3, 0.7])`, and a plain
    prefix list `["prefA", "prefB"]` into `(["prefA", "prefB"], None)` (weights from sizes).

    A list whose first entry is a number is read as weight/prefix pairs, strictly."""
    if blend is None:
        return None
    if len(blend) == 0:
        raise ValueError(f"{flag}: no dataset given; pass a prefix or 'WEIGHT PREFIX' pairs")
    if _as_weight(blend[0]) is None:
        numeric = [item for item in blend if _as_weight(item) is not None]
        if numeric:
            raise ValueError(f"{flag}: mixes weights and prefixes ({numeric[0]!r} without a weight "
                             f"before the first prefix); give a weight before every prefix or none")
        return [item.strip() for item in blend], None
    if len(blend) % 2 == 1:
        raise ValueError(f"{flag}: odd number of entries ({len(blend)}) in a weighted blend; "
                         f"give 'WEIGHT PREFIX' pairs, e.g. 0.3 dataA 0.7 dataB")
    prefixes, weights = [], []
    for raw_weight, prefix in zip(blend[0::2], blend[1::2]):
        weight = _as_weight(raw_weight)
        if weight is None:
            raise ValueError(f"{flag}: weight {raw_weight!r} (before {prefix!r}) is not a number; "
                             f"give 'WEIGHT PREFIX' pairs")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{flag}: weight {raw_weight} of {prefix!r} must be a finite number >= 0")
        if _as_weight(prefix) is not None:
            raise ValueError(f"{flag}: {prefix!r} follows a weight but is itself a number; "
                             f"give 'WEIGHT PREFIX' pairs")
        prefixes.append(prefix.strip())
        weights.append(weight)
    if sum(weights) <= 0:
        raise ValueError(f"{flag}: the weights sum to 0; at least one must be positive")
    return prefixes, weights


def check_blend_files(blend: Optional[Blend], flag: str = "--data-path") -> None:
    """Raise naming every prefix whose `.bin` or `.idx` file does not exist."""
    if blend is None:
        return
    missing = [f"{p}{suffix}" for p in blend[0] for suffix in (".bin", ".idx")
               if not os.path.isfile(p + suffix)]
    if missing:
        raise ValueError(f"{flag}: missing dataset file(s) {', '.join(missing)}; pass the path prefix "
                         f"(without .bin/.idx) of a dataset written by `teratron preprocess`")


def parse_and_normalize_split(split: str) -> List[float]:
    """`"949,50,1"` -> `[0.949, 0.05, 0.001]`; missing trailing parts are 0."""
    parts = [p.strip() for p in re.split(r"[,/]", split)]
    if not 1 <= len(parts) <= len(Split) or any(p == "" for p in parts):
        raise ValueError(f"--split {split!r}: give up to {len(Split)} comma-separated weights "
                         f"for train,valid,test, e.g. 949,50,1")
    values = []
    for p in parts:
        value = _as_weight(p)
        if value is None or not math.isfinite(value) or value < 0:
            raise ValueError(f"--split {split!r}: {p!r} is not a number >= 0")
        values.append(value)
    values += [0.0] * (len(Split) - len(values))
    if sum(values) <= 0:
        raise ValueError(f"--split {split!r}: the weights sum to 0; give the train share, e.g. 1,0,0")
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector: List[float],
) -> List[Optional[Tuple[float, float]]]:
    """`[0.9, 0.1, 0.0]` -> `[(0.0, 0.9), (0.9, 1.0), None]`: each split's book-ends."""
    bounds = [0.0]
    for share in vector:
        bounds.append(bounds[-1] + share)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:])]


def get_train_valid_test_num_samples(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> List[int]:
    """Samples each split must provide, as Megatron's training loop asks for them: all training
    iterations, and `eval_iters` batches at every evaluation plus the final one."""
    evaluations = (train_iters // eval_interval + 1) * eval_iters if eval_interval > 0 else eval_iters
    return [train_iters * global_batch_size,
            evaluations * global_batch_size,
            eval_iters * global_batch_size]


def is_rank_zero() -> bool:
    """Whether this process writes the shared caches (rank 0, or the only process)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


@contextmanager
def atomic_write(path: str, mode: str = "wb"):
    """Open a temporary file beside `path`; rename it onto `path` only if the block succeeds."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise


def save_npy_atomic(path: str, array: numpy.ndarray) -> None:
    with atomic_write(path) as f:
        numpy.save(f, array, allow_pickle=False)
