"""What model a checkpoint holds: a small JSON-able dict of `teratron train` flag values.

Every checkpoint records it (metadata.json), so a checkpoint can be rebuilt, exported to Hugging
Face and checked against another one without the run's full argument list. The keys are the
training flags' dest names (Megatron's); `model_args_from_config` writes the record of a
`GPTModelConfig` and `gpt_config_from_model_args` reads it back.

Only what shapes the model's weights or forward math is recorded; training-only MoE settings
(load balancing, aux-loss coefficients, capacity, dispatcher) are not, so a fine-tune may change
them. MoE keys default to Megatron's values (`MOE_DEFAULTS`) when a run or an older checkpoint
lacks them; `mtp_num_layers` (multi-token prediction) to None. A hybrid model's M layers are
recorded as Megatron's args say them (`GDP_DEFAULTS`): `spec` [hybrid_layer_specs, gdp_stack_spec]
for Gated Delta Product mixers with `gdp_num_householder`, None (and an older record without the
keys) for Mamba-2 mixers.
"""

import torch
import torch.nn.functional as F

from teratron.models.hybrid.hybrid_layer_allocation import HYBRID_SPECS_MODULE, gdp_layers_of_spec
from teratron.transformer.mlp import openai_gelu, quick_gelu, squared_relu

# The MoE architecture and its meaning when absent: a dense model (num_experts None).
MOE_DEFAULTS = {
    "num_experts": None, "moe_ffn_hidden_size": None, "moe_router_topk": None, "moe_grouped_gemm": False,
    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False, "moe_layer_freq": 1,
    "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False, "moe_router_num_groups": None, "moe_router_group_topk": None,
}

# Attention and MLP variants (TransformerConfig fields) and their meaning when absent: none.
VARIANT_DEFAULTS = {
    "window_size": None, "window_attn_skip_freq": None, "softmax_type": "vanilla", "no_rope_freq": None,
    "activation_func_clamp_value": None, "glu_linear_offset": 0.0,
    "layernorm_zero_centered_gamma": False, "attention_output_gate": False,  # Qwen3-Next's norms and attention
    # hybrid models: the layer pattern (None: GPT) and the Mamba-2 sizes
    "hybrid_layer_pattern": None, "mamba_state_dim": 128, "mamba_head_dim": 64, "mamba_num_groups": 8,
    "mamba_num_heads": None, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}

# A hybrid model's M layers (the flag dests, Megatron's args' names) and their meaning when absent: Mamba-2
# mixers. `spec` is GDP_SPEC for Gated Delta Product mixers (TransformerConfig.gdp_layers), else None.
GDP_DEFAULTS = {"spec": None, "gdp_num_householder": 3}
GDP_SPEC = [HYBRID_SPECS_MODULE, "gdp_stack_spec"]

# Multi-latent attention: the flag dest -> its MLATransformerConfig field; recorded for MLA models only.
MLA_ARGS = {
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_head_dim": "qk_head_dim",
    "qk_pos_emb_head_dim": "qk_pos_emb_head_dim", "v_head_dim": "v_head_dim", "rope_type": "rope_type",
    "rotary_scaling_factor": "rotary_scaling_factor", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
    "yarn_original_max_position_embeddings": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
}

# YaRN of plain attention (position_embedding_type 'yarn'): the flag dest -> its TransformerConfig
# field; recorded for such models only (an MLA model records its own YaRN in MLA_ARGS).
YARN_ARGS = {
    "rotary_scaling_factor": "yarn_rotary_scaling_factor", "mscale": "yarn_mscale",
    "mscale_all_dim": "yarn_mscale_all_dim",
    "yarn_original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "yarn_beta_fast": "yarn_beta_fast", "yarn_beta_slow": "yarn_beta_slow",
    "yarn_correction_range_round_to_int": "yarn_correction_range_round_to_int",
}

# Llama 3.x RoPE scaling (`use_rope_scaling`, always recorded): the factors' flag dests, which are
# GPTModelConfig's field names too; recorded for such models only.
ROPE_SCALING_ARGS = ("rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                     "rope_scaling_original_max_position_embeddings")

MODEL_ARG_NAMES = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "norm_epsilon", "swiglu", "quick_geglu", "openai_gelu", "squared_relu",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "position_embedding_type", "rotary_base", "rotary_percent",
    "rotary_interleaved",
    "use_rope_scaling", *ROPE_SCALING_ARGS,
    "untie_embeddings_and_output_weights", "max_position_embeddings", "vocab_size", "padded_vocab_size",
    "mtp_num_layers", *MOE_DEFAULTS, *VARIANT_DEFAULTS, *GDP_DEFAULTS, "multi_latent_attention", *MLA_ARGS,
    *YARN_ARGS,
)


