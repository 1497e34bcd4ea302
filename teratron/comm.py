"""Backend-agnostic dim-0 collectives: all-gather into one tensor and reduce-scatter from one;
and `sum_over_ranks`, a count summed over a group.

NCCL (and gloo in recent PyTorch) has both natively. A backend that lacks one (gloo in older
PyTorch) falls back to a list all-gather, or an all-reduce followed by taking this rank's slice:
more traffic, the same result. Groups come resolved (teratron.topology): `group=None` is a group
of one here, a copy and no communication.

Like torch.distributed, each returns a work handle with `async_op=True` (call `.wait()`) and
None otherwise; a fallback runs synchronously and returns an already-completed handle.
"""

import torch
import torch.distributed as dist

from teratron.process_groups import get_pg_rank, get_pg_size

# PyTorch 2.10+ names them *_single; older versions only have the *_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

# Backends found to lack a native collective (filled on first failure).
_NO_NATIVE_ALL_GATHER: set = set()
_NO_NATIVE_REDUCE_SCATTER: set = set()


class _Completed:
    """The handle of work that already finished."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _unsupported(error: Exception) -> bool:
    message = str(error).lower()
    return "support" in message or "not implemented" in message


def _try_native(fn, missing: set, group, *args, **kwargs) -> tuple[bool, object]:
    """(True, fn's result) if the backend has the collective, else (False, None), remembered."""
    backend = dist.get_backend(group)
    if backend in missing:
        return False, None
    try:
        return True, fn(*args, group=group, **kwargs)
    except RuntimeError as error:
        if not _unsupported(error):
            raise
        missing.add(backend)
        return False, None


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """output[r * n:(r + 1) * n] = rank r's input (n = input.shape[0])."""
    world_size = get_pg_size(group)
    if output.shape[0] != world_size * input.shape[0] or output.shape[1:] != input.shape[1:]:
        raise ValueError(f"all_gather_into_tensor: output {tuple(output.shape)} must be "
                         f"{world_size} x input {tuple(input.shape)} along dim 0")
    if world_size == 1:
        output.copy_(input)
        return _Completed() if async_op else None
    input = input.contiguous()
    native, work = _try_native(_all_gather_single, _NO_NATIVE_ALL_GATHER, group, output, input,
                               async_op=async_op)
    if native:
        return work
    dist.all_gather(list(output.chunk(world_size)), input, group=group)
    return _Completed() if async_op else None


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                          op=dist.ReduceOp.SUM, async_op: bool = False):
    """output = reduction over ranks of input's r-th dim-0 slice (r = this rank)."""
    world_size = get_pg_size(group)
    if input.shape[0] != world_size * output.shape[0] or output.shape[1:] != input.shape[1:]:
        raise ValueError(f"reduce_scatter_tensor: input {tuple(input.shape)} must be "
                         f"{world_size} x output {tuple(output.shape)} along dim 0")
    if world_size == 1:
        output.copy_(input)
        return _Completed() if async_op else None
    input = input.contiguous()
    native, work = _try_native(_reduce_scatter_single, _NO_NATIVE_REDUCE_SCATTER, group, output, input,
                               op=op, async_op=async_op)
    if native:
        return work
    reduced = input.clone()
    average = op == dist.ReduceOp.AVG  # not every backend's all-reduce averages
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM if average else op, group=group)
    if average:
        reduced /= world_size
    output.copy_(reduced.chunk(world_size)[get_pg_rank(group)])
    return _Completed() if async_op else None


def sum_over_ranks(count, group=None):
    """A count (tokens, a loss sum; no gradient) summed over `group`'s ranks, e.g. a micro-batch's
    over its context-parallel ranks, each of which holds a part of the sequence; the count itself
    for a group of one."""
    if get_pg_size(group) == 1:
        return count
    total = torch.as_tensor(count).detach().clone()
    dist.all_reduce(total, group=group)
    return total
