"""Core attention, RoPE, norms and the QKV layout against plain formulas written out here."""

import math

import pytest
import torch

from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.enums import AttnBackend, AttnMaskType
from teratron.transformer.norms import LayerNorm, Norm, RMSNorm
from teratron.transformer.rope import RotaryEmbedding, apply_rotary_pos_emb
from teratron.transformer.transformer_config import TransformerConfig


def make_config(**overrides):
    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                  hidden_dropout=0.0, use_cpu_initialization=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def plain_attention(q, k, v, masked, scale):
    """q, k, v: [s, b, n, hn] with the same head count; masked: bool [b, 1, sq, sk] or None."""
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bnst,tbnd->sbnd", probs, v)
    return out.reshape(out.shape[0], out.shape[1], -1)


def causal_mask(b, s):
    return torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s)


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_core_attention_paths_equal_plain_formula(groups):
    torch.manual_seed(0)
    s, b, n, hn = 7, 3, 4, 8
    q = torch.randn(s, b, n, hn)
    k, v = torch.randn(s, b, groups, hn), torch.randn(s, b, groups, hn)
    # GQA reference: every query head attends with its group's K/V head, repeated explicitly.
    k_rep, v_rep = (t.repeat_interleave(n // groups, dim=2) for t in (k, v))
    padding = torch.rand(b, 1, s, s) < 0.3
    arbitrary = causal_mask(b, s) | (padding & ~torch.eye(s, dtype=torch.bool))
    for backend in (AttnBackend.auto, AttnBackend.unfused, AttnBackend.local, AttnBackend.flash):
        config = make_config(num_attention_heads=n, hidden_size=n * hn, num_query_groups=groups,
                             attention_backend=backend)
        attn = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
        expected = plain_attention(q, k_rep, v_rep, causal_mask(b, s), 1 / math.sqrt(hn))
        torch.testing.assert_close(attn(q, k, v, None), expected, rtol=1e-5, atol=1e-6)
        expected = plain_attention(q, k_rep, v_rep, arbitrary, 1 / math.sqrt(hn))
        torch.testing.assert_close(attn(q, k, v, arbitrary), expected, rtol=1e-5, atol=1e-6)


def test_fully_masked_query_gets_zero_context_on_both_paths():
    q, k, v = (torch.randn(4, 1, 4, 8) for _ in range(3))
    mask = causal_mask(1, 4).clone()
    mask[..., 2, :] = True
    outputs = [DotProductAttention(make_config(attention_backend=backend), 1)(q, k, v, mask)
               for backend in ("auto", "unfused")]
    for out in outputs:
        assert torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(outputs[0], outputs[1])


def test_softmax_scale_and_query_key_layer_scaling():
    torch.manual_seed(1)
    s, b, n, hn = 5, 2, 4, 8
    q, k, v = (torch.randn(s, b, n, hn) for _ in range(3))
    expected = plain_attention(q, k, v, causal_mask(b, s), 0.3)
    for backend in ("auto", "unfused"):
        for layer_scaling in (False, True):
            config = make_config(softmax_scale=0.3, attention_backend=backend,
                                 apply_query_key_layer_scaling=layer_scaling)
            attn = DotProductAttention(config, layer_number=3)
            torch.testing.assert_close(attn(q, k, v), expected, rtol=1e-5, atol=1e-6)


def test_attention_dropout_paths_draw_under_tracker_and_differ_from_eval():
    from teratron.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(2)
    model_parallel_cuda_manual_seed(2)
    q, k, v = (torch.randn(6, 2, 4, 8) for _ in range(3))
    attn = DotProductAttention(make_config(attention_dropout=0.5, attention_backend="unfused"), 1)
    default_state = torch.get_rng_state()
    dropped = attn(q, k, v)
    # Attention dropout draws from the tracker's stream, not the default one.
    assert torch.equal(torch.get_rng_state(), default_state)
    assert not torch.allclose(dropped, attn.eval()(q, k, v))


def test_rope_matches_rotation_formula_for_one_position_pair():
    hn, base = 8, 10000.0
    torch.manual_seed(3)
    q, k = torch.randn(hn, dtype=torch.float64), torch.randn(hn, dtype=torch.float64)
    m, n = 5, 2
    for interleaved in (False, True):
        rope = RotaryEmbedding(hn, rotary_interleaved=interleaved, rotary_base=base)
        freqs = rope(torch.tensor([[m, n]])).double()  # [s=2, b=1, 1, hn]
        rotated_q = apply_rotary_pos_emb(q.view(1, 1, 1, hn).expand(2, 1, 1, hn), freqs, interleaved)[0, 0, 0]
        rotated_k = apply_rotary_pos_emb(k.view(1, 1, 1, hn).expand(2, 1, 1, hn), freqs, interleaved)[1, 0, 0]
        # Direct formula: pair i = channels (i, i + hn/2) (or (2i, 2i+1)), angle pos * base^(-2i/hn).
        pairs = [(2 * i, 2 * i + 1) if interleaved else (i, i + hn // 2) for i in range(hn // 2)]
        expected_q, expected_k = torch.empty(hn, dtype=torch.float64), torch.empty(hn, dtype=torch.float64)
        for i, (a, c) in enumerate(pairs):
            theta = base ** (-2 * i / hn)
            for src, dst, pos in ((q, expected_q, m), (k, expected_k, n)):
                cos, sin = math.cos(pos * theta), math.sin(pos * theta)
                dst[a] = src[a] * cos - src[c] * sin
                dst[c] = src[a] * sin + src[c] * cos
        torch.testing.assert_close(rotated_q, expected_q)
        torch.testing.assert_close(rotated_k, expected_k)
        # The score depends only on the relative position m - n.
        shift = rope(torch.tensor([[m + 4, n + 4]])).double()
        q2 = apply_rotary_pos_emb(q.view(1, 1, 1, hn).expand(2, 1, 1, hn), shift, interleaved)[0, 0, 0]
        k2 = apply_rotary_pos_emb(k.view(1, 1, 1, hn).expand(2, 1, 1, hn), shift, interleaved)[1, 0, 0]
        torch.testing.assert_close(q2 @ k2, rotated_q @ rotated_k)


def test_rope_partial_rotation_leaves_tail_and_checks_size():
    rope = RotaryEmbedding(8, rotary_percent=0.5)
    t = torch.randn(3, 2, 4, 8)
    out = apply_rotary_pos_emb(t, rope(torch.arange(3).expand(2, 3)))
    assert torch.equal(out[..., 4:], t[..., 4:])
    assert not torch.allclose(out[1:, ..., :4], t[1:, ..., :4])
    with pytest.raises(ValueError, match="rotary_percent"):
        RotaryEmbedding(8, rotary_percent=1.5)


def test_norms_match_formulas():
    torch.manual_seed(4)
    x = torch.randn(3, 2, 16)
    for zero_centered in (False, True):
        config = make_config(layernorm_zero_centered_gamma=zero_centered, layernorm_epsilon=1e-6)
        ln, rms = LayerNorm(config, 16), RMSNorm(config, 16)
        with torch.no_grad():
            for norm in (ln, rms):
                norm.weight.normal_()
            ln.bias.normal_()
        gamma_ln = ln.weight + 1 if zero_centered else ln.weight
        gamma_rms = rms.weight + 1 if zero_centered else rms.weight
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        torch.testing.assert_close(ln(x), (x - mean) / torch.sqrt(var + 1e-6) * gamma_ln + ln.bias)
        torch.testing.assert_close(rms(x), x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * gamma_rms)
        assert rms.bias is None
    assert isinstance(Norm(make_config(normalization="RMSNorm"), 16), RMSNorm)
    assert isinstance(Norm(make_config(), 16), LayerNorm)
    sp_config = make_config(tensor_model_parallel_size=2, sequence_parallel=True)
    assert all(p.sequence_parallel for p in LayerNorm(sp_config, 16).parameters())
    assert not any(p.sequence_parallel for p in LayerNorm(make_config(), 16).parameters())


def needs_cuda(test):
    """A GPU test: skipped without CUDA, and marked `gpu` so conftest.py leaves CUDA visible."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernels_match_the_plain_formula(dtype):
    """SDPA's GPU kernels and the reference path, against float64 math: `auto` (the kernel SDPA
    picks), and `flash` where that kernel can run (16-bit inputs, no explicit mask)."""
    torch.manual_seed(0)
    s, b, n, hn = 128, 2, 8, 64
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for groups in (8, 2):
        q = torch.randn(s, b, n, hn, device="cuda", dtype=dtype)
        k, v = (torch.randn(s, b, groups, hn, device="cuda", dtype=dtype) for _ in range(2))
        k_rep, v_rep = (t.double().repeat_interleave(n // groups, dim=2) for t in (k, v))
        padding = torch.rand(b, 1, s, s, device="cuda") < 0.2
        arbitrary = causal_mask(b, s).cuda() | (padding & ~torch.eye(s, dtype=torch.bool, device="cuda"))
        for mask, masked in ((None, causal_mask(b, s).cuda()), (arbitrary, arbitrary)):
            expected = plain_attention(q.double(), k_rep, v_rep, masked, 1 / math.sqrt(hn))
            flash = ("flash",) if dtype == torch.bfloat16 and mask is None else ()
            for backend in ("auto", "unfused") + flash:
                config = make_config(num_attention_heads=n, hidden_size=n * hn, num_query_groups=groups,
                                     attention_backend=backend)
                out = DotProductAttention(config, layer_number=1)(q, k, v, mask)
                assert out.dtype == dtype
                torch.testing.assert_close(out.double(), expected, **tolerance)
