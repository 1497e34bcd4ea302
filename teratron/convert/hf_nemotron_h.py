"""NVIDIA's Nemotron-H (transformers' nemotron_h) <-> teratron's hybrid model: config.json and
the weight table.

A Nemotron-H layer is `x + mixer(norm(x))` with one mixer each, listed by `layers_block_type`
(transformers 5; older configs: `hybrid_override_pattern`, the same symbols as teratron's):
"linear_attention" Mamba-2 (M), "full_attention" attention (*), "mlp" MLP (-), "moe" MoE (E),
so the list is teratron's --hybrid-layer-pattern one to one. The files name every layer's norm
`backbone.layers.{i}.norm` and its mixer `backbone.layers.{i}.mixer.*`: teratron's Mamba layers
have the same names (`norm`, `mixer.in_proj` [z; x; B; C; dt], `mixer.conv1d`, `dt_bias`,
`A_log`, `D`, the gated group norm `mixer.norm`, `out_proj`), attention layers take
`input_layernorm` and the fused QKV, MLP and MoE layers `pre_mlp_layernorm`.

The mixer's math is teratron's MambaMixer: in_proj split z | xBC | dt, a causal depthwise
convolution (conv_kernel taps, with bias) and SiLU on xBC, dt = softplus(dt + dt_bias), A =
-exp(A_log), the SSD scan with the D skip, then RMSNorm over each of n_groups groups of
y * silu(z) (gate first) times the norm's weight. One difference with transformers before 5.25:
it clamps dt from below at time_step_min (its `time_step_limit` attribute, whatever the config's
field says); teratron, like Megatron's mixer, does not, so logits differ where softplus(dt +
dt_bias) < time_step_min (trained checkpoints rarely reach it). From 5.25 transformers clamps at
the config's time_step_limit, (0, inf) by default: no clamp, as teratron; a config with another
time_step_limit is refused. chunk_size only tiles the scan (teratron's chunks are 128).

Attention has no position embedding (position_embedding_type 'none'), grouped-query heads of
head_dim, no biases (transformers ignores attention_bias). MLPs are ungated squared ReLU
(mlp_hidden_act "relu2": --squared-relu), up_proj -> linear_fc1, down_proj -> linear_fc2. MoE
layers route as DeepSeek-V3 does (sigmoid scores, the choice on score + e_score_correction_bias,
expert groups, renormalised top-k times routed_scaling_factor), with ungated relu^2 experts
(experts.{e}.up_proj / down_proj on disk) and one shared expert MLP of
moe_shared_expert_intermediate_size. transformers never ties lm_head to the embedding (whatever
tie_word_embeddings says), so imports are untied and a tied teratron model exports a copy of
its embedding as lm_head. The layer norms' epsilon is layer_norm_epsilon.

Not converted (refused with the field's name): MoE latent projections (moe_latent_size),
multi-token-prediction layers, biases (use_bias, mlp_bias), other activations, a convolution
without bias or of other than 4 taps.
"""

from teratron.convert.hf_deepseek import GROUP_SCORE_EXPERTS, routing_args
from teratron.convert.hf_fields import require_fields
from teratron.dist_checkpointing.model_args import MOE_DEFAULTS, VARIANT_DEFAULTS, moe_arg
from teratron.models.hybrid import Symbols, parse_hybrid_pattern

FAMILY = "nemotron_h"
ARCHITECTURE = "NemotronHForCausalLM"
# transformers' layer types -> teratron's pattern symbols (the older hybrid_override_pattern's own).
LAYER_SYMBOLS = {"linear_attention": Symbols.MAMBA, "full_attention": Symbols.ATTENTION, "mlp": Symbols.MLP,
                 "moe": Symbols.MOE}
LAYER_TYPES = {symbol: layer_type for layer_type, symbol in LAYER_SYMBOLS.items()}
CONV_KERNEL = 4  # teratron's Mamba convolution (Megatron's d_conv)
# NemotronHConfig's defaults of the fields a config.json may leave out.
HEAD_DIM_DEFAULT, KV_HEADS_DEFAULT = 128, 8

_L, _B = "decoder.layers.{i}.", "backbone.layers.{i}."
TABLE = [  # once per model
    ("embedding.word_embeddings.weight", ["backbone.embeddings.weight"], "vocab"),
    ("decoder.final_layernorm.weight", ["backbone.norm_f.weight"], None),
    ("output_layer.weight", ["lm_head.weight"], "vocab"),
]
TIED_EMBEDDING_ROW = ("embedding.word_embeddings.weight", ["backbone.embeddings.weight", "lm_head.weight"],
                      "vocab_and_copy")
