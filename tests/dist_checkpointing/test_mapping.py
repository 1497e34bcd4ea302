"""Where a rank's tensor-parallel shard (or a flat slice of it) sits in the global tensor: the boxes
`shard_tensor_items` gives, written at their offsets, rebuild exactly the full tensor, for one part,
equal parts (SwiGLU's stride 2) and unequal parts (Mamba's in_proj), along either dim."""

import pytest
import torch

from teratron.dist_checkpointing.mapping import shard_tensor_items
from teratron.tensor_parallel.utils import gather_shards, shard_tensor

FULL = torch.arange(24 * 6, dtype=torch.float32).view(24, 6)


def _assemble(items, shape):
    out, written = torch.zeros(shape), torch.zeros(shape, dtype=torch.int64)
    for item in items:
        assert item.global_shape == shape
        box = tuple(slice(o, o + n) for o, n in zip(item.global_offset, item.data.shape))
        out[box] = item.data
        written[box] += 1
    return out, written


@pytest.mark.parametrize("stride", [1, 2, (8, 8, 4, 4)])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_place_back_into_the_full_tensor(stride, world):
    for dim, full in ((0, FULL), (1, FULL.t().contiguous())):
        shards = [shard_tensor(full, dim, stride, rank, world) for rank in range(world)]
        assert torch.equal(gather_shards(shards, dim, stride), full)
        items = [item for rank, shard in enumerate(shards)
                 for item in shard_tensor_items("w", shard, dim, stride, rank, world)]
        out, written = _assemble(items, tuple(full.shape))
        assert torch.equal(out, full) and bool((written == 1).all())


@pytest.mark.parametrize("stride", [2, (8, 8, 4, 4)])
def test_flat_slices_of_a_shard_place_back(stride):
    """The distributed optimizer's (and FSDP's) flat ranges of a TP shard: cut each rank's shard
    into three flat slices; together they cover the full tensor once."""
    world = 2
    items = []
    for rank in range(world):
        shard = shard_tensor(FULL, 0, stride, rank, world)
        cuts = [0, 17, 40, shard.numel()]
        for start, end in zip(cuts, cuts[1:]):
            items += shard_tensor_items("w", shard.reshape(-1)[start:end], 0, stride, rank, world,
                                        flat_range=(start, end), local_shape=tuple(shard.shape))
    out, written = _assemble(items, tuple(FULL.shape))
    assert torch.equal(out, FULL) and bool((written == 1).all())


def test_parts_must_add_up_and_split_evenly():
    with pytest.raises(ValueError, match=r"partition sizes \(8, 8\) do not add up to the dim's 24"):
        shard_tensor(FULL, 0, (8, 8), 0, 2)
    with pytest.raises(ValueError, match="not divisible by 4"):
        shard_tensor(FULL, 0, (10, 10, 4), 0, 4)
