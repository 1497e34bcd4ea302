"""Mamba-2's chunked scan equals the recurrence it computes (float64, forward and backward; packed
documents too, which the recurrence runs each as alone), and the causal convolution equals its
definition; both carry state across calls as one call does."""

import pytest
import torch

from ssm.packed_documents import documents, seq_idx_of
from teratron.ssm import causal_conv1d, ssd_chunked, ssd_sequential


def _inputs(b=2, s=37, h=4, p=3, g=2, n=5, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    x, B, C = randn(b, s, h, p), randn(b, s, g, n), randn(b, s, g, n)
    dt = torch.nn.functional.softplus(randn(b, s, h))
    A = -torch.exp(randn(h))
    return x, dt, A, B, C, randn(h), randn(b, h, p, n)


def _naive(x, dt, A, B, C, D, state):
    """The definition with explicit loops over tokens and heads."""
    b, s, h, p = x.shape
    ys = torch.zeros_like(x)
    state = state.clone()
    for t in range(s):
        for head in range(h):
            group = head // (h // B.shape[2])
            decay = torch.exp(dt[:, t, head] * A[head])
            state[:, head] = (decay[:, None, None] * state[:, head]
                              + dt[:, t, head, None, None] * x[:, t, head, :, None] * B[:, t, group, None, :])
            ys[:, t, head] = (state[:, head] @ C[:, t, group, :, None])[..., 0] + D[head] * x[:, t, head]
    return ys, state


def test_sequential_is_the_definition():
    x, dt, A, B, C, D, state = _inputs()
    y, final = ssd_sequential(x, dt, A, B, C, D, state)
    y_ref, final_ref = _naive(x, dt, A, B, C, D, state)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)


# 37 tokens a row: documents of 1 token, one starting on a chunk boundary of 8 and 16 (token 16),
# one crossing several chunks; a row of one document
PACKED_ROWS = ([5, 1, 10, 21], [37])


@pytest.mark.parametrize("chunk_size", [1, 8, 16, 64])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_equals_sequential_forward_and_backward(chunk_size, with_state, packed):
    """37 tokens: ragged last chunk (or one padded chunk); 4 heads in 2 groups; packed: the rows'
    documents of PACKED_ROWS (an initial state goes to each row's first document)."""
    inputs = [t.requires_grad_() for t in _inputs()]
    x, dt, A, B, C, D, state = inputs
    state = state if with_state else None
    seq_idx = seq_idx_of(*PACKED_ROWS) if packed else None
    y, final = ssd_chunked(x, dt, A, B, C, D, state, chunk_size=chunk_size, seq_idx=seq_idx)
    y_ref, final_ref = ssd_sequential(x, dt, A, B, C, D, state, seq_idx=seq_idx)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(y), torch.randn_like(final)
    grads = torch.autograd.grad((y * weights[0]).sum() + (final * weights[1]).sum(), inputs, allow_unused=True)
    grads_ref = torch.autograd.grad((y_ref * weights[0]).sum() + (final_ref * weights[1]).sum(), inputs,
                                    allow_unused=True)
    for got, want in zip(grads, grads_ref):
        if want is None:
            assert got is None or not with_state
            continue
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_a_sequence_in_two_calls_equals_one_call():
    """The final state continues the scan: what a decoding engine keeps per request."""
    x, dt, A, B, C, D, _ = _inputs()
    y, final = ssd_chunked(x, dt, A, B, C, D, chunk_size=8)
    cut = 20
    y1, mid = ssd_chunked(x[:, :cut], dt[:, :cut], A, B[:, :cut], C[:, :cut], D, chunk_size=8)
    y2, end = ssd_chunked(x[:, cut:], dt[:, cut:], A, B[:, cut:], C[:, cut:], D, mid, chunk_size=8)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(end, final, rtol=1e-10, atol=1e-10)


def test_low_precision_inputs_compute_in_fp32():
    x, dt, A, B, C, D, state = (t.float() for t in _inputs())
    y, _ = ssd_chunked(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), D, chunk_size=16)
    y_ref, _ = ssd_sequential(x.bfloat16().double(), dt.double(), A.double(), B.bfloat16().double(),
                              C.bfloat16().double(), D.double())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), y_ref, rtol=2**-7, atol=2**-7 * y_ref.abs().max().item())


def test_causal_conv1d_is_its_definition_and_continues_across_calls():
    gen = torch.Generator().manual_seed(1)
    b, s, c, k = 2, 11, 6, 4
    x = torch.randn(b, s, c, generator=gen, dtype=torch.float64)
    weight, bias = torch.randn(c, k, generator=gen, dtype=torch.float64), torch.randn(c, generator=gen,
                                                                                      dtype=torch.float64)
    y, state = causal_conv1d(x, weight, bias)
    padded = torch.cat([x.new_zeros(b, k - 1, c), x], dim=1)
    want = torch.stack([(padded[:, t:t + k] * weight.t()).sum(1) + bias for t in range(s)], dim=1)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, x[:, -(k - 1):].transpose(1, 2))
    y1, mid = causal_conv1d(x[:, :5], weight, bias)
    y2, end = causal_conv1d(x[:, 5:], weight, bias, mid)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(end, state)


def test_packed_documents_each_run_as_alone():
    """The recurrence with seq_idx gives each document what it gives the document alone, from a
    zero state; the final state is the last document's."""
    x, dt, A, B, C, D, _ = _inputs()
    seq_idx = seq_idx_of(*PACKED_ROWS)
    y, final = ssd_sequential(x, dt, A, B, C, D, seq_idx=seq_idx)
    finals = {}
    for row, part in documents(PACKED_ROWS):
        rows = slice(row, row + 1)
        y_alone, finals[row] = ssd_sequential(x[rows, part], dt[rows, part], A, B[rows, part], C[rows, part], D)
        torch.testing.assert_close(y[rows, part], y_alone, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, torch.cat([finals[0], finals[1]]), rtol=1e-12, atol=1e-12)
