"""Hugging Face `config.json` <-> teratron model args: the families, and the Llama-style ones.

Llama 2/3, Mistral, Qwen2 and Qwen3 are one architecture to teratron: RMSNorm, SwiGLU, RoPE
(rotate-half, as Megatron's default), grouped-query attention, no position table. They differ in
biases (Qwen2: QKV only; Llama/Qwen3 `attention_bias`: QKV and output projection), qk-norm
(Qwen3) and tied embeddings. Mixtral (Mistral's attention), Qwen2-MoE (Qwen2's, its QKV bias
`qkv_bias`) and Qwen3-MoE (Qwen3's) replace MLPs by MoE layers; their MoE fields map in `hf_moe`.
Mistral's and Mixtral's sliding window becomes `window_size` on every layer, Qwen2-MoE's
per-layer windows (`layer_types`) window_size with window_attn_skip_freq. DeepSeek-V3
(`hf_deepseek`), gpt-oss (`hf_gpt_oss`), GPT-2 (`hf_gpt2`: learned positions, LayerNorm, GeLU),
Nemotron-H (`hf_nemotron_h`: Mamba-2 hybrids) and Qwen3-Next (`hf_qwen3_next`: a Gated DeltaNet
hybrid) map in their own modules; the fields the RMSNorm families share (sizes, RMSNorm,
vocabulary, tied embeddings) here. Features teratron does not convert (other RoPE scalings, other
families' sliding windows, other activations, quantized weights) are refused with the field's name,
and so is a hybrid model with Gated Delta Product layers (gdp_layers), which no HF family holds.
"""

from teratron.convert.hf_deepseek import deepseek_args, deepseek_hf_fields
from teratron.convert.hf_fields import (FULL, SLIDING, layer_types, layer_window_args, require_fields,
                                        rope_args_from_hf, rope_of_model_args, set_rope_fields)
from teratron.convert.hf_gpt2 import FAMILY as GPT2, gpt2_args, gpt2_hf_config
from teratron.convert.hf_gpt_oss import gpt_oss_args, gpt_oss_hf_fields
from teratron.convert.hf_qwen3_next import ARCHITECTURE, qwen3_next_args, qwen3_next_hf_config
from teratron.convert.hf_moe import (MOE_FAMILIES, MOE_REQUIRED_FIELDS, moe_args_from_hf, moe_export_family,
                                     moe_hf_fields)
from teratron.convert.hf_nemotron_h import FAMILY as NEMOTRON_H, nemotron_h_args, nemotron_h_hf_config
from teratron.dist_checkpointing.model_args import MOE_DEFAULTS, VARIANT_DEFAULTS
from teratron.models.hybrid.hybrid_layer_allocation import gdp_layers_of_spec

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
OWN_MODULE_FAMILIES = {"deepseek_v3": (deepseek_args, "DeepseekV3ForCausalLM"),
                       "gpt_oss": (gpt_oss_args, "GptOssForCausalLM"),
                       "qwen3_next": (qwen3_next_args, ARCHITECTURE)}
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES + tuple(OWN_MODULE_FAMILIES) + (GPT2, NEMOTRON_H)


def _biases(hf: dict, family: str, source: str) -> tuple:
    """(add_bias_linear, add_qkv_bias) for the family's bias flags."""
    if family == "qwen2":
        return False, True
    if family == "qwen2_moe":
        return False, bool(hf.get("qkv_bias", True))
    attention_bias = bool(hf.get("attention_bias", False))
    mlp_bias = bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError(f"{source}: attention_bias={attention_bias} with mlp_bias={mlp_bias}; teratron "
                         "puts biases on all linear layers or none (add_bias_linear)")
    return attention_bias, False


WINDOW_FAMILIES = ("mistral", "mixtral")


def _window_args(hf: dict, family: str, source: str) -> dict:
    """Mistral's and Mixtral's `sliding_window` W (each query sees itself and the W - 1 tokens
    before it, as transformers masks it) as window_size (W - 1, 0) on every layer, Qwen2-MoE's on
    the layers its layer_types mark; nothing when the window never bites (W >=
    max_position_embeddings) or is off."""
    if family == "qwen2_moe":
        return _qwen2_moe_window_args(hf, source)
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window", family in WINDOW_FAMILIES) or window is None \
            or window >= hf.get("max_position_embeddings", 0):
        return {}
    if family not in WINDOW_FAMILIES:
        raise ValueError(f"{source}: use_sliding_window with sliding_window={window} ({family}); teratron "
                         f"converts the sliding windows of {' and '.join(WINDOW_FAMILIES)} only")
    return {"window_size": [window - 1, 0]}


def _qwen2_moe_window_args(hf: dict, source: str) -> dict:
    """Windows on the layers `layer_types` marks sliding, or, without it, as transformers 5
    derives them: every other layer from the first below max_window_layers, with
    use_sliding_window (without it transformers' window is 0, i.e. none)."""
    layers, use = hf["num_hidden_layers"], hf.get("use_sliding_window", False)
    types = hf.get("layer_types") or [SLIDING if use and (i + 1) % 2 and i < hf.get("max_window_layers", 28) else FULL
                                      for i in range(layers)]
    window = hf.get("sliding_window") if use else 0
    if window and window >= hf.get("max_position_embeddings", 0):
        return {}
    return layer_window_args(types, window, layers, source)


def _window_fields(a: dict, family: str) -> dict:
    """The exported config's window fields: Mistral's and Mixtral's `sliding_window`, Qwen2-MoE's
    per-layer ones."""
    if family != "qwen2_moe":
        window = _export_window(a, family)
        return {"sliding_window": window} if family in WINDOW_FAMILIES else {}
    window = a.get("window_size")
    if window is not None and window[1] != 0:
        raise ValueError(f"the checkpoint's model has window_size={list(window)}; Qwen2-MoE's windows are causal "
                         "(W - 1, 0), the export writes only those")
    types = layer_types(a)
    return {"use_sliding_window": window is not None, "layer_types": types,
            **({"sliding_window": window[0] + 1} if window is not None else {})}


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


def _rope_args(hf: dict, source: str) -> dict:
    """RoPE's base and, for a Llama 3 scaled config, use_rope_scaling and its factors."""
    rope = rope_args_from_hf(hf, source, llama3=True)
    scaled = rope.pop("rope_type") == "llama3"
    return {**rope, "use_rope_scaling": scaled}


def _llama_style_args(hf: dict, source: str) -> dict:
    """The model args of the Llama-style families and their MoE variants."""
    family = hf["model_type"]
    require_fields(hf, source, ["intermediate_size"] + MOE_REQUIRED_FIELDS.get(family, []))
    heads = hf["num_attention_heads"]
    add_bias_linear, add_qkv_bias = _biases(hf, family, source)
    return {
        "ffn_hidden_size": hf["intermediate_size"], "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads, "swiglu": True,
        "add_bias_linear": add_bias_linear, "add_qkv_bias": add_qkv_bias,
        "qk_layernorm": family in ("qwen3", "qwen3_moe"), "position_embedding_type": "rope",
        **_rope_args(hf, source),
        **(moe_args_from_hf(hf, family, source) if family in MOE_FAMILIES else {}),
        **_window_args(hf, family, source),
    }


def _check_family(hf: dict, source: str) -> str:
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{source}: model_type {family!r} is not convertible; supported: {', '.join(FAMILIES)}")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "quantized")
        raise ValueError(f"{source}: the weights are {method} (quantization_config); save a dequantized bf16 or "
                         "fp32 copy with transformers first")
    if family != "gpt_oss" and hf.get("hidden_act", "silu") != "silu":  # gpt-oss's experts ignore hidden_act
        raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r}; only SwiGLU (silu) MLPs convert")
    return family


def model_args_from_hf(hf: dict, source: str, make_vocab_size_divisible_by: int = 1,
                       tensor_model_parallel_size: int = 1) -> dict:
    """teratron model args (see dist_checkpointing.model_args) from an HF config dict."""
    from teratron.tensor_parallel import pad_vocab_size

    family = _check_family(hf, source)
    family_args = {GPT2: gpt2_args, NEMOTRON_H: nemotron_h_args}.get(family)
    args = family_args(hf, source) if family_args else _rms_norm_family_args(hf, family, source)
    padded = pad_vocab_size(args["vocab_size"], make_vocab_size_divisible_by, tensor_model_parallel_size)
    return {**args, "padded_vocab_size": padded}


def _rms_norm_family_args(hf: dict, family: str, source: str) -> dict:
    require_fields(hf, source, ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"])
    family_args = OWN_MODULE_FAMILIES[family][0] if family in OWN_MODULE_FAMILIES else _llama_style_args
    return {
        "num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
        "num_attention_heads": hf["num_attention_heads"], "normalization": "RMSNorm",
        "norm_epsilon": hf.get("rms_norm_eps", 1e-6), "rotary_percent": 1.0, "rotary_interleaved": False,
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
        "max_position_embeddings": hf.get("max_position_embeddings", 4096), "vocab_size": hf["vocab_size"],
        "use_rope_scaling": False, **MOE_DEFAULTS, **family_args(hf, source),
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
    """The imported family when the model still fits it, else the first that does: deepseek_v3
    for MLA, gpt_oss for quick GEGLU experts."""
    if a.get("multi_latent_attention"):
        return "deepseek_v3"
    if a.get("quick_geglu"):
        return "gpt_oss"
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
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM",
                  **{family: architecture for family, (_, architecture) in OWN_MODULE_FAMILIES.items()}}


# Gated Delta Product M layers have no Hugging Face family: refused both ways in one line.
GDP_HAS_NO_FAMILY = ("Gated Delta Product M layers (gdp_layers: Megatron's --spec ... gdp_stack_spec), which no "
                     "Hugging Face family holds (nemotron_h's M layers are Mamba-2, qwen3_next's are Gated DeltaNet)")

_NOT_CONVERTIBLE = ("the checkpoint's model is neither Llama-shaped (RMSNorm, SwiGLU, full rotate-half RoPE) nor "
                    "GPT-2-shaped (LayerNorm, GeLU, learned absolute positions); it has no Hugging Face counterpart "
                    "to export to")


def _check_llama_shaped(a: dict) -> None:
    if not a["swiglu"] or a.get("openai_gelu") or a["position_embedding_type"] != "rope":  # gated SiLU only
        raise ValueError(_NOT_CONVERTIBLE)
    variants = [name for name, default in VARIANT_DEFAULTS.items()
                if a.get(name, default) != default and name not in ("window_size", "window_attn_skip_freq")]
    if variants:
        raise ValueError(f"the checkpoint's model sets {', '.join(variants)}; the Hugging Face export does not "
                         "write these yet")


def _llama_style_fields(a: dict, family: str, base: dict, aux_loss_coeff) -> dict:
    _check_llama_shaped(a)
    fields = {"intermediate_size": a["ffn_hidden_size"], "num_key_value_heads": a["num_query_groups"],
              "head_dim": a["kv_channels"], **_window_fields(a, family)}
    set_rope_fields(fields, rope_of_model_args(a), base)
    if family in MOE_FAMILIES:
        fields.update(moe_hf_fields(a, family, base, aux_loss_coeff))
    if family in ("llama", "qwen3", "qwen3_moe"):
        fields["attention_bias"] = a["add_bias_linear"]
    if family == "llama":
        fields["mlp_bias"] = a["add_bias_linear"]
    return fields


def _own_module_fields(a: dict, family: str, base: dict, aux_loss_coeff) -> dict:
    """DeepSeek-V3's or gpt-oss's fields, RoPE written as the base wrote it when unchanged."""
    if a.get("use_rope_scaling"):
        raise ValueError(f"the checkpoint's model has use_rope_scaling (Llama 3's RoPE scaling); {family} has YaRN "
                         "or unscaled RoPE only, so it has no Hugging Face counterpart")
    fields = deepseek_hf_fields(a) if family == "deepseek_v3" else gpt_oss_hf_fields(a, base)
    if family == "gpt_oss" and aux_loss_coeff is not None:
        fields["router_aux_loss_coef"] = aux_loss_coeff
    set_rope_fields(fields, rope_of_model_args(a), base)
    return fields


def _hybrid_hf_config(a: dict, base: dict | None, aux_loss_coeff) -> dict:
    """A hybrid model's HF family: the imported one (`base`), else Nemotron-H for Mamba-2 layers,
    Qwen3-Next for Gated DeltaNet ones (each refuses, in one line, a pattern it cannot hold); none for
    Gated Delta Product layers."""
    family, pattern = (base or {}).get("model_type"), a["hybrid_layer_pattern"]
    if gdp_layers_of_spec(a.get("spec")):
        raise ValueError(f"the checkpoint's hybrid model has {GDP_HAS_NO_FAMILY}; it does not export: keep it as a "
                         "teratron checkpoint, or save it with --ckpt-format torch_dist for Megatron-LM")
    if "/" in pattern:
        raise ValueError(f"the checkpoint's hybrid pattern {pattern!r} has multi-token-prediction depths ('/'); "
                         "the nemotron_h and qwen3_next exports do not carry them")
    if family not in (NEMOTRON_H, "qwen3_next"):
        if "G" in pattern and "M" in pattern:
            raise ValueError(f"the checkpoint's hybrid pattern {pattern!r} has both Mamba-2 (M) and Gated DeltaNet (G) "
                             "layers; no Hugging Face family holds both (nemotron_h has M, qwen3_next G)")
        family = "qwen3_next" if "G" in pattern else NEMOTRON_H
    if family == NEMOTRON_H:
        return nemotron_h_hf_config(a, base)
    return qwen3_next_hf_config(a, base, aux_loss_coeff)


def hf_config_from_model_args(a: dict, base: dict | None = None, aux_loss_coeff: float | None = None) -> dict:
    """An HF config dict for the model; `base` (the imported config) keeps the model type and its
    extra fields (token ids, ...); `aux_loss_coeff` (a training run's) becomes an MoE model's
    router_aux_loss_coef."""
    a = {**MOE_DEFAULTS, **VARIANT_DEFAULTS, **a}
    if a["hybrid_layer_pattern"]:
        return _hybrid_hf_config(a, base, aux_loss_coeff)
    if a["position_embedding_type"] == "learned_absolute":
        return gpt2_hf_config(a, base)
    if a["normalization"] != "RMSNorm" or a["rotary_interleaved"] or a["rotary_percent"] != 1.0:
        raise ValueError(_NOT_CONVERTIBLE)
    hf = dict(base or {})
    family = export_family(a, hf.get("model_type"))
    if a.get("mtp_num_layers") and family != "deepseek_v3":
        raise ValueError(f"the checkpoint's model has mtp_num_layers={a['mtp_num_layers']}; of the Hugging Face "
                         "families only deepseek_v3 holds multi-token-prediction layers, and the model is not one")
    for stale in ("rope_parameters", "rope_scaling", "rope_theta", "num_local_experts", "num_experts"):
        hf.pop(stale, None)
    hf.update({
        "model_type": family, "architectures": [_ARCHITECTURES[family]],
        "num_hidden_layers": a["num_layers"], "hidden_size": a["hidden_size"],
        "num_attention_heads": a["num_attention_heads"], "hidden_act": "silu", "rms_norm_eps": a["norm_epsilon"],
        "tie_word_embeddings": not a["untie_embeddings_and_output_weights"],
        "max_position_embeddings": a["max_position_embeddings"], "vocab_size": a["vocab_size"],
    })
    if family in OWN_MODULE_FAMILIES:
        hf.update(_own_module_fields(a, family, base or {}, aux_loss_coeff))
    else:
        hf.update(_llama_style_fields(a, family, base or {}, aux_loss_coeff))
    return hf
