"""Qwen3-Next (model_type qwen3_next) <-> a teratron hybrid model.

A Qwen3-Next decoder layer is a token mixer (Gated DeltaNet on the layers `layer_types` marks
"linear_attention", gated attention on the "full_attention" ones) then an MLP (MoE, or dense on
the layers `mlp_only_layers` / `decoder_sparse_step` leave dense), each pre-norm with its own
residual: two teratron hybrid layers, so HF layer i is teratron layers 2i (G or *) and 2i + 1
(E or -), e.g. "GEGEGE*E".

    HF                                   teratron (hybrid layer 2i, 2i + 1)
    input_layernorm                      2i.input_layernorm
    linear_attn.in_proj_qkvz, in_proj_ba 2i.self_attention.in_proj = [q; k; v; z; b; a]
    linear_attn.conv1d, dt_bias, A_log   2i.self_attention.conv1d, dt_bias, A_log
    linear_attn.norm (w)                 2i.self_attention.out_norm (w - 1: zero-centred, see below)
    linear_attn.out_proj                 2i.self_attention.out_proj
    self_attn.q_proj, k_proj, v_proj     2i.self_attention.linear_qkv (gated: per group q, gate, k, v)
    self_attn.q_norm, k_norm, o_proj     2i.self_attention.q_layernorm, k_layernorm, linear_proj
    post_attention_layernorm             2i+1.pre_mlp_layernorm
    mlp.gate, experts, shared_expert(_gate)   2i+1.mlp.router, experts, shared_experts (gate_weight)
    mlp.gate_proj, up_proj, down_proj    2i+1.mlp.linear_fc1 = [gate; up], linear_fc2

The math, checked against transformers' modeling code:
- Every RMSNorm but the Gated DeltaNet's output norm is zero-centred ((1 + w) x / rms(x), weight
  stored as w): teratron's `layernorm_zero_centered_gamma`, weights one to one. The output norm
  (transformers' Qwen3NextRMSNormGated) is a plain w x / rms(x), but teratron's GatedDeltaNet uses
  the model's norm there (Megatron's), so its weight is stored as w - 1 (in fp32; the round trip
  w -> w - 1 -> w is exact for w >= 0.5, where Sterbenz's lemma makes w - 1 exact).
- Gated attention: q_proj gives per head [query (hd); gate (hd)]; the output of each head is
  multiplied by sigmoid(gate) before o_proj: `attention_output_gate`, whose rows teratron groups
  per query group as [queries; gates; key; value] (Megatron's). q/k norms per head, then RoPE on
  the first int(head_dim * partial_rotary_factor) channels (rotate-half): `rotary_percent`.
- Gated DeltaNet: in_proj_qkvz's rows are grouped per key head, [q (dk); k (dk); v (r dv); z (r dv)]
  with r = value heads / key heads, and in_proj_ba's as [b (r); a (r)]; value head j belongs to
  key head j // r in both (transformers repeat_interleaves q and k), which is teratron's order,
  so regrouping the rows into [q; k; v; z; b; a] is all. The convolution runs over [q; k; v]
  (heads in order) with SiLU, q and k are L2-normalised (eps 1e-6) and q scaled by 1/sqrt(dk),
  g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), then out_proj(norm(o) silu(z)): all
  as teratron's GatedDeltaNet.
- MoE: softmax over all experts, top k, renormalised with norm_topk_prob; a shared expert scaled
  by sigmoid(x . shared_expert_gate): `moe_shared_expert_gate` (as Qwen2-MoE, `hf_moe`).

Refused with one line: attention biases (attention_bias) and other RoPE types. The checkpoint's
multi-token-prediction weights (mtp.*) are not read, as transformers ignores them too.
"""

import torch

from teratron.convert.hf_fields import _rope_fields, require_fields, rope_args_from_hf
from teratron.convert.hf_mapping import (DENSE_MLP_TABLE, FAMILY_ROWS, NORM_TABLE, TABLE, _expand, _moe_rows,
                                         _qkv_shape)
from teratron.convert.hf_moe import hf_moe_pattern, moe_args_from_hf
from teratron.dist_checkpointing.model_args import MOE_DEFAULTS, VARIANT_DEFAULTS
from teratron.models.hybrid import Symbols

