"""gpt-oss's config.json <-> teratron model args.

gpt-oss is grouped-query attention with biases on q, k, v and o, a learned attention sink per
head (softmax_type 'learnable'), sliding-window attention on the layers `layer_types` marks
"sliding_attention" (window_size (sliding_window - 1, 0) and a per-layer window_attn_skip_freq;
a query sees itself and the sliding_window - 1 tokens before it), YaRN over each head
(position_embedding_type 'yarn', ramp bounds kept fractional with `truncate` False), and MoE in
every layer: a biased router whose top-k logits are softmaxed (moe_router_pre_softmax False),
experts with biases whose activation is gate * sigmoid(1.702 gate) * (up + 1) with the gate
clamped to at most swiglu_limit and up to [-limit, limit] (quick_geglu, glu_linear_offset 1,
activation_func_clamp_value limit). transformers' `swiglu_alpha` must be quick GELU's 1.702.
"""

from teratron.convert.hf_fields import FULL, SLIDING, layer_types, layer_window_args, require_fields, rope_args_from_hf
from teratron.dist_checkpointing.model_args import YARN_ARGS
from teratron.transformer.moe import moe_layer_pattern

FAMILY = "gpt_oss"
QUICK_GELU_ALPHA = 1.702


def _window_args(hf: dict, source: str) -> dict:
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if hf.get("sliding_window") is None:
        return {}
    return layer_window_args(types, hf["sliding_window"], layers, source)


def gpt_oss_args(hf: dict, source: str) -> dict:
    """The model args of a gpt_oss config (the fields every family shares come from the caller)."""
    require_fields(hf, source, ["intermediate_size", "num_local_experts", "num_experts_per_tok"])
    if hf.get("swiglu_alpha", QUICK_GELU_ALPHA) != QUICK_GELU_ALPHA:
        raise ValueError(f"{source}: swiglu_alpha={hf['swiglu_alpha']}; teratron's quick GELU gate is "
                         f"x * sigmoid({QUICK_GELU_ALPHA} x), only that converts")
    if not hf.get("attention_bias", True):
        raise ValueError(f"{source}: attention_bias=false while gpt-oss's router and experts keep their biases; "
                         "teratron puts biases on all linear layers or none (add_bias_linear)")
    heads = hf["num_attention_heads"]
    rope = rope_args_from_hf(hf, source, default_theta=150000.0, yarn=True)
    yarn = rope["rope_type"] == "yarn"
    return {
        "ffn_hidden_size": hf["intermediate_size"], "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads, "swiglu": False, "quick_geglu": True,
        "glu_linear_offset": 1.0, "activation_func_clamp_value": float(hf.get("swiglu_limit", 7.0)),
        "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False, "softmax_type": "learnable",
        "position_embedding_type": "yarn" if yarn else "rope", "rotary_base": rope["rotary_base"],
        **({name: rope[name] for name in YARN_ARGS} if yarn else {}),
        "num_experts": hf["num_local_experts"], "moe_router_topk": hf["num_experts_per_tok"],
        "moe_ffn_hidden_size": hf["intermediate_size"], "moe_grouped_gemm": False,
        "moe_router_pre_softmax": False, "moe_router_score_function": "softmax", "moe_layer_freq": 1,
        **_window_args(hf, source),
    }


def _check_exportable(a: dict) -> None:
    needed = {"quick_geglu": True, "glu_linear_offset": 1.0, "add_bias_linear": True, "softmax_type": "learnable",
              "qk_layernorm": False, "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
              "moe_shared_expert_intermediate_size": None, "moe_router_topk_scaling_factor": None,
              "moe_router_enable_expert_bias": False, "no_rope_freq": None}
    for name, value in needed.items():
        if a.get(name) != value:
            raise ValueError(f"the checkpoint's model has {name}={a.get(name)!r}; gpt-oss needs {value!r}, so it has "
                             "no Hugging Face family to export to")
    if not a["num_experts"] or not all(moe_layer_pattern(a["num_layers"], a["moe_layer_freq"])):
        raise ValueError("the checkpoint's model has dense layers; gpt-oss has MoE in every layer")
    if a["activation_func_clamp_value"] is None or (a["window_size"] is not None and a["window_size"][1] != 0):
        raise ValueError(f"the checkpoint's model has activation_func_clamp_value={a['activation_func_clamp_value']} "
                         f"and window_size={a['window_size']}; gpt-oss clamps its experts and has causal windows")


def gpt_oss_hf_fields(a: dict, base: dict) -> dict:
    """The gpt-oss fields of the exported config.json but RoPE (`base`: the imported config, or {})."""
    _check_exportable(a)
    return {
        "intermediate_size": a["moe_ffn_hidden_size"], "head_dim": a["kv_channels"],
        "num_key_value_heads": a["num_query_groups"], "num_local_experts": a["num_experts"],
        "num_experts_per_tok": a["moe_router_topk"], "swiglu_alpha": QUICK_GELU_ALPHA,
        "swiglu_limit": a["activation_func_clamp_value"], "attention_bias": True, "layer_types": layer_types(a),
        "sliding_window": a["window_size"][0] + 1 if a["window_size"] is not None else base.get("sliding_window"),
    }