def model_args_from_config(model) -> dict:
    """The record of a `GPTModelConfig` (query groups resolved, true and padded vocabulary)."""
    c = model.transformer
    out = dict(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
        kv_channels=c.kv_channels, normalization=c.normalization, norm_epsilon=c.layernorm_epsilon,
        swiglu=c.gated_linear_unit and c.activation_func is not quick_gelu,
        quick_geglu=c.gated_linear_unit and c.activation_func is quick_gelu,
        openai_gelu=c.activation_func is openai_gelu, squared_relu=c.activation_func is squared_relu,
        add_bias_linear=c.add_bias_linear, add_qkv_bias=c.add_qkv_bias,
        qk_layernorm=c.qk_layernorm, position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base, rotary_percent=model.rotary_percent,
        rotary_interleaved=c.rotary_interleaved, use_rope_scaling=model.rope_scaling,
        untie_embeddings_and_output_weights=not model.share_embeddings_and_output_weights,
        max_position_embeddings=model.max_position_embeddings, vocab_size=model.vocab_size,
        padded_vocab_size=model.padded_vocab_size, mtp_num_layers=c.mtp_num_layers, **MOE_DEFAULTS,
        **{name: _jsonable(getattr(c, name)) for name in VARIANT_DEFAULTS},
        spec=GDP_SPEC if c.gdp_layers else None,  # the substeps shape GDP layers only: Mamba-2 records the default
        gdp_num_householder=c.gdp_num_householder if c.gdp_layers else GDP_DEFAULTS["gdp_num_householder"],
        multi_latent_attention=c.multi_latent_attention,
    )
    if c.multi_latent_attention:
        out.update({arg: getattr(c, field) for arg, field in MLA_ARGS.items()})
    if model.position_embedding_type == "yarn":
        out.update({arg: getattr(c, field) for arg, field in YARN_ARGS.items()})
    if model.rope_scaling:
        out.update({arg: getattr(model, arg) for arg in ROPE_SCALING_ARGS})
    if c.num_moe_experts:
        out.update({name: getattr(c, name) for name in MOE_DEFAULTS if name != "num_experts"},
                   num_experts=c.num_moe_experts,
                   moe_layer_freq=canonical_moe_layer_freq(c.num_layers, c.moe_layer_freq))
    return out


def _jsonable(value):
    """Tuples as lists, as the record reads back from JSON."""
    return list(value) if isinstance(value, tuple) else value


def canonical_moe_layer_freq(num_layers: int, moe_layer_freq):
    """1 when every layer is MoE, else the 0/1 list: one record per layer pattern, so a run's
    `--moe-layer-freq 2` and an import's [1, 0, 1, 0] are the same model."""
    from teratron.transformer.moe import moe_layer_pattern

    pattern = moe_layer_pattern(num_layers, moe_layer_freq)
    return 1 if all(pattern) else pattern


def moe_arg(model_args: dict, name: str):
    """An MoE model arg, Megatron's default when the dict predates it."""
    return model_args.get(name, MOE_DEFAULTS[name])


def _activation(model_args: dict):
    """The MLP's activation; absent switches (older records) are off."""
    if model_args.get("openai_gelu"):
        return openai_gelu
    if model_args.get("squared_relu"):
        return squared_relu
    if model_args.get("quick_geglu"):
        return quick_gelu
    return F.silu if model_args["swiglu"] else F.gelu


def gpt_config_from_model_args(model_args: dict, padded_vocab_size=None, make_vocab_size_divisible_by=1,
                               **overrides):
    """The `GPTModelConfig` of a record: dropout off and fp32 unless `overrides` (TransformerConfig
    fields, e.g. the layout) say otherwise; the recorded padded vocabulary unless another is given
    (another TP size pads differently)."""
    from teratron.models.gpt.gpt_config import GPTModelConfig
    from teratron.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    a = model_args
    kwargs = dict(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], ffn_hidden_size=a["ffn_hidden_size"],
        num_attention_heads=a["num_attention_heads"], num_query_groups=a["num_query_groups"],
        kv_channels=a["kv_channels"], normalization=a["normalization"], layernorm_epsilon=a["norm_epsilon"],
        gated_linear_unit=a["swiglu"] or a.get("quick_geglu", False), activation_func=_activation(a),
        add_bias_linear=a["add_bias_linear"], add_qkv_bias=a["add_qkv_bias"], qk_layernorm=a["qk_layernorm"],
        rotary_interleaved=a["rotary_interleaved"], hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, mtp_num_layers=a.get("mtp_num_layers"),
        **{name: a.get(name, default) for name, default in VARIANT_DEFAULTS.items()},
        gdp_layers=gdp_layers_of_spec(a.get("spec")),
        gdp_num_householder=a.get("gdp_num_householder", GDP_DEFAULTS["gdp_num_householder"]),
    )
    if a.get("num_experts"):
        kwargs.update({name: moe_arg(a, name) for name in MOE_DEFAULTS if name != "num_experts"},
                      num_moe_experts=a["num_experts"])
    if a["position_embedding_type"] == "yarn":
        kwargs.update({field: a[arg] for arg, field in YARN_ARGS.items()})
    config_class = TransformerConfig
    if a.get("multi_latent_attention"):
        config_class = MLATransformerConfig
        kwargs.update({field: a[arg] for arg, field in MLA_ARGS.items()}, rotary_base=a["rotary_base"],
                      rotary_percent=a["rotary_percent"])
    kwargs.update(overrides)
    return GPTModelConfig(
        config_class(**kwargs), vocab_size=a["vocab_size"] or a["padded_vocab_size"],
        max_position_embeddings=a["max_position_embeddings"],
        position_embedding_type=a["position_embedding_type"], rotary_percent=a["rotary_percent"],
        rotary_base=a["rotary_base"], rope_scaling=a.get("use_rope_scaling", False),
        **({arg: a[arg] for arg in ROPE_SCALING_ARGS} if a.get("use_rope_scaling") else {}),
        share_embeddings_and_output_weights=not a["untie_embeddings_and_output_weights"],
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size or a["padded_vocab_size"],
    )