FAMILY = "qwen3_next"
ARCHITECTURE = "Qwen3NextForCausalLM"
LINEAR, FULL = "linear_attention", "full_attention"
# transformers' defaults for fields a config.json may leave out
HF_DEFAULTS = {"head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
               "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
               "partial_rotary_factor": 0.25, "full_attention_interval": 4}
LINEAR_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads")


def _layer_types(hf: dict, source: str) -> list:
    """Each layer's mixer: `layer_types`, else every full_attention_interval-th layer full."""
    layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", HF_DEFAULTS["full_attention_interval"])
    types = hf.get("layer_types") or [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    if len(types) != layers or not set(types) <= {LINEAR, FULL}:
        raise ValueError(f"{source}: layer_types must give one of {LINEAR!r} / {FULL!r} per layer "
                         f"({layers}); restore the model's config.json")
    return types


def _partial_rotary_factor(hf: dict) -> float:
    return float(_rope_fields(hf).get("partial_rotary_factor",
                                      hf.get("partial_rotary_factor", HF_DEFAULTS["partial_rotary_factor"])))


def _moe_args(hf: dict, source: str) -> dict:
    """The MoE args (none when every layer is dense); the hybrid pattern places the MoE layers."""
    if not any(hf_moe_pattern(hf, "qwen3_moe")):
        return dict(MOE_DEFAULTS)
    require_fields(hf, source, ["num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"])
    args = moe_args_from_hf(hf, "qwen3_moe", source)
    return {**args, "moe_layer_freq": 1, "moe_shared_expert_gate": True,
            "moe_shared_expert_intermediate_size": hf["shared_expert_intermediate_size"]}


def qwen3_next_args(hf: dict, source: str) -> dict:
    """The model args of a qwen3_next config (the fields every family shares come from the caller)."""
    require_fields(hf, source, ["intermediate_size"])
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true; teratron's Qwen3-Next has no attention biases (its "
                         "MLPs and Gated DeltaNet have none), only attention_bias false converts")
    rope = rope_args_from_hf(hf, source)
    moe = hf_moe_pattern(hf, "qwen3_moe")
    pattern = "".join((Symbols.GDN if kind == LINEAR else Symbols.ATTENTION) + (Symbols.MOE if is_moe else Symbols.MLP)
                      for kind, is_moe in zip(_layer_types(hf, source), moe))
    return {
        "num_layers": len(pattern), "hybrid_layer_pattern": pattern, "ffn_hidden_size": hf["intermediate_size"],
        "num_query_groups": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "kv_channels": hf.get("head_dim", HF_DEFAULTS["head_dim"]), "swiglu": True, "add_bias_linear": False,
        "add_qkv_bias": False, "qk_layernorm": True, "position_embedding_type": "rope",
        "rotary_base": rope["rotary_base"], "rotary_percent": _partial_rotary_factor(hf),
        "layernorm_zero_centered_gamma": True, "attention_output_gate": True,
        **{name: hf.get(name, HF_DEFAULTS[name]) for name in LINEAR_FIELDS}, **_moe_args(hf, source),
    }


def _layer_pairs(a: dict) -> list:
    """(mixer, MLP) symbols of each Qwen3-Next layer, or ValueError when the pattern is not one."""
    pattern = a.get("hybrid_layer_pattern") or ""
    pairs = [pattern[i:i + 2] for i in range(0, len(pattern), 2)]
    if not pairs or any(len(p) != 2 or p[0] not in "G*" or p[1] not in "E-" for p in pairs):
        raise ValueError(f"the checkpoint's hybrid pattern {pattern!r} is not Qwen3-Next's (each layer a Gated "
                         "DeltaNet G or attention * followed by a MoE E or MLP -), so it has no Hugging Face family "
                         "to export to")
    return pairs


_NEEDED = {"normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False, "add_qkv_bias": False,
           "qk_layernorm": True, "position_embedding_type": "rope", "rotary_interleaved": False,
           "use_rope_scaling": False, "layernorm_zero_centered_gamma": True, "attention_output_gate": True,
           "mtp_num_layers": None, "multi_latent_attention": False,
           **{name: VARIANT_DEFAULTS[name] for name in ("window_size", "softmax_type", "no_rope_freq",
                                                        "activation_func_clamp_value", "glu_linear_offset")}}
