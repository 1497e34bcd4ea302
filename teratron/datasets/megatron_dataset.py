"""`MegatronDataset`: the base of the split-aware datasets (GPT, mock), with the description whose
hash names their index cache, and the cache itself (written atomically by rank 0)."""

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import numpy
import torch

from teratron.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from teratron.datasets.utils import Split, atomic_write, is_rank_zero, save_npy_atomic


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """A dataset drawn from the documents `indices` of a low-level dataset, for one split. The
    low-level dataset's `content_signature` (None when it has no files) is part of the cache key."""

    def __init__(self, dataset, dataset_path: Optional[str], indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split,
                 config: BlendedMegatronDatasetConfig) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config

        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        # The files' size and mtime: indices cached for a dataset written again at the same path
        # (re-preprocessed) are not reused.
        self.unique_identifiers["dataset_content"] = dataset.content_signature
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attr in self._key_config_attributes():
            self.unique_identifiers[attr] = getattr(self.config, attr)
        self.unique_description = to_description(self.unique_identifiers)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset) -> int:
        """How many elements of the low-level dataset the split fractions apply to."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: BlendedMegatronDatasetConfig):
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> List[str]:
        """Config fields that change the indices, hence the cache key."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]: ...


def to_description(identifiers) -> str:
    """The JSON text whose md5 names a dataset's cache files."""
    return json.dumps(identifiers, indent=4, default=_describe)


def _describe(obj):
    """JSON fallback for config values (the tokenizer): a stable name, not an address."""
    if hasattr(obj, "unique_identifiers"):
        return obj.unique_identifiers
    parts = [type(obj).__name__]
    for attr in ("vocab_size", "eod"):
        if hasattr(obj, attr):
            parts.append(f"{attr}={getattr(obj, attr)}")
    return "(" + ", ".join(parts) + ")"


def load_or_build_indices(path_to_cache: Optional[str], base: str, description: str,
                          names: List[str], build: Callable[[], List[numpy.ndarray]]):
    """The cached arrays `{base}-{name}.npy` under `path_to_cache`, or `build()` on a miss.

    On a miss rank 0 builds and saves (each file written atomically, the description last, so its
    presence means the set is complete); another rank that still misses builds in memory. The
    builder calls rank 0 first and the others after a barrier, so they normally hit.
    Returns (arrays, built_anew)."""
    if not path_to_cache:
        return build(), True
    path_to = lambda affix: os.path.join(path_to_cache, f"{base}-{affix}")
    files = [path_to(f"{name}.npy") for name in names]
    description_path = path_to("description.txt")
    if all(map(os.path.isfile, [description_path, *files])):
        return [numpy.load(f, allow_pickle=False, mmap_mode="r") for f in files], False
    arrays = build()
    if is_rank_zero():
        try:
            os.makedirs(path_to_cache, exist_ok=True)
            for f, array in zip(files, arrays):
                save_npy_atomic(f, array)
            with atomic_write(description_path, "wt") as f:
                f.write(description)
        except OSError as err:
            raise ValueError(f"{path_to_cache}: cannot write the dataset index cache "
                             f"({err.strerror}); set --data-cache-path to a writable directory") from None
    return arrays, True
