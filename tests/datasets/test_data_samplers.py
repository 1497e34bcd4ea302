import pytest
import torch

from teratron.datasets.data_samplers import MegatronPretrainingSampler, build_pretraining_data_loader


class RangeDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        return {"tokens": torch.tensor([idx, idx * 10])}


def batches(total, consumed, mbs, dp, drop_last=True):
    """Per DP rank, the list of micro-batches its sampler yields."""
    return [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp, drop_last)) for r in range(dp)]


def test_dp_ranks_see_disjoint_contiguous_slices():
    per_rank = batches(total=50, consumed=0, mbs=3, dp=4)
    # Each step consumes one global batch of 12 consecutive samples, rank r taking [3r, 3r + 3).
    assert all(len(b) == 50 // 12 for b in per_rank)
    for step in range(4):
        global_batch = sum((per_rank[r][step] for r in range(4)), [])
        assert global_batch == list(range(12 * step, 12 * step + 12))
    seen = [i for b in per_rank for mb in b for i in mb]
    assert len(seen) == len(set(seen)) == 48
    # The incomplete last global batch (samples 48, 49) is dropped unless asked for.
    tail = batches(total=50, consumed=0, mbs=3, dp=4, drop_last=False)
    assert [b[-1] for b in tail] == [[48, 49], [], [], []]


def test_resume_continues_exactly():
    full = batches(total=60, consumed=0, mbs=2, dp=3)
    for steps_done in (1, 4, 7):
        resumed = batches(total=60, consumed=steps_done * 6, mbs=2, dp=3)
        assert resumed == [b[steps_done:] for b in full]


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="consumed_samples=10 leaves no samples"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank 2 is not in"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        MegatronPretrainingSampler(10, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="no samples"):
        MegatronPretrainingSampler(0, 0, 1, 0, 1)


def test_data_loader_with_workers_resumes():
    dataset = RangeDataset(40)
    loader = build_pretraining_data_loader(dataset, consumed_samples=8, micro_batch_size=2,
                                           data_parallel_rank=1, data_parallel_size=2, num_workers=2)
    assert loader.pin_memory == torch.cuda.is_available()
    got = [b["tokens"][:, 0].tolist() for b in loader]
    # Global batches of 4 from sample 8 on; rank 1 takes the second pair of each.
    assert got == [[4 * s + 2, 4 * s + 3] for s in range(2, 10)]
    plain = build_pretraining_data_loader(dataset, 8, 2, 1, 2, num_workers=0)
    assert [b["tokens"][:, 0].tolist() for b in plain] == got
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None
