"""Shapes of tensor-parallel shards: divide, shard/gather full tensors, vocab ranges, padding."""

import torch

from teratron import comm
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.topology import resolve_pg_collection


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, which must divide exactly."""
    if denominator < 1 or numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}; choose sizes that split evenly")
    return numerator // denominator


def partition_parts(size: int, stride) -> list[int]:
    """The parts, each split over TP separately, that a partitioned dim of (global) `size` is made
    of: `stride` equal parts (an int: SwiGLU's [gate; up] is 2), or parts of the given global sizes
    (a tuple: Mamba's in_proj is [z; x; B; C; dt])."""
    if isinstance(stride, int):
        return [divide(size, stride)] * stride
    if sum(stride) != size:
        raise ValueError(f"partition sizes {tuple(stride)} do not add up to the dim's {size}")
    return list(stride)


def is_strided(stride) -> bool:
    """Whether a partition stride has more than one part."""
    return len(stride) > 1 if isinstance(stride, (tuple, list)) else stride > 1


def shard_tensor(full: torch.Tensor, dim: int, stride, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s shard of `full` split along `dim` over `world_size` ranks.

    With several parts (`partition_parts(stride)`), each part is split separately and rank r holds
    [part0_r; part1_r; ...] (e.g. SwiGLU's [gate_r; up_r] with stride 2).
    """
    sizes = partition_parts(full.shape[dim], stride)
    parts = full.split(sizes, dim=dim)
    local = [divide(size, world_size) for size in sizes]  # every part splits evenly
    return torch.cat([part.narrow(dim, rank * n, n) for part, n in zip(parts, local)], dim=dim).contiguous()


def gather_shards(shards: list[torch.Tensor], dim: int, stride) -> torch.Tensor:
    """The full tensor from every rank's shard (inverse of shard_tensor)."""
    world = len(shards)
    local_parts = [p // world for p in partition_parts(shards[0].shape[dim] * world, stride)]
    per_rank = [shard.split(local_parts, dim=dim) for shard in shards]
    return torch.cat([pieces[part] for part in range(len(local_parts)) for pieces in per_rank], dim=dim)


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    chunks = tensor.split(divide(tensor.shape[-1], num_partitions), dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


def resolve_tp_group(tp_group=None, is_expert: bool = False):
    """The group passed in, else the current topology's (expert-)TP group (None: a group of one)."""
    if tp_group is not None:
        return tp_group
    groups = resolve_pg_collection()
    return groups.expt_tp if is_expert else groups.tp


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False, group=None) -> torch.Tensor:
    """This TP rank's 1/tp of the flattened tensor (a view unless new_buffer)."""
    group = resolve_tp_group(group)
    chunk = divide(tensor.numel(), get_pg_size(group))
    start = chunk * get_pg_rank(group)
    piece = tensor.reshape(-1)[start:start + chunk]
    return piece.clone() if new_buffer else piece


def gather_split_1d_tensor(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Inverse of split_tensor_into_1d_equal_chunks: the flat tensor from every TP rank's chunk."""
    group = resolve_tp_group(group)
    output = torch.empty(tensor.numel() * get_pg_size(group), dtype=tensor.dtype, device=tensor.device)
    comm.all_gather_into_tensor(output, tensor.reshape(-1), group)
    return output


class VocabUtility:
    """The [first, last) vocabulary range a rank holds when the vocab is split evenly over TP."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> tuple[int, int]:
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            divide(global_vocab_size, world_size), rank, world_size)


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of make_vocab_size_divisible_by * tp_size that holds vocab_size
    (Megatron's _vocab_size_with_padding), so every TP rank holds an equal, aligned slice."""
    if vocab_size < 1 or make_vocab_size_divisible_by < 1 or tp_size < 1:
        raise ValueError(
            f"pad_vocab_size needs positive sizes, got vocab_size={vocab_size}, "
            f"make_vocab_size_divisible_by={make_vocab_size_divisible_by}, tp_size={tp_size}"
        )
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple
