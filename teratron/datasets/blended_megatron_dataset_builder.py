"""`BlendedMegatronDatasetBuilder`: the train/valid/test datasets of a config, blended by weight.

Sizes are the samples each split must provide (`utils.get_train_valid_test_num_samples`). With
weights, dataset j of a split is asked for `ceil(ceil(size * w_j) * (1 + surplus))` samples (the
0.5% surplus absorbs the greedy blend running ahead of a share) and the blend has
`sum_j ceil(size * w_j)` samples. Without weights, each dataset gives one epoch and the blend
follows their sizes. Rank 0 builds first and writes the index caches; the other ranks then build
from those caches."""

import logging
import math
from typing import Callable, List, Optional, Type

import numpy
import torch

from teratron.datasets.blended_dataset import BlendedDataset
from teratron.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from teratron.datasets.megatron_dataset import MegatronDataset
from teratron.datasets.utils import Split, check_blend_files, normalize

logger = logging.getLogger(__name__)


class BlendedMegatronDatasetBuilder:
    def __init__(self, cls: Type[MegatronDataset], sizes: List[Optional[int]],
                 is_built_on_rank: Callable[[], bool], config: BlendedMegatronDatasetConfig) -> None:
        if len(sizes) != len(Split):
            raise ValueError(f"sizes needs {len(Split)} entries (train, valid, test), got {len(sizes)}")
        self.cls = cls
        self.sizes = sizes
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        if config.mock:
            return
        for split in Split:
            blend = config.blend if config.blend is not None else config.blend_per_split[split.value]
            if blend is not None and blend[1] is not None and sizes[split.value] is None:
                raise ValueError(f"the {split.name} split has weights but no requested size; "
                                 f"weighted blends need a sample count per split")
        check_blend_files(config.blend)
        for flag, blend in zip(("--train-data-path", "--valid-data-path", "--test-data-path"),
                               config.blend_per_split or [None] * len(Split)):
            check_blend_files(blend, flag)

    def build(self) -> List[Optional[torch.utils.data.Dataset]]:
        """[train, valid, test] (None for a split without data or on ranks that do not build).
        Call on every rank."""
        if not torch.distributed.is_initialized():
            datasets = self._build_splits()
        else:
            rank = torch.distributed.get_rank()
            datasets = self._build_splits() if rank == 0 else None
            torch.distributed.barrier()  # rank 0 has written the caches the others read
            if rank != 0:
                datasets = self._build_splits()
        logger.info("%s splits (train, valid, test): %s samples for %s requested", self.cls.__name__,
                    [None if d is None else len(d) for d in datasets], self.sizes)
        return datasets

    def _build_splits(self) -> List[Optional[torch.utils.data.Dataset]]:
        if not self.is_built_on_rank():
            return [None] * len(Split)
        if self.config.mock:
            return self._build_megatron_dataset_splits(None, self.config.split_matrix, self.sizes)
        if self.config.blend is not None:
            return self._build_blend(self.config.blend, self.config.split_matrix, self.sizes)
        datasets = []
        for i, blend in enumerate(self.config.blend_per_split):
            if blend is None:
                datasets.append(None)
                continue
            split_only_i = [(0.0, 1.0) if j == i else None for j in range(len(Split))]
            sizes_only_i = [self.sizes[i] if j == i else 0 for j in range(len(Split))]
            datasets.append(self._build_blend(blend, split_only_i, sizes_only_i)[i])
        return datasets

    def _build_blend(self, blend, split, sizes):
        prefixes, weights = blend
        if len(prefixes) == 1 and weights is None:
            return self._build_megatron_dataset_splits(prefixes[0], split, sizes)
        if weights is not None:
            weights = normalize(weights)
            target = _get_size_per_split_per_dataset(weights, sizes)
            buffered = _get_size_per_split_per_dataset(
                weights, sizes, surplus=self.config.mid_level_dataset_surplus)
        else:
            buffered = [[None] * len(Split) for _ in prefixes]
        per_prefix = [self._build_megatron_dataset_splits(p, split, b) for p, b in zip(prefixes, buffered)]

        blended = [None] * len(Split)
        for i in range(len(Split)):
            if split[i] is None:
                continue
            members = [(j, splits[i]) for j, splits in enumerate(per_prefix) if splits[i] is not None]
            if not members:
                continue
            datasets = [d for _, d in members]
            if weights is not None:
                size = sum(target[j][i] for j, _ in members)
                split_weights = [weights[j] for j, _ in members]
            else:
                split_weights = [len(d) for d in datasets]
                size = None if sizes[i] is None else min(sizes[i], sum(split_weights))
            blended[i] = BlendedDataset(datasets, split_weights, size, self.config)
        return blended

    def _build_megatron_dataset_splits(self, dataset_path: Optional[str], split, sizes):
        """One dataset per split, each over its contiguous range of the low-level dataset."""
        low_level = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level)
        datasets = []
        for i, split_name in enumerate(Split):
            if split[i] is None:
                datasets.append(None)
                continue
            beg = int(round(split[i][0] * float(num_elements)))
            end = int(round(split[i][1] * float(num_elements)))
            if beg == end and not sizes[i]:
                # A split too small to hold a document, and nothing asked of it.
                datasets.append(None)
                continue
            indices = numpy.arange(beg, end, dtype=numpy.int32)
            datasets.append(self.cls(low_level, dataset_path, indices, sizes[i], split_name, self.config))
        return datasets


def _get_size_per_split_per_dataset(normalized_weights: List[float], target_size_per_split,
                                    surplus: float = 0.0) -> List[List[Optional[int]]]:
    """[dataset][split] sample counts: the weight's share of each split's size, plus the surplus."""
    return [[None if size is None else int(math.ceil(math.ceil(size * w) * (1 + surplus)))
             for size in target_size_per_split]
            for w in normalized_weights]