_MAMBA_PARAMS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                 "out_proj.weight")
LAYER_TABLES = {
    Symbols.MAMBA: [(_L + "norm.weight", [_B + "norm.weight"], None)]
    + [(_L + "mixer." + name, [_B + "mixer." + name], None) for name in _MAMBA_PARAMS],
    Symbols.ATTENTION: [
        (_L + "input_layernorm.weight", [_B + "norm.weight"], None),
        (_L + "self_attention.linear_qkv.weight",
         [_B + "mixer.q_proj.weight", _B + "mixer.k_proj.weight", _B + "mixer.v_proj.weight"], "qkv"),
        (_L + "self_attention.linear_proj.weight", [_B + "mixer.o_proj.weight"], None),
    ],
    Symbols.MLP: [
        (_L + "pre_mlp_layernorm.weight", [_B + "norm.weight"], None),
        (_L + "mlp.linear_fc1.weight", [_B + "mixer.up_proj.weight"], None),
        (_L + "mlp.linear_fc2.weight", [_B + "mixer.down_proj.weight"], None),
    ],
    Symbols.MOE: [
        (_L + "pre_mlp_layernorm.weight", [_B + "norm.weight"], None),
        (_L + "mlp.router.weight", [_B + "mixer.gate.weight"], None),
        (_L + "mlp.router.expert_bias", [_B + "mixer.gate.e_score_correction_bias"], None),
        (_L + "mlp.shared_experts.linear_fc1.weight", [_B + "mixer.shared_experts.up_proj.weight"], None),
        (_L + "mlp.shared_experts.linear_fc2.weight", [_B + "mixer.shared_experts.down_proj.weight"], None),
    ],
}
_X = _B + "mixer.experts.{e}."
EXPERT_TABLE = [  # SequentialMLP: once per expert
    (_L + "mlp.experts.local_experts.{e}.linear_fc1.weight", [_X + "up_proj.weight"], None),
    (_L + "mlp.experts.local_experts.{e}.linear_fc2.weight", [_X + "down_proj.weight"], None),
]
GROUPED_EXPERTS_TABLE = [  # GroupedMLP: weight1 [E, h, f] = up^T, weight2 [E, f, h] = down^T, stacked
    (_L + "mlp.experts.weight1", [_X + "up_proj.weight"], "grouped_fc2"),
    (_L + "mlp.experts.weight2", [_X + "down_proj.weight"], "grouped_fc2"),
]


def _format(table, experts=(), **words):
    """The table's rows for layer `words['i']`; with `experts`, each row's HF name once per expert."""
    for name, hf_names, transform in table:
        names = [n.format(**words, e=e) for e in experts for n in hf_names] if experts else \
            [n.format(**words) for n in hf_names]
        yield name.format(**words), names, transform


def nemotron_h_rows(a: dict):
    """(teratron name, HF names, transform) of every tensor of the hybrid model `a` (model args)."""
    yield from TABLE if a["untie_embeddings_and_output_weights"] else [TIED_EMBEDDING_ROW] + TABLE[1:]
    for i, symbol in enumerate(parse_hybrid_pattern(a["hybrid_layer_pattern"]).layers):
        yield from _format(LAYER_TABLES[symbol], i=i)
        if symbol != Symbols.MOE:
            continue
        if moe_arg(a, "moe_grouped_gemm"):
            yield from _format(GROUPED_EXPERTS_TABLE, range(a["num_experts"]), i=i)
        else:
            for e in range(a["num_experts"]):
                yield from _format(EXPERT_TABLE, i=i, e=e)


def _pattern(hf: dict, source: str) -> str:
    """teratron's pattern of the config's layer list (or of its older pattern string)."""
    field = next((name for name in ("layers_block_type", "layer_types") if hf.get(name)), None)
    if field is not None:
        types = hf[field]
    elif isinstance(hf.get("hybrid_override_pattern"), str) and hf["hybrid_override_pattern"]:
        field, types = "hybrid_override_pattern", [LAYER_TYPES.get(s, s) for s in hf["hybrid_override_pattern"]]
    else:
        raise ValueError(f"{source}: config.json lacks layers_block_type (or hybrid_override_pattern); it is not a "
                         "complete nemotron_h config")
    unknown = [t for t in types if t not in LAYER_SYMBOLS]
    if unknown:
        raise ValueError(f"{source}: {field} has {unknown[0]!r}; nemotron_h's layers are {', '.join(LAYER_SYMBOLS)} "
                         f"({''.join(LAYER_TYPES)} in hybrid_override_pattern)")
    return "".join(LAYER_SYMBOLS[t] for t in types)


