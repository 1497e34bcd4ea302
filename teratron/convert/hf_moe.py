"""The MoE half of the Hugging Face config mapping: Mixtral, Qwen2-MoE and Qwen3-MoE.

All route with a softmax over all experts and keep the top k. Mixtral always renormalises the k
kept probabilities to sum 1, which is exactly a softmax over the k kept logits: teratron's
softmax router with `moe_router_pre_softmax=False`. The Qwen MoEs renormalise when
`norm_topk_prob` is set (the same) and otherwise weight by the full-softmax probabilities
(`moe_router_pre_softmax=True`). Top-1 with renormalisation (every weight 1.0) has no teratron
router and is refused.

Qwen2-MoE adds a shared expert of `shared_expert_intermediate_size` that every token runs,
scaled per token by sigmoid(x . shared_expert_gate): teratron's shared experts with
`moe_shared_expert_gate`. Its attention has biases on q, k and v (`qkv_bias`, default true).

Which layers are MoE: Mixtral all of them; the Qwen MoEs' layer i (0-based) unless i is in
`mlp_only_layers`, and only when (i + 1) % decoder_sparse_step == 0 (their dense layers use
`intermediate_size`, their experts `moe_intermediate_size`). Megatron's integer `moe_layer_freq`
N counts from the first layer instead (i % N == 0); model args record any pattern but "all
layers" as the 0/1 list (`canonical_moe_layer_freq`).

`router_aux_loss_coef` becomes Megatron's aux-loss coefficient one to one, as Megatron's own
converters map it; the losses are defined differently (HF: one switch loss over every layer's
router probabilities together; Megatron: one per layer, summed), so this carries the user's
setting across, not an identical loss.
"""

import warnings

from teratron.dist_checkpointing.model_args import canonical_moe_layer_freq
from teratron.transformer.moe import moe_layer_pattern

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
MOE_REQUIRED_FIELDS = {"mixtral": ["num_experts_per_tok"],
                       "qwen2_moe": ["num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"],
                       "qwen3_moe": ["num_experts_per_tok", "moe_intermediate_size"]}


def _num_experts(hf: dict) -> int:
    return hf.get("num_experts", hf.get("num_local_experts"))


def hf_moe_pattern(hf: dict, family: str) -> list:
    """1 for each MoE layer, 0 for each dense one (0-based layer order)."""
    layers = hf["num_hidden_layers"]
    if family == "mixtral":
        return [1] * layers
    dense = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    return [int(i not in dense and _num_experts(hf) > 0 and (i + 1) % step == 0) for i in range(layers)]


def moe_args_from_hf(hf: dict, family: str, source: str) -> dict:
    """The MoE model args of a Mixtral / Qwen2-MoE / Qwen3-MoE config."""
    if _num_experts(hf) is None:
        raise ValueError(f"{source}: config.json lacks num_experts (or num_local_experts); it is not a "
                         f"complete {family} config")
    pattern = hf_moe_pattern(hf, family)
    if not any(pattern):
        raise ValueError(f"{source}: no layer is MoE (num_experts / decoder_sparse_step / mlp_only_layers); "
                         "convert it as its dense family")
    topk = hf["num_experts_per_tok"]
    renormalise = family == "mixtral" or bool(hf.get("norm_topk_prob", False))
    if topk == 1 and renormalise:
        raise ValueError(f"{source}: num_experts_per_tok=1 with renormalised weights gives every token "
                         "weight 1.0, which teratron's softmax router cannot express; only top-k > 1 converts")
    if hf.get("router_jitter_noise"):
        warnings.warn(f"{source}: router_jitter_noise={hf['router_jitter_noise']} (training-only) is not "
                      "carried over; teratron's moe_input_jitter_eps jitters the router input only")
    return {
        "num_experts": _num_experts(hf), "moe_router_topk": topk,
        "moe_ffn_hidden_size": hf["intermediate_size"] if family == "mixtral" else hf["moe_intermediate_size"],
        "moe_grouped_gemm": False, **_shared_expert_args(hf, family, source),
        "moe_layer_freq": canonical_moe_layer_freq(len(pattern), pattern), "moe_router_pre_softmax": not renormalise,
        "moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None,
        "moe_router_enable_expert_bias": False,
    }


