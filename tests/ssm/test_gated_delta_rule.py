"""Gated DeltaNet's chunked gated delta rule equals the recurrence it computes (float64, forward and
backward, ragged chunks, with and without an initial state, packed documents, which the recurrence
runs each as alone), and carries its state across calls."""

import pytest
import torch

from ssm.packed_documents import documents, seq_idx_of
from teratron.ssm import gated_delta_rule_chunked, gated_delta_rule_sequential


def _inputs(b=2, s=29, h=3, dk=4, dv=5, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(randn(b, s, h, dk), dim=-1) for _ in range(2))
    v = randn(b, s, h, dv)
    g = -torch.nn.functional.softplus(randn(b, s, h))  # log gates <= 0
    beta = torch.sigmoid(randn(b, s, h))
    return q, k, v, g, beta, randn(b, h, dv, dk)


def _naive(q, k, v, g, beta, state):
    """S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t, head by head."""
    b, s, h, dk = k.shape
    out = torch.zeros_like(v)
    state = state.clone()
    eye = torch.eye(dk, dtype=k.dtype)
    for t in range(s):
        for head in range(h):
            kt, vt = k[:, t, head], v[:, t, head]
            transition = torch.exp(g[:, t, head])[:, None, None] * (eye - beta[:, t, head, None, None]
                                                                    * kt[:, :, None] * kt[:, None, :])
            state[:, head] = state[:, head] @ transition + beta[:, t, head, None, None] * vt[:, :, None] * kt[:, None]
            out[:, t, head] = (state[:, head] @ q[:, t, head, :, None])[..., 0]
    return out, state


def test_sequential_is_the_definition():
    q, k, v, g, beta, state = _inputs()
    o, final = gated_delta_rule_sequential(q, k, v, g, beta, state)
    o_ref, final_ref = _naive(q, k, v, g, beta, state)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)


# 29 tokens a row: documents of 1 token, one starting on a chunk boundary of 4 and 16 (token 16),
# one crossing several chunks; a row of one document
PACKED_ROWS = ([7, 1, 8, 13], [29])


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_equals_sequential_forward_and_backward(chunk_size, with_state, packed):
    """packed: the rows' documents of PACKED_ROWS (an initial state goes to each row's first document)."""
    inputs = [t.requires_grad_() for t in _inputs()]
    q, k, v, g, beta, state = inputs
    state = state if with_state else None
    seq_idx = seq_idx_of(*PACKED_ROWS) if packed else None
    o, final = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size, seq_idx=seq_idx)
    o_ref, final_ref = gated_delta_rule_sequential(q, k, v, g, beta, state, seq_idx=seq_idx)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(o), torch.randn_like(final)
    used = inputs if with_state else inputs[:-1]
    grads = torch.autograd.grad((o * weights[0]).sum() + (final * weights[1]).sum(), used)
    grads_ref = torch.autograd.grad((o_ref * weights[0]).sum() + (final_ref * weights[1]).sum(), used)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_a_sequence_in_two_calls_equals_one_call():
    q, k, v, g, beta, _ = _inputs()
    o, final = gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=8)
    cut = 13
    o1, mid = gated_delta_rule_chunked(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], chunk_size=8)
    o2, end = gated_delta_rule_chunked(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], mid,
                                       chunk_size=8)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(end, final, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rule", [gated_delta_rule_sequential, gated_delta_rule_chunked])
def test_bf16_values_come_back_in_bf16_computed_in_fp32(rule):
    q, k, v, g, beta, state = _inputs()
    o, final = rule(q, k, v.bfloat16(), g, beta, state)
    assert o.dtype == final.dtype == torch.bfloat16
    o_ref, final_ref = gated_delta_rule_sequential(q, k, v.bfloat16().double(), g, beta, state)
    torch.testing.assert_close(o, o_ref.bfloat16(), rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(final, final_ref.bfloat16(), rtol=1.6e-2, atol=1e-5)


def test_packed_documents_each_run_as_alone():
    """The recurrence with seq_idx gives each document what it gives the document alone, from a
    zero state; the final state is the last document's."""
    q, k, v, g, beta, _ = _inputs()
    o, final = gated_delta_rule_sequential(q, k, v, g, beta, seq_idx=seq_idx_of(*PACKED_ROWS))
    finals = {}
    for row, part in documents(PACKED_ROWS):
        rows = slice(row, row + 1)
        o_alone, finals[row] = gated_delta_rule_sequential(*(t[rows, part] for t in (q, k, v, g, beta)))
        torch.testing.assert_close(o[rows, part], o_alone, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, torch.cat([finals[0], finals[1]]), rtol=1e-12, atol=1e-12)