NO_DT_LIMIT = (0.0, float("inf"))  # time_step_limit: transformers >= 5.25 clamps dt to it
_REFUSED = {  # config field -> (the value teratron converts, transformers' default too; why)
    "mlp_hidden_act": ("relu2", "teratron converts nemotron_h's squared-ReLU MLPs only"),
    "mamba_hidden_act": ("silu", "teratron's Mamba mixer applies SiLU after its convolution"),
    "conv_kernel": (CONV_KERNEL, f"teratron's Mamba convolution has {CONV_KERNEL} taps"),
    "use_conv_bias": (True, "teratron's Mamba convolution always has a bias"),
    "use_bias": (False, "teratron puts biases on all linear layers or none and nemotron_h's attention has none"),
    "mlp_bias": (False, "teratron puts biases on all linear layers or none and nemotron_h's attention has none"),
    "moe_latent_size": (None, "teratron's MoE has no latent projections"),
    "num_nextn_predict_layers": (0, "nemotron_h's multi-token-prediction layers are not converted"),
}


def _dt_limit(limit) -> tuple | None:
    """config.json's time_step_limit as floats: JSON's Infinity, or transformers' {"__float__": "Infinity"}."""
    try:
        return tuple(float(end["__float__"] if isinstance(end, dict) else end) for end in limit)
    except (TypeError, KeyError, ValueError):
        return None


def _check_convertible(hf: dict, source: str) -> None:
    for name, (value, why) in _REFUSED.items():
        if hf.get(name, value) != value:
            raise ValueError(f"{source}: {name}={hf[name]!r}; {why}, so only {name}={value!r} converts")
    limit = hf.get("time_step_limit", NO_DT_LIMIT)
    if _dt_limit(limit) != NO_DT_LIMIT:
        raise ValueError(f"{source}: time_step_limit={limit!r}; teratron's Mamba mixer (Megatron's) does not clamp "
                         f"dt, so only time_step_limit=[0.0, Infinity] (no clamp) converts")


def _moe_args(hf: dict, source: str) -> dict:
    require_fields(hf, source, ["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                "moe_shared_expert_intermediate_size"])
    return {
        "num_experts": hf["n_routed_experts"], "moe_router_topk": hf["num_experts_per_tok"],
        "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_grouped_gemm": False,
        "moe_shared_expert_intermediate_size": hf["moe_shared_expert_intermediate_size"], "moe_layer_freq": 1,
        "moe_router_pre_softmax": False, "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        **routing_args(hf, source),
    }


# Older nemotron_h configs' names for fields, which transformers reads in place of the current ones.
LEGACY_NAMES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
                "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
                "mamba_chunk_size": "chunk_size"}


def nemotron_h_args(hf: dict, source: str) -> dict:
    """The model args (but the padded vocabulary) of a nemotron_h config."""
    hf = {**hf, **{name: hf[legacy] for legacy, name in LEGACY_NAMES.items() if legacy in hf}}
    require_fields(hf, source, ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
                                "ssm_state_size", "mamba_head_dim", "mamba_num_heads", "n_groups"])
    _check_convertible(hf, source)
    pattern = _pattern(hf, source)
    heads = hf["num_attention_heads"]
    return {
        "num_layers": len(pattern), "hidden_size": hf["hidden_size"], "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads, "num_query_groups": hf.get("num_key_value_heads", KV_HEADS_DEFAULT) or heads,
        "kv_channels": hf.get("head_dim", HEAD_DIM_DEFAULT) or hf["hidden_size"] // heads, "normalization": "RMSNorm",
        "norm_epsilon": hf.get("layer_norm_epsilon", 1e-5), "swiglu": False, "quick_geglu": False,
        "openai_gelu": False, "squared_relu": True, "add_bias_linear": False, "add_qkv_bias": False,
        "qk_layernorm": False, "position_embedding_type": "none", "rotary_base": 10000.0, "rotary_percent": 1.0,
        "rotary_interleaved": False, "use_rope_scaling": False, "untie_embeddings_and_output_weights": True,
        "max_position_embeddings": hf.get("max_position_embeddings", 4096), "vocab_size": hf["vocab_size"],
        **MOE_DEFAULTS, **VARIANT_DEFAULTS, "hybrid_layer_pattern": pattern,
        "mamba_state_dim": hf["ssm_state_size"], "mamba_head_dim": hf["mamba_head_dim"],
        "mamba_num_groups": hf["n_groups"], "mamba_num_heads": hf["mamba_num_heads"],
        **(_moe_args(hf, source) if Symbols.MOE in pattern else {}),
    }