def _shared_expert_args(hf: dict, family: str, source: str) -> dict:
    """Qwen2-MoE's gated shared expert; none for the others."""
    if family != "qwen2_moe":
        return {"moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False}
    size = hf["shared_expert_intermediate_size"]
    if size < 1:
        raise ValueError(f"{source}: shared_expert_intermediate_size={size}; transformers' qwen2_moe always runs its "
                         "shared expert, give its positive size")
    return {"moe_shared_expert_intermediate_size": size, "moe_shared_expert_gate": True}


def moe_training_config_from_hf(hf: dict) -> dict:
    """TransformerConfig fields for training the imported model: its aux-loss setting."""
    return {"moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))}


def _check_exportable(a: dict, gated: bool) -> None:
    """The router and biases every family here shares; the shared experts, gated, only Qwen2-MoE
    has (with its QKV bias and without qk-norm)."""
    families = "Qwen2-MoE" if gated else "Mixtral and Qwen3-MoE"
    unsupported = {
        "moe_router_score_function": (a["moe_router_score_function"], "softmax"),
        "moe_router_topk_scaling_factor": (a["moe_router_topk_scaling_factor"], None),
        "moe_router_enable_expert_bias": (a["moe_router_enable_expert_bias"], False),
        "moe_router_num_groups": (a["moe_router_num_groups"], None),
        "add_bias_linear": (a["add_bias_linear"], False),
        **({"qk_layernorm": (a["qk_layernorm"], False)} if gated else {
            "moe_shared_expert_intermediate_size": (a["moe_shared_expert_intermediate_size"], None),
            "add_qkv_bias": (a["add_qkv_bias"], False)}),
    }
    for name, (value, supported) in unsupported.items():
        if value != supported:
            raise ValueError(f"the checkpoint's MoE model has {name}={value!r}; {families} need{'s' * gated} "
                             f"{supported!r}, so it has no Hugging Face family to export to")


def moe_export_family(a: dict) -> str:
    """qwen2_moe for gated shared experts, qwen3_moe for qk-norm models, else mixtral (every
    layer MoE, renormalised top-k)."""
    gated = bool(a.get("moe_shared_expert_gate"))
    _check_exportable(a, gated)
    if gated:
        return "qwen2_moe"
    if a["qk_layernorm"]:
        return "qwen3_moe"
    if not all(moe_layer_pattern(a["num_layers"], a["moe_layer_freq"])):
        raise ValueError(f"the checkpoint mixes dense and MoE layers (moe_layer_freq={a['moe_layer_freq']}) "
                         "without qk-layernorm; Mixtral has MoE in every layer and Qwen3-MoE needs qk-norm")
    if a["moe_router_pre_softmax"]:
        raise ValueError("the checkpoint routes with moe_router_pre_softmax=True (weights not renormalised) "
                         "without qk-layernorm; Mixtral always renormalises and Qwen3-MoE needs qk-norm")
    return "mixtral"


def _sparse_layers(pattern: list, family: str, base: dict) -> dict:
    """decoder_sparse_step / mlp_only_layers giving `pattern`: the base's own when they do."""
    if base.get("model_type") == family and base.get("num_hidden_layers") == len(pattern) \
            and hf_moe_pattern(base, family) == pattern:
        return {"decoder_sparse_step": base.get("decoder_sparse_step", 1),
                "mlp_only_layers": list(base.get("mlp_only_layers") or [])}
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe]}


def moe_hf_fields(a: dict, family: str, base: dict, aux_loss_coeff=None) -> dict:
    """The MoE fields of the exported config.json (`base`: the imported config, or {})."""
    fields = {"num_experts_per_tok": a["moe_router_topk"]}
    if aux_loss_coeff is not None:
        fields["router_aux_loss_coef"] = aux_loss_coeff
    if family == "mixtral":
        return {**fields, "num_local_experts": a["num_experts"], "intermediate_size": a["moe_ffn_hidden_size"]}
    pattern = moe_layer_pattern(a["num_layers"], a["moe_layer_freq"])
    experts_key = "num_local_experts" if "num_local_experts" in base else "num_experts"  # transformers 5 / hub
    if family == "qwen2_moe":
        fields.update(shared_expert_intermediate_size=a["moe_shared_expert_intermediate_size"],
                      qkv_bias=a["add_qkv_bias"])
    return {**fields, experts_key: a["num_experts"], "moe_intermediate_size": a["moe_ffn_hidden_size"],
            "intermediate_size": a["ffn_hidden_size"], "norm_topk_prob": not a["moe_router_pre_softmax"],
            **_sparse_layers(pattern, family, base)}