_NEEDED_MOE = {"moe_shared_expert_gate": True, "moe_router_score_function": "softmax",
               "moe_router_topk_scaling_factor": None, "moe_router_enable_expert_bias": False,
               "moe_router_num_groups": None}


def _check_exportable(a: dict, has_moe: bool) -> None:
    a = {"mtp_num_layers": None, "multi_latent_attention": False, **a}  # older records lack these
    for name, value in {**_NEEDED, **(_NEEDED_MOE if has_moe else {})}.items():
        if a.get(name) != value:
            raise ValueError(f"the checkpoint's hybrid model has {name}={a.get(name)!r}; Qwen3-Next needs {value!r}, "
                             "so it has no Hugging Face family to export to")
    if has_moe and not a.get("moe_shared_expert_intermediate_size"):
        raise ValueError("the checkpoint's hybrid model has MoE layers without shared experts; Qwen3-Next's MoE "
                         "always runs a gated shared expert, so it has no Hugging Face family to export to")


def qwen3_next_hf_config(a: dict, base: dict | None, aux_loss_coeff: float | None = None) -> dict:
    """The config.json of a Qwen3-Next-shaped hybrid model (`base`: the imported config, kept for its
    other fields such as token ids)."""
    pairs = _layer_pairs(a)
    has_moe = any(mlp == Symbols.MOE for _, mlp in pairs)
    _check_exportable(a, has_moe)
    hf = {k: v for k, v in (base or {}).items()
          if k not in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
                       "full_attention_interval", "num_experts", "num_local_experts")}
    hf.update({
        "model_type": FAMILY, "architectures": [ARCHITECTURE], "num_hidden_layers": len(pairs),
        "hidden_size": a["hidden_size"], "num_attention_heads": a["num_attention_heads"],
        "num_key_value_heads": a["num_query_groups"], "head_dim": a["kv_channels"],
        "intermediate_size": a["ffn_hidden_size"], "hidden_act": "silu", "rms_norm_eps": a["norm_epsilon"],
        "tie_word_embeddings": not a["untie_embeddings_and_output_weights"], "attention_bias": False,
        "max_position_embeddings": a["max_position_embeddings"], "vocab_size": a["vocab_size"],
        "layer_types": [LINEAR if mixer == Symbols.GDN else FULL for mixer, _ in pairs],
        "rope_parameters": {"rope_type": "default", "rope_theta": float(a["rotary_base"]),
                            "partial_rotary_factor": a["rotary_percent"]},
        **{name: a[name] for name in LINEAR_FIELDS},
        "num_experts": a["num_experts"] if has_moe else 0, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, (_, mlp) in enumerate(pairs) if mlp == Symbols.MLP],
    })
    if has_moe:
        hf.update(num_experts_per_tok=a["moe_router_topk"], moe_intermediate_size=a["moe_ffn_hidden_size"],
                  shared_expert_intermediate_size=a["moe_shared_expert_intermediate_size"],
                  norm_topk_prob=not a["moe_router_pre_softmax"])
        if aux_loss_coeff is not None:
            hf["router_aux_loss_coef"] = aux_loss_coeff
    return hf


# Weights: {j} is the teratron layer, {i} the HF layer.
_T, _H = "decoder.layers.{j}.self_attention.", "model.layers.{i}."


