import math
from types import SimpleNamespace

from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.training.metrics import num_floating_point_operations
from teratron.transformer import TransformerConfig


def _args(**kw):
    base = dict(num_layers=2, hidden_size=64, seq_length=32, num_attention_heads=4, kv_channels=16,
                group_query_attention=True, num_query_groups=2, ffn_hidden_size=96, swiglu=True,
                padded_vocab_size=256, num_experts=None, mtp_num_layers=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _flops(a, batch):
    """num_floating_point_operations of the model the namespace describes."""
    moe = dict(num_moe_experts=a.num_experts, moe_layer_freq=a.moe_layer_freq, moe_router_topk=a.moe_router_topk,
               moe_ffn_hidden_size=a.moe_ffn_hidden_size,
               moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size) if a.num_experts else {}
    transformer = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        kv_channels=a.kv_channels, num_query_groups=a.num_query_groups if a.group_query_attention else None,
        ffn_hidden_size=a.ffn_hidden_size, gated_linear_unit=a.swiglu, mtp_num_layers=a.mtp_num_layers, **moe)
    model = GPTModelConfig(transformer, vocab_size=a.padded_vocab_size, max_position_embeddings=a.seq_length,
                           padded_vocab_size=a.padded_vocab_size, position_embedding_type="rope")
    return num_floating_point_operations(model, a.seq_length, batch)


def _hand_count(a, batch):
    """Training FLOPs by listing every matrix multiply of one sequence's forward pass."""
    s, h = a.seq_length, a.hidden_size
    q = a.num_attention_heads * a.kv_channels
    kv = (a.num_query_groups if a.group_query_attention else a.num_attention_heads) * a.kv_channels
    gemm = lambda m, n, k: 2 * m * n * k  # noqa: E731 - [m, n] @ [n, k]
    layer = (
        gemm(s, h, q + 2 * kv)                                    # linear_qkv
        + a.num_attention_heads * gemm(s, a.kv_channels, s) / 2   # Q K^T, causal half
        + a.num_attention_heads * gemm(s, s, a.kv_channels) / 2   # P V, causal half
        + gemm(s, q, h)                                           # linear_proj
        + gemm(s, h, a.ffn_hidden_size * (2 if a.swiglu else 1))  # linear_fc1 ([gate; up])
        + gemm(s, a.ffn_hidden_size, h)                           # linear_fc2
    )
    forward = a.num_layers * layer + gemm(s, h, a.padded_vocab_size)  # output layer
    return 3 * forward * batch  # forward + two backward GEMMs each


def test_flops_match_hand_count_gqa_swiglu():
    a = _args()
    assert math.isclose(_flops(a, 3), _hand_count(a, 3), rel_tol=1e-12)


def test_flops_match_hand_count_mha_gelu():
    a = _args(group_query_attention=False, swiglu=False, ffn_hidden_size=256)
    assert math.isclose(_flops(a, 5), _hand_count(a, 5), rel_tol=1e-12)


def test_flops_reproduce_architecture_anchor():
    # ARCHITECTURE.md: the 1.44 B shape at 26.5 k tokens/s is 229 TFLOP/s by Megatron's formula.
    a = _args(num_layers=24, hidden_size=2048, seq_length=2048, num_attention_heads=16, kv_channels=128,
              group_query_attention=False, ffn_hidden_size=5632, swiglu=True, padded_vocab_size=50304)
    tflops = _flops(a, 1) / 2048 * 26.5e3 / 1e12
    # Both table entries are rounded (26.5 k is 26.45-26.55 k), hence the 0.5 % band.
    assert abs(tflops - 229) <= 229 * 0.005


def test_moe_flops_count_the_routed_experts_of_moe_layers_only():
    """--moe-layer-freq [1, 0, 0, 1]: layers 1 and 4 run top-2 experts of moe_ffn plus a shared
    expert, layers 2 and 3 the dense MLP; an MoE layer costs a dense layer whose MLP is
    topk * moe_ffn + shared wide."""
    moe = _args(num_layers=4, num_experts=8, moe_layer_freq=[1, 0, 0, 1], moe_router_topk=2,
                moe_ffn_hidden_size=40, moe_shared_expert_intermediate_size=24)
    dense = _args(num_layers=2)
    as_dense_moe_layer = _args(num_layers=2, ffn_hidden_size=2 * 40 + 24)
    output_layer = 3 * 2 * moe.seq_length * moe.hidden_size * moe.padded_vocab_size
    expected = _hand_count(dense, 3) + _hand_count(as_dense_moe_layer, 3) - output_layer * 3
    assert math.isclose(_flops(moe, 3), expected, rel_tol=1e-12)
    every_other = _args(num_layers=4, num_experts=8, moe_layer_freq=2, moe_router_topk=2,
                        moe_ffn_hidden_size=40, moe_shared_expert_intermediate_size=24)
    assert _flops(every_other, 3) == _flops(moe, 3)


