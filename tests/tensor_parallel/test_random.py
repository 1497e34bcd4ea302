"""RNG streams under TP, and activation recompute that replays them exactly."""

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state
from teratron.tensor_parallel import (
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
)

SEED = 42


def _draw(seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return F.dropout(torch.ones(64), p=0.5)


def _block(x, w):
    """Dropout on a replicated activation (default stream) and on a 'sharded' one (tracker)."""
    h = F.dropout(x @ w, p=0.3)
    with get_cuda_rng_tracker().fork():
        h = F.dropout(torch.tanh(h), p=0.3)
    return h * 2


def _loss_and_grads(recompute, distribute=False):
    model_parallel_cuda_manual_seed(SEED)
    device = torch.get_default_device()
    x0 = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), device="cpu").to(device).requires_grad_()
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(2), device="cpu").to(device).requires_grad_()
    x = x0 * 1.0  # a non-leaf activation, as a layer's input is
    out = checkpoint(_block, distribute, x, w) if recompute else _block(x, w)
    out = _block(out, w)  # more randomness after the checkpointed block
    out.sum().backward()
    return out.detach(), x0.grad, w.grad, _draw()


def _streams():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(SEED)
    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        tp_mask = _draw()
    with tracker.fork(get_expert_parallel_rng_tracker_name()):
        expert_mask = _draw()
    default_mask = _draw()
    # Same math with recompute; its first argument kept 1/tp per rank between forward and backward.
    plain = _loss_and_grads(recompute=False)
    for distribute in (False, True):
        recomputed = _loss_and_grads(recompute=True, distribute=distribute)
        assert all(torch.equal(a, b) for a, b in zip(plain, recomputed)), distribute
    # The saved input is split over the group given, else over the topology's TP group.
    for group, kept in ((None, 8 * 16 // 2), (torch.distributed.group.WORLD, 8 * 16 // 4)):
        x = torch.randn(8, 16, requires_grad=True) * 1.0
        checkpoint(_block, True, x, torch.randn(16, 16), tp_group=group)
        assert x.numel() == kept, group
    return tp_mask, expert_mask, default_mask


def test_tracker_streams_across_tp_ranks():
    results = run_distributed(_streams, 4)
    # rank = tp + 2 * dp; expert grid (ETP = TP = 2, EP = 2): rank = etp + 2 * ep
    for rank, (tp_mask, expert_mask, default_mask) in enumerate(results):
        tp_rank, ep_rank = rank % 2, rank // 2
        # Independent reference: the streams are the default generator seeded as documented.
        assert torch.equal(tp_mask, _draw(SEED + 2718 + tp_rank))
        assert torch.equal(expert_mask, _draw(SEED + 1024 + 100 * ep_rank + tp_rank))
        # Forking does not disturb the default stream: it continues from seed SEED.
        assert torch.equal(default_mask, _draw(SEED))
    assert not torch.equal(results[0][0], results[1][0])  # TP ranks: different masks
    assert torch.equal(results[0][0], results[2][0])  # same TP rank, other DP rank: same mask
    assert all(torch.equal(r[2], results[0][2]) for r in results)  # default stream: same everywhere


def test_checkpoint_recompute_equals_plain_backward():
    plain = _loss_and_grads(recompute=False)
    recomputed = _loss_and_grads(recompute=True)
    for a, b in zip(plain, recomputed):
        assert torch.equal(a, b)  # same masks, same grads, same stream position afterwards
    assert get_rng_tracker() is get_cuda_rng_tracker()


def test_checkpoint_passes_non_tensor_args_and_tuple_outputs():
    def fn(x, scale, mask):
        return x * scale, (x.sum() if mask is None else x)

    x = torch.randn(4, requires_grad=True)
    a, b = checkpoint(fn, False, x, 3.0, None)
    (a.sum() + b).backward()
    assert torch.equal(x.grad, torch.full((4,), 4.0))


def test_tracker_errors_and_states():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a'"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="'missing'"):
        with tracker.fork("missing"):
            pass
    states = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(3)
    tracker.set_states(states)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), first)
    assert tracker.is_initialized()
    tracker.reset()
    assert not tracker.is_initialized()


def test_checkpoint_of_a_function_returning_a_parameter():
    """A recomputed function may return one of its parameters (an MLP's skipped bias)."""
    from teratron.tensor_parallel.random import checkpoint

    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def fn(inp):
        return lin(inp), lin.bias

    out, bias = checkpoint(fn, False, x)
    (out.sum() + 2 * bias.sum()).backward()
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    x_ref = x.detach().clone().requires_grad_(True)
    (ref(x_ref).sum() + 2 * ref.bias.sum()).backward()
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
