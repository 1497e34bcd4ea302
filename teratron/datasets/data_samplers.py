"""Megatron's pretraining sampler and data loader: samples in order, each global batch of
`micro_batch_size * data_parallel_size` samples cut into one contiguous micro-batch per DP rank,
starting after `consumed_samples` so a resumed run continues exactly where it stopped."""

from typing import Iterator, List, Optional

import torch


class MegatronPretrainingSampler:
    """Yields this DP rank's micro-batches of sample indices (the dataset already shuffles)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples (total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} leaves no samples of the "
                             f"{total_samples} in the dataset; build it with more samples "
                             f"(raise --train-iters or check the checkpoint)")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be > 0 (got {micro_batch_size})")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is not in "
                             f"[0, data_parallel_size={data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self):
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        start, end = self.get_start_end_idx()
        batch = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                yield batch[start:end]
                batch = []
        if batch and not self.drop_last:
            yield batch[start:end]


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int = 2, pin_memory: Optional[bool] = None):
    """A torch DataLoader over `dataset` with `MegatronPretrainingSampler` (None for no dataset).
    Pinned memory defaults to on when CUDA is available."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         data_parallel_rank, data_parallel_size)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    # An own generator keeps iterator creation off the global RNG, so a resumed run draws the
    # same dropout masks as an uninterrupted one.
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=pin_memory, persistent_workers=num_workers > 0,
                                       generator=torch.Generator())