def test_mtp_flops_add_a_layer_a_projection_and_an_output_pass_per_depth():
    """Megatron's count: each MTP depth is a layer like the last one (here MoE), eh_proj
    [s, 2h] x [2h, h] plus the three norms' 3h per token, and one more output layer pass."""
    moe = dict(num_experts=8, moe_layer_freq=[0, 1], moe_router_topk=2, moe_ffn_hidden_size=40,
               moe_shared_expert_intermediate_size=None)
    with_mtp = _args(mtp_num_layers=2, **moe)
    as_moe_layers = _args(num_layers=4, **dict(moe, moe_layer_freq=[0, 1, 1, 1]))
    s, h, vocab = with_mtp.seq_length, with_mtp.hidden_size, with_mtp.padded_vocab_size
    gemm = lambda m, n, k: 2 * m * n * k  # noqa: E731 - [m, n] @ [n, k]
    per_depth = 3 * (gemm(s, 2 * h, h) + 2 * s * 3 * h + gemm(s, h, vocab))  # forward + two backward
    expected = _flops(as_moe_layers, 3) + 3 * 2 * per_depth  # 3 sequences, 2 depths
    assert math.isclose(_flops(with_mtp, 3), expected, rel_tol=1e-12)


def test_mla_flops_match_hand_count():
    """Every GEMM of multi-latent attention listed (Megatron counts each latent norm as one
    multiply-accumulate per channel), with and without query compression; an MTP depth adds an
    MLA layer, eh_proj with the three norms and an output layer pass; a hybrid model's '+' layers
    count alike."""
    from teratron.transformer import MLATransformerConfig

    s, h, n, layers, vocab = 32, 64, 4, 2, 256
    for q_lora in (24, None):
        def mla_model(num_layers=layers, **mtp):
            config = MLATransformerConfig(num_layers=num_layers, hidden_size=h, num_attention_heads=n,
                                          q_lora_rank=q_lora, kv_lora_rank=20, qk_head_dim=12, qk_pos_emb_head_dim=6, v_head_dim=10,
                                          ffn_hidden_size=96, gated_linear_unit=True, **mtp)
            return GPTModelConfig(config, vocab_size=vocab, max_position_embeddings=s, padded_vocab_size=vocab,
                                  position_embedding_type="rope")
        gemm = lambda m, k, o: 2 * m * k * o  # noqa: E731 - [m, k] @ [k, o]
        query = gemm(s, h, q_lora) + gemm(s, q_lora, n * 18) + 2 * s * q_lora if q_lora else gemm(s, h, n * 18)
        layer = (query
                 + gemm(s, h, 20 + 6) + 2 * s * 20    # kv down projection (latent + RoPE key), kv norm
                 + gemm(s, 20, n * (12 + 10))         # kv up projection
                 + n * gemm(s, 18, s) / 2             # Q K^T, causal half
                 + n * gemm(s, s, 10) / 2             # P V, causal half
                 + gemm(s, n * 10, h)                 # linear_proj
                 + gemm(s, h, 2 * 96) + gemm(s, 96, h))
        expected = 3 * (layers * layer + gemm(s, h, vocab)) * 3
        assert math.isclose(num_floating_point_operations(mla_model(), s, 3), expected, rel_tol=1e-12), q_lora
        depth = layer + gemm(s, 2 * h, h) + 2 * s * 3 * h + gemm(s, h, vocab)
        assert math.isclose(num_floating_point_operations(mla_model(mtp_num_layers=1), s, 3), expected + 3 * depth * 3,
                            rel_tol=1e-12), q_lora
        # A hybrid model's '+-' layers are this model's layers split in two ('+' multi-latent attention).
        hybrid = mla_model(2 * layers, hybrid_layer_pattern="+-" * layers)
        assert math.isclose(num_floating_point_operations(hybrid, s, 3), expected, rel_tol=1e-12), q_lora


