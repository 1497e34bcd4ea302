"""Autograd collectives between tensor-parallel regions: the only place TP communication lives.

Each function's backward is the dual collective of its forward. "Last dim" functions move
between replicated activations and hidden-dim shards ([..., h] <-> [..., h/tp]); "sequence"
functions move between replicated and sequence-sharded activations along dim 0
([s, b, h] <-> [s/tp, b, h]). `group=None` means the current topology's TP group, and no
communication at all when there is none.
"""

import torch
import torch.distributed as dist

from teratron import comm
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.tensor_parallel.utils import divide, resolve_tp_group


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group (a new tensor: autograd may still hold `x`)."""
    if get_pg_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split_along_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return x
    chunk = divide(x.shape[-1], world_size)
    return x.narrow(-1, get_pg_rank(group) * chunk, chunk).contiguous()


def _split_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return x
    chunk = divide(x.shape[0], world_size)
    return x.narrow(0, get_pg_rank(group) * chunk, chunk).contiguous()


def _gather_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return x
    output = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
    comm.all_gather_into_tensor(output, x, group)
    return output


def _gather_along_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return x
    # Gather along dim 0 (contiguous per rank), then lay the rank blocks side by side.
    stacked = _gather_along_first_dim(x, group)
    return torch.cat(stacked.chunk(world_size, dim=0), dim=-1).contiguous()


def _reduce_scatter_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world_size = get_pg_size(group)
    if world_size == 1:
        return x
    output = x.new_empty((divide(x.shape[0], world_size), *x.shape[1:]))
    comm.reduce_scatter_tensor(output, x, group)
    return output


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_last_dim(grad, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad, group):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        # A TP-parallel consumer (a column layer) leaves each rank a partial gradient of the
        # full sequence: sum them and keep this rank's part. A replicated consumer leaves the
        # same full gradient on every rank: just keep this rank's part.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad, ctx.group), None, None
        return _split_along_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_first_dim(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(input_, group=None):
    """Forward: identity. Backward: all-reduce (each rank's partial gradient summed)."""
    return _CopyToModelParallelRegion.apply(input_, resolve_tp_group(group))


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """Forward: all-reduce. Backward: identity."""
    return _ReduceFromModelParallelRegion.apply(input_, resolve_tp_group(group))


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""
    return _ScatterToModelParallelRegion.apply(input_, resolve_tp_group(group))


def gather_from_tensor_model_parallel_region(input_, group=None):
    """Forward: all-gather the last dim. Backward: keep this rank's slice."""
    return _GatherFromModelParallelRegion.apply(input_, resolve_tp_group(group))


def scatter_to_sequence_parallel_region(input_, group=None):
    """Forward: keep this rank's slice of dim 0. Backward: all-gather dim 0."""
    return _ScatterToSequenceParallelRegion.apply(input_, resolve_tp_group(group))


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None):
    """Forward: all-gather dim 0. Backward: reduce-scatter dim 0 when the consumer is
    tensor-parallel (tensor_parallel_output_grad), else keep this rank's slice."""
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad, resolve_tp_group(group))


def reduce_scatter_to_sequence_parallel_region(input_, group=None):
    """Forward: reduce-scatter dim 0. Backward: all-gather dim 0."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_, resolve_tp_group(group))
