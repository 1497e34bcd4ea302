"""Hugging Face `config.json` <-> teratron model args, for the Llama-style families.

Llama 2/3, Mistral, Qwen2 and Qwen3 are one architecture to teratron: RMSNorm, SwiGLU, RoPE
(rotate-half, as Megatron's default), grouped-query attention, no position table. They differ in
biases (Qwen2: QKV only; Llama/Qwen3 `attention_bias`: QKV and output projection), qk-norm
(Qwen3) and tied embeddings. Mixtral (Mistral's attention) and Qwen3-MoE (Qwen3's) replace MLPs
by MoE layers; their MoE fields map in `hf_moe`. Mistral's and Mixtral's
sliding window becomes `window_size` on every layer. Features teratron does not convert (RoPE
scaling, other families' sliding windows, other activations, Qwen2-MoE's gated shared expert) are
refused with the field's name.
"""

from teratron.convert.hf_moe import (MOE_FAMILIES, REFUSED, moe_args_from_hf, moe_export_family,
                                     moe_hf_fields)
from teratron.dist_checkpointing.model_args import MOE_DEFAULTS, VARIANT_DEFAULTS

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES


def _rope(hf: dict, source: str) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type") or "default"
    if rope_type != "default":
        raise ValueError(f"{source}: rope type {rope_type!r} (rope_scaling) is not supported by teratron's "
                         "RoPE; only the default (unscaled) rotary embedding converts")
    return float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))


def _biases(hf: dict, family: str, source: str) -> tuple:
    """(add_bias_linear, add_qkv_bias) for the family's bias flags."""
    if family == "qwen2":
        return False, True
    attention_bias = bool(hf.get("attention_bias", False))
    mlp_bias = bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError(f"{source}: attention_bias={attention_bias} with mlp_bias={mlp_bias}; teratron "
                         "puts biases on all linear layers or none (add_bias_linear)")
    return attention_bias, False


WINDOW_FAMILIES = ("mistral", "mixtral")


def _window_args(hf: dict, family: str, source: str) -> dict:
    """Mistral's and Mixtral's `sliding_window` W (each query sees itself and the W - 1 tokens
    before it, as transformers masks it) as window_size (W - 1, 0) on every layer; nothing when the
    window never bites (W >= max_position_embeddings) or is off."""
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window", family in WINDOW_FAMILIES) or window is None \
            or window >= hf.get("max_position_embeddings", 0):
        return {}
    if family not in WINDOW_FAMILIES:
        raise ValueError(f"{source}: use_sliding_window with sliding_window={window} ({family}); teratron "
                         f"converts the sliding windows of {' and '.join(WINDOW_FAMILIES)} only")
    return {"window_size": [window - 1, 0]}


def _export_window(a: dict, family: str) -> int | None:
    """The HF `sliding_window` of the model's window_size, or None without one."""
    window = a.get("window_size")
    if window is None:
        return None
    if family not in WINDOW_FAMILIES or a.get("window_attn_skip_freq") is not None or window[1] != 0:
        raise ValueError(f"the checkpoint's model has window_size={list(window)} with window_attn_skip_freq="
                         f"{a.get('window_attn_skip_freq')}; Hugging Face's {' and '.join(WINDOW_FAMILIES)} hold "
                         "one causal window on every layer, the export writes only that")
    return window[0] + 1


def require_fields(hf: dict, source: str, names) -> None:
    """Refuse a config.json that lacks one of the fields the conversion reads."""
    missing = [name for name in names if hf.get(name) is None]
    if missing:
        raise ValueError(f"{source}: config.json lacks {', '.join(missing)}; it is not a complete "
                         f"{hf.get('model_type')} config")


def model_args_from_hf(hf: dict, source: str, make_vocab_size_divisible_by: int = 1,
                       tensor_model_parallel_size: int = 1) -> dict:
    """teratron model args (see dist_checkpointing.model_args) from an HF config dict."""
    from teratron.tensor_parallel import pad_vocab_size

    family = hf.get("model_type")
    if family in REFUSED:
        raise ValueError(f"{source}: model_type {family!r}: {REFUSED[family]}")
    if family not in FAMILIES:
        raise ValueError(f"{source}: model_type {family!r} is not convertible; supported: {', '.join(FAMILIES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r}; only SwiGLU (silu) MLPs convert")
    required = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"]
    if family in MOE_FAMILIES:
        required += ["num_experts_per_tok"] + (["moe_intermediate_size"] if family == "qwen3_moe" else [])
    require_fields(hf, source, required)
    heads = hf["num_attention_heads"]
    add_bias_linear, add_qkv_bias = _biases(hf, family, source)
    vocab = hf["vocab_size"]
    return {
        "num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"], "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "normalization": "RMSNorm", "norm_epsilon": hf.get("rms_norm_eps", 1e-6), "swiglu": True,
        "add_bias_linear": add_bias_linear, "add_qkv_bias": add_qkv_bias,
        "qk_layernorm": family in ("qwen3", "qwen3_moe"),
        "position_embedding_type": "rope", "rotary_base": _rope(hf, source), "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
        "max_position_embeddings": hf.get("max_position_embeddings", 4096), "vocab_size": vocab,
        "padded_vocab_size": pad_vocab_size(vocab, make_vocab_size_divisible_by, tensor_model_parallel_size),
        **(moe_args_from_hf(hf, family, source) if family in MOE_FAMILIES else MOE_DEFAULTS),
        **_window_args(hf, family, source),
    }


