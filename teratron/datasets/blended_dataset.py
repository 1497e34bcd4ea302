"""`BlendedDataset`: several datasets interleaved by weight (Megatron's greedy blending index)."""

import hashlib
from collections import OrderedDict
from typing import Dict, List, Optional

import numpy
import torch

from teratron.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from teratron.datasets.helpers import build_blending_indices, build_exhaustive_blending_indices
from teratron.datasets.megatron_dataset import load_or_build_indices, to_description
from teratron.datasets.utils import normalize


class BlendedDataset(torch.utils.data.Dataset):
    """Sample i is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`; the counts
    follow the normalised weights greedily. `size=None` takes every sample of every dataset once
    (weights then are the dataset sizes)."""

    def __init__(self, datasets: List[torch.utils.data.Dataset], weights: List[float],
                 size: Optional[int], config: BlendedMegatronDatasetConfig) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        if not 0 < len(datasets) < 32767:
            raise ValueError(f"BlendedDataset: needs 1 to 32766 datasets, got {len(datasets)}")
        self.datasets = datasets
        self.weights = normalize(weights)
        self.size = size
        self.config = config

        unique_identifiers = OrderedDict()
        unique_identifiers["class"] = type(self).__name__
        unique_identifiers["datasets"] = [d.unique_identifiers for d in datasets]
        unique_identifiers["weights"] = self.weights
        unique_identifiers["size"] = self.size
        self.unique_identifiers = unique_identifiers
        self.unique_description = to_description(unique_identifiers)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()

        (self.dataset_index, self.dataset_sample_index), self.built_anew_on_cache_miss = load_or_build_indices(
            config.path_to_cache, f"{self.unique_description_hash}-{type(self).__name__}",
            self.unique_description, ["dataset_index", "dataset_sample_index"], self._build_indices)
        if self.size is None:
            self.size = len(self.dataset_index)
        self._check_bounds()

    def _build_indices(self):
        if self.size is None:
            return list(build_exhaustive_blending_indices([len(d) for d in self.datasets]))
        return list(build_blending_indices(self.weights, self.size))

    def _check_bounds(self) -> None:
        """Every dataset must hold the samples the blend takes from it (dataset j's sample
        indices run 0, 1, ..., so their count is the bound)."""
        needed = numpy.bincount(numpy.asarray(self.dataset_index, dtype=numpy.int64),
                                minlength=len(self.datasets))
        for j, dataset in enumerate(self.datasets):
            if needed[j] > len(dataset):
                raise ValueError(f"BlendedDataset: the blend takes {needed[j]} samples from dataset "
                                 f"{j} which has {len(dataset)}; raise mid_level_dataset_surplus")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not -self.size <= idx < self.size:
            raise IndexError(f"BlendedDataset index {idx} out of range for size {self.size}")
        dataset_id = int(self.dataset_index[idx])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return {"dataset_id": torch.tensor(dataset_id), **sample}
