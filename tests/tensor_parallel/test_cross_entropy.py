"""vocab_parallel_cross_entropy equals cross entropy over the real vocabulary.

References: torch's F.cross_entropy for the plain loss, and for label smoothing both an
explicit target distribution (1 - alpha on the target, alpha / (K - 1) on each other class of
the K classes: Megatron's convention) and F.cross_entropy with the equivalent
label_smoothing = alpha * K / (K - 1). Without `unpadded_vocab_size` the K classes are every
(padded) column; with it they are the first K columns only, the reference is computed over the
logits cut to K columns, and the padding columns (filled with large values that would dominate
the softmax if they took part) must get exactly zero gradient, whatever the TP size, including
ranks that hold only padding.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from dist import run_distributed
from teratron import parallel_state
from teratron.tensor_parallel import pad_vocab_size, vocab_parallel_cross_entropy
from teratron.tensor_parallel.utils import shard_tensor

S, B, VOCAB = 6, 3, 30  # VOCAB is not divisible by the TP sizes: it is padded


def _t(seed, shape):
    """A fixed tensor, the same on every rank (drawn on CPU, placed on the default device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, device="cpu").to(torch.get_default_device())


def _explicit_smoothed_loss(logits, target, alpha):
    k = logits.shape[-1]
    q = torch.full_like(logits, alpha / (k - 1)).scatter(-1, target.unsqueeze(-1), 1.0 - alpha)
    return -(q * logits.log_softmax(-1)).sum(-1)


def _reference(logits, target, alpha):
    """Loss and logits grad (upstream: a fixed per-token weight) from plain autograd."""
    logits = logits.clone().requires_grad_(True)
    loss = _explicit_smoothed_loss(logits, target, alpha) if alpha else \
        F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction="none").view(target.shape)
    loss.backward(_t(3, target.shape))
    return loss.detach(), logits.grad


def _check(group, r, n):
    vocab = pad_vocab_size(VOCAB, 4, n)
    assert vocab > VOCAB and vocab % n == 0
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(2), device="cpu").to(
        torch.get_default_device())
    for offset in (0.0, 1e4):  # a large common offset must not overflow (max subtraction)
        full = _t(1, (S, B, vocab)) * 3 + offset
        for alpha in (0.0, 0.1):
            ref_loss, ref_grad = _reference(full, target, alpha)
            if alpha:
                k = vocab
                torch_loss = F.cross_entropy(full.flatten(0, 1), target.flatten(), reduction="none",
                                             label_smoothing=alpha * k / (k - 1)).view(S, B)
                assert_close(ref_loss, torch_loss)
            shard = shard_tensor(full, -1, 1, r, n).requires_grad_(True)
            loss = vocab_parallel_cross_entropy(shard, target, label_smoothing=alpha, group=group)
            loss.backward(_t(3, target.shape))
            assert_close(loss.detach(), ref_loss)
            assert_close(shard.grad, shard_tensor(ref_grad, -1, 1, r, n))
    # Any leading shape: flat tokens [N, V/tp].
    full = _t(4, (S * B, vocab))
    ref_loss, _ = _reference(full, target.flatten(), 0.0)
    loss = vocab_parallel_cross_entropy(shard_tensor(full, -1, 1, r, n), target.flatten(), group=group)
    assert_close(loss, ref_loss)


def _check_padding_excluded(group, r, n):
    """Padded to a multiple of 16 * n columns: at n = 4 (64 columns) rank 0 holds only real
    columns, rank 1 real and padding ones, ranks 2 and 3 only padding."""
    padded = pad_vocab_size(VOCAB, 16, n)
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(2), device="cpu").to(
        torch.get_default_device())
    real = _t(1, (S, B, VOCAB)) * 3
    for alpha in (0.0, 0.1):
        ref_loss, ref_grad = _reference(real, target, alpha)  # over the real vocabulary only
        if alpha:
            torch_loss = F.cross_entropy(real.flatten(0, 1), target.flatten(), reduction="none",
                                         label_smoothing=alpha * VOCAB / (VOCAB - 1)).view(S, B)
            assert_close(ref_loss, torch_loss)
        full = torch.cat([real, _t(7, (S, B, padded - VOCAB)).abs() * 50 + 100], dim=-1)
        shard = shard_tensor(full, -1, 1, r, n).requires_grad_(True)
        loss = vocab_parallel_cross_entropy(shard, target, label_smoothing=alpha, group=group,
                                            unpadded_vocab_size=VOCAB)
        loss.backward(_t(3, target.shape))
        assert_close(loss.detach(), ref_loss)
        full_grad = torch.cat([ref_grad, torch.zeros(S, B, padded - VOCAB)], dim=-1)
        assert_close(shard.grad, shard_tensor(full_grad, -1, 1, r, n))
        is_padding = shard_tensor(torch.arange(padded), 0, 1, r, n) >= VOCAB
        assert torch.all(shard.grad[..., is_padding] == 0)


def _all_layouts():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    _check(None, dist.get_rank() % 2, 2)
    _check(dist.group.WORLD, dist.get_rank(), 4)
    _check_padding_excluded(None, dist.get_rank() % 2, 2)
    _check_padding_excluded(dist.group.WORLD, dist.get_rank(), 4)
    return True


def test_vocab_parallel_cross_entropy_tp2_tp4():
    assert run_distributed(_all_layouts, 4) == [True] * 4


def test_single_process_equals_torch_and_validates():
    _check(None, 0, 1)
    _check_padding_excluded(None, 0, 1)
    logits = _t(5, (B, S, VOCAB)).bfloat16().requires_grad_(True)
    target = torch.randint(0, VOCAB, (B, S))
    loss = vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert_close(loss, F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none"))
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_cross_entropy(logits, target[:, :-1])
    for bad in (VOCAB + 1, 1):
        with pytest.raises(ValueError, match="unpadded_vocab_size"):
            vocab_parallel_cross_entropy(logits, target, unpadded_vocab_size=bad)


def test_pad_vocab_size():
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 8) == 51200
    assert pad_vocab_size(256, 128, 2) == 256
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by"):
        pad_vocab_size(100, 0, 2)


def test_compiled_kernels_equal_the_plain_ones(monkeypatch):
    """On a GPU each pass is the same function compiled; force that path here (Inductor's CPU
    backend) and check it against the plain autograd reference, with padding and smoothing."""
    from teratron import fusions
    from teratron.tensor_parallel import cross_entropy

    monkeypatch.setattr(cross_entropy, "_kernel", lambda function, on_cuda: fusions.fused(function))
    _check(None, 0, 1)
    _check_padding_excluded(None, 0, 1)
