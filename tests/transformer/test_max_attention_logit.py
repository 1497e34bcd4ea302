"""The max attention logit per head (QK-clip's input) equals the largest entry of the explicitly
built score matrix over the keys each query may see, in chunks or not, with GQA, windows and
masks; core attention records it in training forwards only; SelfAttention's QK-clip factors
follow Megatron's rule (per query group: queries eta ** alpha, keys eta ** (1 - alpha))."""

import pytest
import torch

from teratron.transformer import attention_masks
from teratron.transformer.attention import SelfAttention, SelfAttentionSubmodules
from teratron.transformer.attention_masks import max_attention_logits
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from teratron.transformer.transformer_config import TransformerConfig

B, SQ, HN = 2, 11, 8
INF = float("inf")


def _qk(heads, groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, heads, SQ, HN, generator=g) * 2, torch.randn(B, groups, SQ, HN, generator=g) * 2


def _explicit(q, k, scale, allowed):
    """Largest scale * q.k per head over the allowed (True) entries of the full score matrix."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("bnqd,bnkd->bnqk", q, k) * scale
    return scores.masked_fill(~allowed, -INF).amax(dim=(0, 2, 3))


def _band(left):
    """Causal, and at most `left` keys back (-1: unbounded), written with tril/triu."""
    causal = torch.ones(SQ, SQ, dtype=torch.bool).tril()
    return causal if left < 0 else causal & torch.ones(SQ, SQ, dtype=torch.bool).triu(-left)


@pytest.mark.parametrize("chunk_rows", [None, 1, 3])
@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (4, 1)])
def test_max_logits_equal_the_explicit_scores(monkeypatch, chunk_rows, heads, groups):
    if chunk_rows is not None:  # several query chunks, each over its own key band
        monkeypatch.setattr(attention_masks, "_MAX_LOGIT_CHUNK", B * heads * SQ * chunk_rows)
    q, k = _qk(heads, groups)
    scale = 0.3
    full = torch.ones(SQ, SQ, dtype=torch.bool)
    mask = torch.rand(B, 1, SQ, SQ, generator=torch.Generator().manual_seed(3)) < 0.5  # True = masked out
    cases = [
        (dict(causal=True), _band(-1)),
        (dict(causal=True, window=(3, 0)), _band(3)),
        (dict(causal=False), full),
        (dict(causal=False, window=(2, 1)), full.triu(-2) & full.tril(1)),
        (dict(causal=False, attention_mask=mask), ~mask),
        (dict(causal=True, window=(4, 0), attention_mask=mask[:1, 0]), _band(4) & ~mask[:1]),
    ]
    for kwargs, allowed in cases:
        got = max_attention_logits(q, k, scale, **kwargs)
        assert got.shape == (heads,) and got.dtype == torch.float32
        torch.testing.assert_close(got, _explicit(q, k, scale, allowed), rtol=1e-6, atol=0)


def test_a_head_that_sees_no_key_has_minus_infinity():
    q, k = _qk(2, 2)
    everything_masked = torch.ones(1, 1, SQ, SQ, dtype=torch.bool)
    assert torch.equal(max_attention_logits(q, k, 1.0, False, attention_mask=everything_masked),
                       torch.full((2,), -INF))


def _config(**kwargs):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, hidden_dropout=0.0,
                attention_dropout=0.0, use_cpu_initialization=True, log_max_attention_logit=True)
    return TransformerConfig(**{**base, **kwargs})


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_core_attention_records_the_max_of_training_forwards(backend):
    config = _config(attention_backend=backend, window_size=(4, 0))
    attention = DotProductAttention(config, layer_number=1)
    assert attention.current_max_attn_logits.tolist() == [-INF] * 4
    assert "current_max_attn_logits" not in attention.state_dict()  # never checkpointed
    seen = torch.full((4,), -INF)
    for seed in (1, 2):
        q, k = _qk(4, 2, seed)
        v = torch.randn(B, 2, SQ, HN)
        attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)))  # [s, b, n, hn]
        seen = torch.maximum(seen, _explicit(q, k, attention.softmax_scale, _band(4)))
        torch.testing.assert_close(attention.current_max_attn_logits, seen, rtol=1e-6, atol=0)
    attention.eval()
    q, k = _qk(4, 2, 5)
    attention(*(t.permute(2, 0, 1, 3) * 10 for t in (q, k, torch.randn(B, 2, SQ, HN))))
    torch.testing.assert_close(attention.current_max_attn_logits, seen, rtol=1e-6, atol=0)


def test_core_attention_keeps_no_record_without_the_flags():
    attention = DotProductAttention(_config(log_max_attention_logit=False), layer_number=1)
    assert not hasattr(attention, "current_max_attn_logits")


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_packed_documents_record_the_max_within_each_document(window):
    """Packed documents run the context-parallel module (one participant): the record covers
    each query's own document's keys only."""
    from teratron.packed_seq_params import PackedSeqParams, cu_seqlens_from_documents

    attention = DotProductAttention(_config(window_size=window), layer_number=1)
    q, k = _qk(4, 2)
    v = torch.randn(B, 2, SQ, HN)
    qkv = [t.permute(2, 0, 1, 3) for t in (q, k, v)]  # [s, b, n, hn]
    documents = torch.tensor([[0] * 4 + [1] * (SQ - 4), [2] * 7 + [3] * (SQ - 7)])
    packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens_from_documents(documents))
    attention(*qkv, attention_mask=packed)
    allowed = _band(-1 if window is None else window[0]) & (documents[:, :, None] == documents[:, None, :])
    expected = _explicit(q, k, attention.softmax_scale, allowed[:, None])
    torch.testing.assert_close(attention.current_max_attn_logits, expected, rtol=1e-6, atol=0)
    # the cross-document maximum is larger: the test tells them apart
    assert (_explicit(q, k, attention.softmax_scale, _band(-1)) > expected).any()


def _self_attention(config):
    spec = SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                                   linear_proj=RowParallelLinear)
    return SelfAttention(config, spec, layer_number=1)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_qk_clip_factors_per_query_group(qkv_bias):
    alpha, threshold = 0.3, 100.0
    config = _config(qk_clip=True, qk_clip_alpha=alpha, qk_clip_threshold=threshold, add_bias_linear=False,
                     add_qkv_bias=qkv_bias, kv_channels=HN)
    attention = _self_attention(config)
    # Heads 0, 1 form group 0 (largest 150: clipped by eta = 2/3), heads 2, 3 group 1 (largest 90: kept).
    factors = attention.qk_clip_scales(torch.tensor([150.0, 50.0, 80.0, 90.0]))
    params = [attention.linear_qkv.weight] + ([attention.linear_qkv.bias] if qkv_bias else [])
    assert [id(p) for p in factors] == [id(p) for p in params]
    eta = threshold / 150.0
    # Rows per group: 2 query heads, then the key head, then the value head (8 rows each).
    expected = torch.tensor([eta ** alpha] * 16 + [eta ** (1 - alpha)] * 8 + [1.0] * 8 + [1.0] * 32)
    for rows in factors.values():
        torch.testing.assert_close(rows, expected, rtol=1e-6, atol=0)
        assert torch.equal(rows[32:], torch.ones(32))  # exactly 1 where nothing is clipped


def test_qk_clip_factors_leave_the_output_gates_alone():
    """Gated attention's rows per group: 2 query heads, their 2 gates (factor 1), key, value."""
    alpha, threshold = 0.3, 100.0
    config = _config(qk_clip=True, qk_clip_alpha=alpha, qk_clip_threshold=threshold, add_bias_linear=False,
                     kv_channels=HN, attention_output_gate=True)
    attention = _self_attention(config)
    (rows,) = attention.qk_clip_scales(torch.tensor([150.0, 50.0, 80.0, 90.0])).values()
    eta = threshold / 150.0
    expected = torch.tensor([eta ** alpha] * 16 + [1.0] * 16 + [eta ** (1 - alpha)] * 8 + [1.0] * 8 + [1.0] * 48)
    assert rows.shape == attention.linear_qkv.weight.shape[:1]
    torch.testing.assert_close(rows, expected, rtol=1e-6, atol=0)


def test_compiled_layers_record_what_eager_layers_record():
    """--torch-compile compiles each layer whole, the record's update included."""
    from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
    from teratron.transformer.torch_compile import compile_transformer_layers

    torch.manual_seed(0)
    model = GPTModel(_config(window_size=(5, 0), init_method_std=0.3), get_gpt_layer_local_spec(), 48, SQ,
                     position_embedding_type="rope")
    ids = torch.randint(0, 48, (B, SQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SQ).expand(B, SQ)

    def records():
        out = [layer.self_attention.core_attention.current_max_attn_logits.clone() for layer in model.decoder.layers]
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.current_max_attn_logits.fill_(-INF)
        return out

    model(ids, positions).sum().backward()
    eager = records()
    assert compile_transformer_layers(model) == 2
    model(ids, positions).sum().backward()
    for compiled, expected in zip(records(), eager):
        assert torch.isfinite(expected).all()
        torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=0)