_EXPORT_NEEDS = {"squared_relu": True, "swiglu": False, "quick_geglu": False, "openai_gelu": False,
                 "normalization": "RMSNorm", "position_embedding_type": "none", "add_bias_linear": False,
                 "add_qkv_bias": False, "qk_layernorm": False, "multi_latent_attention": False, "mtp_num_layers": None,
                 "window_size": None, "softmax_type": "vanilla", "activation_func_clamp_value": None,
                 "glu_linear_offset": 0.0, "no_rope_freq": None}
_MOE_EXPORT_NEEDS = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                     "moe_shared_expert_gate": False}


def _check_exportable(a: dict, pattern: str) -> None:
    for symbol, kind in ((Symbols.GDN, "Gated DeltaNet"), (Symbols.MLA, "multi-latent attention")):
        if symbol in pattern:
            raise ValueError(f"the checkpoint's hybrid model has {kind} layers ({symbol} in {pattern!r}); nemotron_h, "
                             "the Hugging Face hybrid family teratron exports, has none")
    needs = {**_EXPORT_NEEDS, **(_MOE_EXPORT_NEEDS if Symbols.MOE in pattern else {})}
    for name, value in needs.items():
        if a.get(name, value) != value:
            raise ValueError(f"the checkpoint's hybrid model has {name}={a.get(name)!r}; nemotron_h needs {value!r}, "
                             "so it has no Hugging Face family to export to")


def _moe_fields(a: dict) -> dict:
    topk, groups, group_topk = a["moe_router_topk"], a["moe_router_num_groups"], a["moe_router_group_topk"]
    shared = a["moe_shared_expert_intermediate_size"]
    if not shared or (group_topk and topk // group_topk != GROUP_SCORE_EXPERTS):
        raise ValueError(f"the checkpoint's MoE layers have shared experts of {shared} and expert groups "
                         f"{groups}/{group_topk} with top-{topk}; nemotron_h runs one shared expert MLP and scores a "
                         f"group by its best {GROUP_SCORE_EXPERTS}")
    return {"n_routed_experts": a["num_experts"], "num_experts_per_tok": topk,
            "moe_intermediate_size": a["moe_ffn_hidden_size"], "moe_shared_expert_intermediate_size": shared,
            "routed_scaling_factor": a["moe_router_topk_scaling_factor"] or 1.0, "n_group": groups or 1,
            "topk_group": group_topk or 1, "norm_topk_prob": topk > 1, "moe_latent_size": None}


def nemotron_h_hf_config(a: dict, base: dict | None) -> dict:
    """The config.json of the hybrid model `a` (model args with every default filled in); `base`,
    the imported config, keeps its other fields (token ids, chunk_size, ...)."""
    pattern = parse_hybrid_pattern(a["hybrid_layer_pattern"]).layers
    _check_exportable(a, pattern)
    hf = dict(base) if base and base.get("model_type") == FAMILY else {}
    for stale in ("num_hidden_layers", "layer_types", "rope_parameters", "rope_scaling", "rope_theta"):
        hf.pop(stale, None)
    if "hybrid_override_pattern" in hf:  # an older config's spelling, kept beside transformers 5's
        hf["hybrid_override_pattern"] = pattern
    heads = a["mamba_num_heads"] or 2 * a["hidden_size"] // a["mamba_head_dim"]  # MambaMixer's expand of 2
    hf.update({
        "model_type": FAMILY, "architectures": [ARCHITECTURE], "vocab_size": a["vocab_size"],
        "hidden_size": a["hidden_size"], "layers_block_type": [LAYER_TYPES[symbol] for symbol in pattern],
        "num_attention_heads": a["num_attention_heads"], "num_key_value_heads": a["num_query_groups"],
        "head_dim": a["kv_channels"], "max_position_embeddings": a["max_position_embeddings"],
        "intermediate_size": a["ffn_hidden_size"], "mlp_hidden_act": "relu2", "mlp_bias": False, "use_bias": False,
        "layer_norm_epsilon": a["norm_epsilon"], "tie_word_embeddings": False, "ssm_state_size": a["mamba_state_dim"],
        "mamba_num_heads": heads, "mamba_head_dim": a["mamba_head_dim"], "n_groups": a["mamba_num_groups"],
        "conv_kernel": CONV_KERNEL, "use_conv_bias": True, "mamba_hidden_act": "silu", "num_nextn_predict_layers": 0,
    })
    if Symbols.MOE in pattern:
        hf.update(_moe_fields(a))
    return hf