def test_hybrid_model_counts_each_layer_by_its_kind():
    """A hybrid pattern's FLOPs: attention and MLP layers as a GPT layer's halves (so '*-' x L is the
    GPT model's count), Mamba-2 and Gated DeltaNet layers by Megatron-LM's formulas, written out
    here from their per-token forward counts (in_proj, scan, out_proj; in_proj, conv, delta rule,
    out_proj) times 3 for forward and backward."""
    h, s, vocab, batch = 64, 32, 256, 3
    base = dict(hidden_size=h, num_attention_heads=4, kv_channels=16, num_query_groups=2, ffn_hidden_size=96,
                gated_linear_unit=True, mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2,
                linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_conv_kernel_dim=4)

    def flops(pattern, **kw):
        config = TransformerConfig(num_layers=len(pattern.split("/")[0]), hybrid_layer_pattern=pattern, **{**base, **kw})
        model = GPTModelConfig(config, vocab_size=vocab, max_position_embeddings=s, padded_vocab_size=vocab,
                               position_embedding_type="rope")
        return num_floating_point_operations(model, s, batch)

    gpt = _flops(_args(num_layers=2, hidden_size=h, seq_length=s, padded_vocab_size=vocab), batch)
    assert math.isclose(flops("*-*-"), gpt, rel_tol=1e-12)
    heads, d_in = 2 * h // 16, 2 * h
    mamba = 3 * (2 * h * (2 * d_in + 2 * 2 * 16 + heads) + 7 * d_in * 16 + 2 * d_in * h)
    assert math.isclose(flops("M*-M*-") - gpt, 2 * batch * s * mamba, rel_tol=1e-12)
    qk, v = 8 * 2, 16 * 4
    gdn = 3 * 2 * (h * (2 * qk + 2 * v + 2 * 4) + 4 * (2 * qk + v) + 4 * 16 ** 2 * 4 + h * v)
    assert math.isclose(flops("G*-*-") - gpt, batch * s * gdn, rel_tol=1e-12)
    # '/' depths: '*-' per depth is GPT's MTP depth (a layer, eh_proj, the output layer again).
    gpt_mtp = _flops(_args(num_layers=2, hidden_size=h, seq_length=s, padded_vocab_size=vocab, mtp_num_layers=2), batch)
    assert math.isclose(flops("*-*-/*-/*-", mtp_num_layers=2), gpt_mtp, rel_tol=1e-12)
    assert math.isclose(flops("*-*-/M*-", mtp_num_layers=1) - flops("*-*-/*-", mtp_num_layers=1), batch * s * mamba,
                        rel_tol=1e-12)


def test_gated_delta_product_flops_count_the_m_substeps_of_a_token():
    """With gdp_layers the 'M' layers are Gated Delta Product mixers, counted as Megatron-LM's
    `gated_delta_product_layer_flops`: written out here from one sequence's multiplies (in_proj's parts,
    the 4-tap convolution's multiply-adds per channel, out_proj) and the rule's (4 M + 3) d_inner n per
    token, times 3 for forward and backward; M = 1 .. 3 substeps, next to a Mamba-2 layer's count."""
    h, s, vocab, batch = 64, 32, 256, 3
    heads, p, groups, n = 4, 16, 2, 8

    def flops(pattern, **kw):
        config = TransformerConfig(num_layers=len(pattern), hybrid_layer_pattern=pattern, hidden_size=h,
                                   num_attention_heads=4, ffn_hidden_size=96, mamba_num_heads=heads,
                                   mamba_head_dim=p, mamba_num_groups=groups, mamba_state_dim=n, **kw)
        model = GPTModelConfig(config, vocab_size=vocab, max_position_embeddings=s, padded_vocab_size=vocab,
                               position_embedding_type="rope")
        return num_floating_point_operations(model, s, batch)

    gemm = lambda rows, inner, cols: 2 * rows * inner * cols  # noqa: E731 - [rows, inner] @ [inner, cols]
    d_inner, gn = heads * p, groups * n
    for m in (1, 2, 3):
        in_proj = d_inner + m * d_inner + m * gn + gn + m * heads + heads  # z, V_m, K_m, Q, b_m, a
        conv = 2 * 4 * s * (m * d_inner + m * gn + gn)  # [V_m; K_m; Q], one multiply-add a tap
        rule = (4 * m + 3) * s * d_inner * n
        gdp = gemm(s, h, in_proj) + conv + rule + gemm(s, d_inner, h)
        layer = flops("M-", gdp_layers=True, gdp_num_householder=m) - flops("-")
        assert math.isclose(layer, 3 * batch * gdp, rel_tol=1e-12), m
    mamba = gemm(s, h, 2 * d_inner + 2 * gn + heads) + 7 * s * d_inner * n + gemm(s, d_inner, h)
    assert math.isclose(flops("M-") - flops("-"), 3 * batch * mamba, rel_tol=1e-12)