def _fits(family: str, a: dict) -> bool:
    qkv_only = a["add_qkv_bias"] and not a["add_bias_linear"]
    return {
        "llama": not a["qk_layernorm"] and not qkv_only,
        "mistral": not a["qk_layernorm"] and not a["add_bias_linear"] and not a["add_qkv_bias"],
        "qwen2": not a["qk_layernorm"] and qkv_only,
        "qwen3": a["qk_layernorm"] and not qkv_only,
    }[family]


def export_family(a: dict, base_type) -> str:
    """The imported family when the model still fits it, else the first that does."""
    if a["num_experts"]:
        return moe_export_family(a)
    windowed = ("mistral",) if a.get("window_size") is not None else ()  # the dense family with a window
    for family in ((base_type,) if base_type in DENSE_FAMILIES else ()) + windowed + ("llama", "qwen2", "qwen3"):
        if _fits(family, a):
            return family
    raise ValueError("the checkpoint combines qk-layernorm with a QKV-only bias; no Hugging Face "
                     "family (llama, mistral, qwen2, qwen3) has that shape")


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def hf_config_from_model_args(a: dict, base: dict | None = None, aux_loss_coeff: float | None = None) -> dict:
    """An HF config dict for the model; `base` (the imported config) keeps the model type and its
    extra fields (token ids, ...); `aux_loss_coeff` (a training run's) becomes an MoE model's
    router_aux_loss_coef."""
    a = {**MOE_DEFAULTS, **a}
    if a.get("multi_latent_attention"):
        raise ValueError("the checkpoint's model uses multi-latent attention, which has no Hugging Face export yet "
                         "(deepseek_v3 is not supported)")
    if a["normalization"] != "RMSNorm" or not a["swiglu"] or a["position_embedding_type"] != "rope" \
            or a["rotary_interleaved"] or a["rotary_percent"] != 1.0:
        raise ValueError("the checkpoint's model is not Llama-shaped (needs RMSNorm, SwiGLU, full "
                         "rotate-half RoPE); it has no Hugging Face counterpart to export to")
    hf = dict(base or {})
    family = export_family(a, hf.get("model_type"))
    variants = [name for name, default in VARIANT_DEFAULTS.items()
                if a.get(name, default) != default and name not in ("window_size", "window_attn_skip_freq")]
    if variants:
        raise ValueError(f"the checkpoint's model sets {', '.join(variants)}; the Hugging Face export does not "
                         "write these yet")
    sliding_window = _export_window(a, family)
    for stale in ("rope_parameters", "num_local_experts", "num_experts"):
        hf.pop(stale, None)
    hf.update({
        "model_type": family, "architectures": [_ARCHITECTURES[family]],
        "num_hidden_layers": a["num_layers"], "hidden_size": a["hidden_size"],
        "intermediate_size": a["ffn_hidden_size"], "num_attention_heads": a["num_attention_heads"],
        "num_key_value_heads": a["num_query_groups"], "head_dim": a["kv_channels"],
        "hidden_act": "silu", "rms_norm_eps": a["norm_epsilon"], "rope_theta": a["rotary_base"],
        "rope_scaling": None, "tie_word_embeddings": not a["untie_embeddings_and_output_weights"],
        "max_position_embeddings": a["max_position_embeddings"], "vocab_size": a["vocab_size"],
    })
    if family in MOE_FAMILIES:
        hf.update(moe_hf_fields(a, family, base or {}, aux_loss_coeff))
    if family in ("llama", "qwen3", "qwen3_moe"):
        hf["attention_bias"] = a["add_bias_linear"]
    if family == "llama":
        hf["mlp_bias"] = a["add_bias_linear"]
    if family in WINDOW_FAMILIES:
        hf["sliding_window"] = sliding_window
    return hf
