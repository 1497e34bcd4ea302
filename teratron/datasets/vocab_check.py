"""The start-up check that every token id of a dataset is a token of the run's vocabulary.

An id at or above the vocabulary size would index past the embedding (an `IndexError` on CPU, a
device assert on GPU, mid-run); a negative one likewise. The check reads the whole `.bin` once:
a vectorized min/max over `_SCAN_BYTES` chunks of the memory map, so its cost is one sequential
read of the file (disk-bound, e.g. minutes for a TB on one NVMe drive) and no Python loop over
tokens. The (min, max) it finds is cached beside the sample-index cache, keyed by the files' size
and mtime, so later runs (and the other ranks, which build after rank 0) read a small JSON file
instead; the vocabulary is compared with the cached range, so a run with another tokenizer needs
no new scan. A dtype that cannot hold an id out of range (uint8/uint16 under a vocabulary of
256/65536 or more) needs no scan at all. The scan covers every byte a sample can read, because
`IndexedDataset` refuses an index whose sequences do not tile the `.bin` exactly.
"""

import hashlib
import json
import os
from typing import Optional, Tuple

import numpy

from teratron.datasets.indexed_dataset import IndexedDataset, get_bin_path
from teratron.datasets.utils import atomic_write, is_rank_zero

_SCAN_BYTES = 64 << 20


def check_token_ids(dataset: IndexedDataset, vocab_size: int, cache_dir: Optional[str]) -> None:
    """Raise a one-line ValueError naming the `.bin` when one of its ids is outside
    [0, vocab_size); `cache_dir` holds the scanned range (None: scan, cache nothing)."""
    if not numpy.issubdtype(dataset.dtype, numpy.integer):
        raise ValueError(f"{get_bin_path(dataset.path_prefix)}: holds {numpy.dtype(dataset.dtype).name} "
                         f"values, not token ids; preprocess the data with `teratron preprocess`")
    info = numpy.iinfo(dataset.dtype)
    if info.min >= 0 and info.max < vocab_size:
        return
    lowest, highest = _cached_token_id_range(dataset, cache_dir)
    bin_path = get_bin_path(dataset.path_prefix)
    if highest >= vocab_size:
        raise ValueError(f"{bin_path}: token id {highest} is not below the vocabulary size {vocab_size}: "
                         f"the data was tokenized with another tokenizer; pass that tokenizer's flags "
                         f"(--tokenizer-type, --tokenizer-model, --vocab-size, ...) or preprocess the "
                         f"data again with this one")
    if lowest < 0:
        raise ValueError(f"{bin_path}: token id {lowest} is negative: the data file is damaged; "
                         f"preprocess the data again")


def token_id_range(dataset: IndexedDataset) -> Tuple[int, int]:
    """(smallest, largest) id in the `.bin`; the smallest is 0 for unsigned dtypes (not scanned),
    and an empty file gives (0, -1)."""
    if dataset.bin_bytes == 0:
        return 0, -1
    tokens = numpy.memmap(get_bin_path(dataset.path_prefix), dtype=dataset.dtype, mode="r")
    signed = numpy.iinfo(dataset.dtype).min < 0
    step = max(1, _SCAN_BYTES // tokens.itemsize)
    lowest, highest = [0], []
    for start in range(0, len(tokens), step):
        chunk = tokens[start:start + step]
        highest.append(chunk.max())
        if signed:
            lowest.append(chunk.min())
    return int(min(lowest)), int(max(highest))


def _cached_token_id_range(dataset: IndexedDataset, cache_dir: Optional[str]) -> Tuple[int, int]:
    """The range from the cache when it describes these exact files, else a scan (which rank 0
    writes to the cache)."""
    key = {"path_prefix": os.path.abspath(dataset.path_prefix), **dataset.content_signature}
    path = None
    if cache_dir:
        name = hashlib.md5(key["path_prefix"].encode("utf-8")).hexdigest()
        path = os.path.join(cache_dir, f"{name}-IndexedDataset-token_id_range.json")
        cached = _read_json(path)
        if cached is not None and cached.get("key") == key:
            return int(cached["min"]), int(cached["max"])
    lowest, highest = token_id_range(dataset)
    if path is not None and is_rank_zero():
        try:
            os.makedirs(cache_dir, exist_ok=True)
            with atomic_write(path, "wt") as f:
                json.dump({"key": key, "min": lowest, "max": highest}, f)
        except OSError as err:
            raise ValueError(f"{cache_dir}: cannot write the dataset index cache ({err.strerror}); "
                             f"set --data-cache-path to a writable directory") from None
    return lowest, highest


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):  # absent or damaged: scan again and rewrite it
        return None
    return value if isinstance(value, dict) else None