def fuse_gated_qkv(q_gate, k, v, a):
    """q_proj [np * 2 hn, ...] (per head its query, then its gate), k and v [ng * hn, ...] ->
    linear_qkv [ng * (2 np/ng + 2) * hn, ...] (per group its queries, their gates, key, value)."""
    ng, per_group, hn = _qkv_shape(a)
    rest = k.shape[1:]
    heads = q_gate.reshape(ng, per_group, 2, hn, *rest)
    parts = [heads[:, :, 0].reshape(ng, per_group * hn, *rest), heads[:, :, 1].reshape(ng, per_group * hn, *rest),
             k.reshape(ng, hn, *rest), v.reshape(ng, hn, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_gated_qkv(qkv, a):
    ng, per_group, hn = _qkv_shape(a)
    rest = qkv.shape[1:]
    q, gate, k, v = qkv.reshape(ng, (2 * per_group + 2) * hn, *rest).split(
        [per_group * hn, per_group * hn, hn, hn], dim=1)
    q_gate = torch.stack([t.reshape(ng, per_group, hn, *rest) for t in (q, gate)], dim=2)
    return [q_gate.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


def _gdn_sizes(a):
    """(key heads, dk, r value heads per key head, dv)."""
    nk, nv = a["linear_num_key_heads"], a["linear_num_value_heads"]
    return nk, a["linear_key_head_dim"], nv // nk, a["linear_value_head_dim"]


def fuse_gdn_in_proj(qkvz, ba, a):
    """in_proj_qkvz [nk * (2 dk + 2 r dv), h] and in_proj_ba [nk * 2r, h], grouped per key head ->
    in_proj [q; k; v; z; b; a]."""
    nk, dk, r, dv = _gdn_sizes(a)
    q, k, v, z = qkvz.reshape(nk, -1, qkvz.shape[-1]).split([dk, dk, r * dv, r * dv], dim=1)
    b, alpha = ba.reshape(nk, 2 * r, ba.shape[-1]).split([r, r], dim=1)
    return torch.cat([t.flatten(0, 1) for t in (q, k, v, z, b, alpha)])


def split_gdn_in_proj(in_proj, a):
    nk, dk, r, dv = _gdn_sizes(a)
    q, k, v, z, b, alpha = (t.reshape(nk, -1, in_proj.shape[-1]) for t in
                            in_proj.split([nk * dk, nk * dk, nk * r * dv, nk * r * dv, nk * r, nk * r]))
    return [torch.cat([q, k, v, z], dim=1).flatten(0, 1), torch.cat([b, alpha], dim=1).flatten(0, 1)]


def _shift(t, by: float):
    return (t.float() + by).to(t.dtype)


GATED_QKV = (lambda ts, a: fuse_gated_qkv(*ts, a), split_gated_qkv)
GDN_IN_PROJ = (lambda ts, a: fuse_gdn_in_proj(*ts, a), split_gdn_in_proj)
ONE_CENTRED_NORM = (lambda ts, a: _shift(ts[0], -1.0), lambda t, a: [_shift(t, 1.0)])  # HF w <-> teratron w - 1

GDN_TABLE = [
    (_T + "in_proj.weight", [_H + "linear_attn.in_proj_qkvz.weight", _H + "linear_attn.in_proj_ba.weight"],
     GDN_IN_PROJ),
    (_T + "conv1d.weight", [_H + "linear_attn.conv1d.weight"], None),
    (_T + "dt_bias", [_H + "linear_attn.dt_bias"], None),
    (_T + "A_log", [_H + "linear_attn.A_log"], None),
    (_T + "out_norm.weight", [_H + "linear_attn.norm.weight"], ONE_CENTRED_NORM),
    (_T + "out_proj.weight", [_H + "linear_attn.out_proj.weight"], None),
]
GATED_ATTENTION_TABLE = [
    (_T + "linear_qkv.weight",
     [_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"], GATED_QKV),
    (_T + "q_layernorm.weight", [_H + "self_attn.q_norm.weight"], None),
    (_T + "k_layernorm.weight", [_H + "self_attn.k_norm.weight"], None),
    (_T + "linear_proj.weight", [_H + "self_attn.o_proj.weight"], None),
]


def _moved(rows, i: int, j: int):
    """Rows of HF layer i's tables (teratron names at layer i) moved to teratron layer j."""
    for name, hf_names, transform in rows:
        yield name.replace(f"decoder.layers.{i}.", f"decoder.layers.{j}.", 1), hf_names, transform


def qwen3_next_rows(a: dict):
    """(teratron name, HF names, transform) of every tensor of a Qwen3-Next model; a transform is
    a name of hf_mapping's TRANSFORMS or a (to teratron, to HF) pair of this module."""
    yield from TABLE
    input_norm, mlp_norm = NORM_TABLE
    for i, (mixer, mlp) in enumerate(_layer_pairs(a)):
        j = 2 * i
        yield from _moved(_expand([input_norm], i=i), i, j)
        yield from _expand(GDN_TABLE if mixer == Symbols.GDN else GATED_ATTENTION_TABLE, i=i, j=j)
        yield from _moved(_expand([mlp_norm], i=i), i, j + 1)
        yield from _moved(_moe_rows(a, FAMILY, i) if mlp == Symbols.MOE else _expand(DENSE_MLP_TABLE, i=i), i, j + 1)



FAMILY_ROWS[FAMILY] = qwen3_next_rows