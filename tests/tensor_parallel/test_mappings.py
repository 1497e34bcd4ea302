"""Each TP mapping's forward and backward against the same math done serially.

Every rank builds every rank's inputs and upstream gradients from fixed seeds, so it can compute
the serial answer itself. One 4-rank launch checks TP=2 (parallel_state's group, group=None)
and TP=4 (the world group passed explicitly), with native collectives and with the fallbacks.
"""

import torch
import torch.distributed as dist
from torch.testing import assert_close

from dist import run_distributed
from teratron import comm, parallel_state
from teratron.tensor_parallel import mappings as m

S, B, H = 8, 2, 12


def _t(seed, shape):
    """A fixed tensor, the same on every rank (drawn on CPU, placed on the default device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, device="cpu").to(torch.get_default_device())


def _run(fn, x, grad):
    """fn(x) and d(sum(fn(x) * grad))/dx."""
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _check_mappings(group, r, n):
    """Rank r of n; group=None means parallel_state's TP group."""
    full = [_t(100 + q, (S, B, H)) for q in range(n)]  # rank q's full-size tensor
    last = [_t(200 + q, (S, B, H // n)) for q in range(n)]  # rank q's hidden shard
    first = [_t(300 + q, (S // n, B, H)) for q in range(n)]  # rank q's sequence shard
    h, s = H // n, S // n

    y, g = _run(lambda x: m.copy_to_tensor_model_parallel_region(x, group), full[0], full[r])
    assert_close(y, full[0])
    assert_close(g, sum(full))

    y, g = _run(lambda x: m.reduce_from_tensor_model_parallel_region(x, group), full[r], full[0])
    assert_close(y, sum(full))
    assert_close(g, full[0])

    y, g = _run(lambda x: m.scatter_to_tensor_model_parallel_region(x, group), full[0], last[r])
    assert_close(y, full[0][..., r * h:(r + 1) * h])
    assert_close(g, torch.cat(last, dim=-1))

    y, g = _run(lambda x: m.gather_from_tensor_model_parallel_region(x, group), last[r], full[r])
    assert_close(y, torch.cat(last, dim=-1))
    assert_close(g, full[r][..., r * h:(r + 1) * h])

    y, g = _run(lambda x: m.scatter_to_sequence_parallel_region(x, group), full[0], first[r])
    assert_close(y, full[0][r * s:(r + 1) * s])
    assert_close(g, torch.cat(first, dim=0))

    y, g = _run(lambda x: m.gather_from_sequence_parallel_region(x, True, group), first[r], full[r])
    assert_close(y, torch.cat(first, dim=0))
    assert_close(g, sum(full)[r * s:(r + 1) * s])

    y, g = _run(lambda x: m.gather_from_sequence_parallel_region(x, False, group), first[r], full[r])
    assert_close(y, torch.cat(first, dim=0))
    assert_close(g, full[r][r * s:(r + 1) * s])

    y, g = _run(lambda x: m.reduce_scatter_to_sequence_parallel_region(x, group), full[r], first[r])
    assert_close(y, sum(full)[r * s:(r + 1) * s])
    assert_close(g, torch.cat(first, dim=0))


def _all_layouts():
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    for fallback in (False, True):
        if fallback:  # pretend the backend lacks the native dim-0 collectives
            comm._NO_NATIVE_ALL_GATHER.add("gloo")
            comm._NO_NATIVE_REDUCE_SCATTER.add("gloo")
        _check_mappings(None, rank % 2, 2)
        _check_mappings(dist.group.WORLD, rank, 4)
        _check_comm(rank)
    return True


def _check_comm(rank):
    """The comm helpers directly: sync and async, SUM and AVG, and group=None (a copy)."""
    world, n = dist.group.WORLD, dist.get_world_size()
    rows = torch.arange(3.0 * n).view(n, 3)
    for async_op in (False, True):
        out = torch.empty(2 * n, 3)
        work = comm.all_gather_into_tensor(out, torch.full((2, 3), float(rank)), world, async_op=async_op)
        if async_op:
            work.wait()
        assert_close(out, torch.arange(float(n)).repeat_interleave(2)[:, None].expand(2 * n, 3))
        total = n * (n + 1) / 2  # sum over ranks q of (q + 1)
        for op, scale in ((dist.ReduceOp.SUM, total), (dist.ReduceOp.AVG, total / n)):
            part = torch.empty(1, 3)
            work = comm.reduce_scatter_tensor(part, rows * (rank + 1), world, op=op, async_op=async_op)
            if async_op:
                work.wait()
            assert_close(part, rows[rank:rank + 1] * scale)
    x = torch.randn(2, 3)
    out = torch.empty(2, 3)
    assert comm.all_gather_into_tensor(out, x, None) is None
    assert_close(out, x)
    comm.reduce_scatter_tensor(out, 2 * x, None)
    assert_close(out, 2 * x)


def test_mappings_match_serial_math_tp2_tp4_native_and_fallback():
    assert run_distributed(_all_layouts, 4) == [True] * 4


def test_mappings_without_model_parallel_are_identity():
    x = torch.randn(4, 2, 6, requires_grad=True)
    for fn in (m.copy_to_tensor_model_parallel_region, m.reduce_from_tensor_model_parallel_region,
               m.scatter_to_tensor_model_parallel_region, m.gather_from_tensor_model_parallel_region,
               m.scatter_to_sequence_parallel_region, m.gather_from_sequence_parallel_region,
               m.reduce_scatter_to_sequence_parallel_region):
        y = fn(x)
        assert_close(y, x)
        (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert_close(g, torch.ones_like(x))
