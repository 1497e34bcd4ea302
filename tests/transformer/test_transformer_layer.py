"""TransformerLayer / TransformerBlock against a plain layer written out from the same weights."""

import math

import pytest
import torch
import torch.nn.functional as F

from teratron.models.gpt import get_gpt_layer_local_spec
from teratron.transformer.enums import AttnMaskType
from teratron.transformer.identity_op import IdentityOp
from teratron.transformer.init_rng import component_rng
from teratron.transformer.rope import RotaryEmbedding
from teratron.transformer.spec_utils import ModuleSpec, build_module
from teratron.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from teratron.transformer.transformer_config import TransformerConfig


def make_config(**overrides):
    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, hidden_dropout=0.0, attention_dropout=0.0, add_qkv_bias=True,
                  use_cpu_initialization=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def rotate(t, angles):
    """Llama-style RoPE on [s, b, n, hn]: pairs (i, i + hn/2) turn by angles [s, hn/2]."""
    half = t.shape[-1] // 2
    cos, sin = angles.cos()[:, None, None, :], angles.sin()[:, None, None, :]
    a, b = t[..., :half], t[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def plain_layer(layer, x, angles, config, post_ln_residual=False):
    """The layer's math from its weights, one line per equation (LayerNorm, GELU MLP, GQA)."""
    att, mlp = layer.self_attention, layer.mlp
    heads, groups, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
    s, b, h = x.shape

    def ln(norm, t):
        return F.layer_norm(t, (t.shape[-1],), norm.weight, norm.bias, config.layernorm_epsilon)

    n1 = ln(layer.input_layernorm, x)
    # Megatron's fused QKV rows: per group, its heads/groups query heads, then one key, one value.
    w = att.linear_qkv.weight.view(groups, heads // groups + 2, hn, h)
    bias = att.linear_qkv.bias.view(groups, heads // groups + 2, hn)
    wq, wk, wv = w[:, :-2].reshape(heads, hn, h), w[:, -2], w[:, -1]
    bq, bk, bv = bias[:, :-2].reshape(heads, hn), bias[:, -2], bias[:, -1]
    q = rotate(torch.einsum("sbh,ndh->sbnd", n1, wq) + bq, angles)
    k = rotate(torch.einsum("sbh,ndh->sbnd", n1, wk) + bk, angles)
    v = torch.einsum("sbh,ndh->sbnd", n1, wv) + bv
    group_of_head = torch.arange(heads) // (heads // groups)
    k, v = k[:, :, group_of_head], v[:, :, group_of_head]
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(hn)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, heads * hn)
    attn_out = context @ att.linear_proj.weight.t() + att.linear_proj.bias
    h1 = (n1 if post_ln_residual else x) + attn_out
    n2 = ln(layer.pre_mlp_layernorm, h1)
    ffn = F.gelu(n2 @ mlp.linear_fc1.weight.t() + mlp.linear_fc1.bias)
    return (n2 if post_ln_residual else h1) + ffn @ mlp.linear_fc2.weight.t() + mlp.linear_fc2.bias


@pytest.mark.parametrize("post_ln_residual", [False, True])
def test_layer_equals_plain_formula(post_ln_residual):
    config = make_config(apply_residual_connection_post_layernorm=post_ln_residual)
    torch.manual_seed(0)
    layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)
    with torch.no_grad():  # non-trivial norms and biases, so every term is exercised
        for name, p in layer.named_parameters():
            if "bias" in name or "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(6, 2, 32)
    positions = torch.arange(6)
    freqs = RotaryEmbedding(config.kv_channels)(positions.expand(2, 6))
    out, context = layer(x, rotary_pos_emb=freqs)
    assert context is None
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    expected = plain_layer(layer, x, positions[:, None] * inv_freq, config, post_ln_residual)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_fp32_residual_connection_keeps_the_stream_fp32_with_bf16_weights():
    config = make_config(params_dtype=torch.bfloat16, fp32_residual_connection=True)
    torch.manual_seed(1)
    layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)
    assert layer.input_layernorm(torch.randn(3, 1, 32)).dtype == torch.bfloat16
    out, _ = layer(torch.randn(5, 2, 32))
    assert out.dtype == torch.float32


def test_block_builds_its_stage_layers_with_global_numbers_and_final_norm():
    config = make_config(num_layers=4)
    torch.manual_seed(2)
    block = TransformerBlock(config, get_gpt_layer_local_spec())
    assert [layer.layer_number for layer in block.layers] == [1, 2, 3, 4]
    assert block.final_layernorm is not None
    no_norm = TransformerBlock(config, get_gpt_layer_local_spec(), post_process=False)
    assert no_norm.final_layernorm is None
    # Layer i has the same weights whoever builds it: its init stream is its own.
    torch.manual_seed(2)
    torch.randn(100)  # the caller's stream moved on; the block must not care
    again = TransformerBlock(config, get_gpt_layer_local_spec())
    for (name, a), b in zip(block.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name
    different = {n: p for n, p in block.named_parameters()}
    assert not torch.equal(different["layers.0.self_attention.linear_qkv.weight"],
                           different["layers.1.self_attention.linear_qkv.weight"])
    with pytest.raises(ValueError, match="layer specs"):
        TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[get_gpt_layer_local_spec()]))


def test_block_input_tensor_replaces_hidden_states_on_later_stages():
    config = make_config()
    torch.manual_seed(3)
    first = TransformerBlock(config, get_gpt_layer_local_spec())
    torch.manual_seed(3)
    later = TransformerBlock(config, get_gpt_layer_local_spec(), pre_process=False)
    x = torch.randn(4, 2, 32)
    later.set_input_tensor(x)
    torch.testing.assert_close(later(None), first(x), rtol=0, atol=0)


def test_component_rng_is_isolated_and_keyed_by_seed_and_tag():
    torch.manual_seed(5)
    with component_rng("layer1"):
        a = torch.randn(4)
    after = torch.randn(1)
    torch.manual_seed(5)
    assert torch.equal(torch.randn(1), after)  # the caller's stream is untouched
    torch.manual_seed(5)
    with component_rng("layer1"):
        assert torch.equal(torch.randn(4), a)
    with component_rng("layer2"):
        assert not torch.equal(torch.randn(4), a)
    torch.manual_seed(6)
    with component_rng("layer1"):
        assert not torch.equal(torch.randn(4), a)


def test_build_module_from_class_import_path_and_function():
    config = make_config()
    spec = ModuleSpec(module=("teratron.transformer.norms", "RMSNorm"), params={"eps": 1e-3})
    norm = build_module(spec, config=config, hidden_size=8)
    assert type(norm).__name__ == "RMSNorm" and norm.eps == 1e-3
    assert isinstance(build_module(IdentityOp, config=config), IdentityOp)

    def factory():
        return 1

    assert build_module(ModuleSpec(module=factory)) is factory
    with pytest.raises(ImportError, match="cannot be imported"):
        build_module(ModuleSpec(module=("teratron.nowhere", "Thing")))


def test_attention_rejects_mla_and_splits_heads_into_groups():
    from teratron.process_groups import ProcessGroupCollection
    from teratron.transformer.attention import SelfAttention

    spec = get_gpt_layer_local_spec().submodules.self_attention
    with pytest.raises(ValueError, match="multi_latent_attention=True; MLA layers are MLASelfAttention"):
        SelfAttention(make_config(multi_latent_attention=True), spec.submodules, 1,
                      pg_collection=ProcessGroupCollection())
    attention = SelfAttention(make_config(), spec.submodules, 1, attn_mask_type=AttnMaskType.causal)
    assert attention.np == 4 and attention.ng == 2


def test_gated_mlp_is_act_gate_times_up_plus_offset():
    config = make_config(gated_linear_unit=True, activation_func=F.silu, glu_linear_offset=0.5)
    torch.manual_seed(6)
    mlp = build_module(get_gpt_layer_local_spec().submodules.mlp, config=config)
    assert mlp.linear_fc1.weight.shape == (2 * 48, 32) and mlp.linear_fc1.weight.partition_stride == 2
    x = torch.randn(5, 2, 32)
    gate_w, up_w = mlp.linear_fc1.weight[:48], mlp.linear_fc1.weight[48:]  # full weight is [gate; up]
    gate_b, up_b = mlp.linear_fc1.bias[:48], mlp.linear_fc1.bias[48:]
    hidden = F.silu(x @ gate_w.t() + gate_b) * (x @ up_w.t() + up_b + 0.5)
    out, bias = mlp(x)
    torch.testing.assert_close(out + bias, hidden @ mlp.linear_fc2.weight.t() + mlp.linear_fc2.bias)


def test_expert_mlp_shards_over_the_expert_tp_group_of_its_collection():
    import torch.distributed as dist

    from dist import run_distributed
    from teratron.process_groups import ProcessGroupCollection

    def body():
        pg = ProcessGroupCollection(tp=None, expt_tp=dist.group.WORLD)
        spec = get_gpt_layer_local_spec().submodules.mlp
        expert = build_module(spec, config=make_config(), is_expert=True, pg_collection=pg)
        dense = build_module(spec, config=make_config(), pg_collection=pg)
        return expert.linear_fc1.weight.shape[0], dense.linear_fc1.weight.shape[0]

    assert run_distributed(body, 2) == [(24, 48), (24, 48)]
