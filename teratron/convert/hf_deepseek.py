"""DeepSeek-V3's config.json <-> teratron model args, and the few things its weights need.

Attention is multi-latent (q_lora_rank, kv_lora_rank, qk_nope_head_dim -> qk_head_dim,
qk_rope_head_dim -> qk_pos_emb_head_dim, v_head_dim; its latent norms are qk_layernorm) with
RoPE or YaRN on the positional part (MLA's rope_type; factor, original_max_position_embeddings,
beta_fast, beta_slow, mscale, mscale_all_dim). The first `first_k_dense_replace` layers have a
dense MLP of intermediate_size, the others MoE: sigmoid scores, the choice made on score +
e_score_correction_bias (teratron's expert bias) within the best `topk_group` of `n_group`
expert groups, a group scored by the sum of its best two (Megatron: its best
topk // group_topk, so topk // topk_group must be 2), weights renormalised (norm_topk_prob) and
times routed_scaling_factor, plus n_shared_experts shared experts of moe_intermediate_size each
(one MLP of their summed size).

RoPE layout: DeepSeek rotates channel pairs (2i, 2i + 1), as teratron's MLA does; with
`rope_interleave` false transformers rotates the halves (i, i + d/2) instead, so the import
reorders the positional rows of q_b_proj (q_proj) and kv_a_proj_with_mqa. Exports are written
interleaved (rope_interleave true, DeepSeek's own layout).

The latent norms of transformers' DeepSeek-V3 use eps 1e-6 whatever rms_norm_eps says;
teratron's use rms_norm_eps (a config with another value converts, with a warning).

Multi-token prediction: the num_nextn_predict_layers MTP layers are model.layers.{L + k}.* past
the last layer (DeepSeek's layout, which transformers' MtpModel reads): enorm, hnorm, eh_proj
[h, 2h] on [enorm(embedding), hnorm(h)], a decoder layer (MoE), shared_head.norm (teratron's
final_layernorm), and copies of the embedding and output head (embed_tokens,
shared_head.head), which teratron's MTP shares with the model: read only to check they are
copies, written back on export. A file set without those layers imports without MTP.
"""

import re
import warnings

import torch

from teratron.convert.hf_fields import require_fields, rope_args_from_hf
from teratron.transformer.moe import moe_layer_pattern

FAMILY = "deepseek_v3"
LATENT_NORM_EPS = 1e-6
# transformers' group score: the sum of a group's best two experts.
GROUP_SCORE_EXPERTS = 2


def routing_args(hf: dict, source: str) -> dict:
    """The sigmoid router's renormalisation check and its expert groups (DeepSeek-V3's router, which
    Nemotron-H shares): moe_router_num_groups / moe_router_group_topk, or {} without groups."""
    topk, experts = hf["num_experts_per_tok"], hf["n_routed_experts"]
    if bool(hf.get("norm_topk_prob", True)) != (topk > 1):
        raise ValueError(f"{source}: norm_topk_prob={hf.get('norm_topk_prob', True)} with num_experts_per_tok={topk}; "
                         "teratron's sigmoid router renormalises exactly when top-k > 1")
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups == 1:
        return {}
    if experts % groups or topk // group_topk != GROUP_SCORE_EXPERTS or experts // groups < GROUP_SCORE_EXPERTS:
        raise ValueError(f"{source}: n_group={groups}, topk_group={group_topk} with {experts} experts and top-"
                         f"{topk}: transformers scores a group by its best {GROUP_SCORE_EXPERTS} experts, Megatron by "
                         f"its best num_experts_per_tok // topk_group; they agree only when that is "
                         f"{GROUP_SCORE_EXPERTS}")
    return {"moe_router_num_groups": groups, "moe_router_group_topk": group_topk}


def _moe_args(hf: dict, source: str) -> dict:
    layers = hf["num_hidden_layers"]
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{source}: moe_layer_freq={hf['moe_layer_freq']}; transformers' deepseek_v3 ignores it "
                         "(every layer from first_k_dense_replace is MoE), so its meaning is ambiguous")
    pattern = [int(i >= (hf.get("first_k_dense_replace") or 0)) for i in range(layers)]
    if not any(pattern):
        return {}
    shared = hf.get("n_shared_experts") or 0
    if shared < 1:
        raise ValueError(f"{source}: n_shared_experts={shared}; transformers' deepseek_v3 always runs a shared "
                         "expert, give at least 1")
    return {
        "num_experts": hf["n_routed_experts"], "moe_router_topk": hf["num_experts_per_tok"],
        "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_grouped_gemm": False,
        "moe_shared_expert_intermediate_size": hf["moe_intermediate_size"] * shared,
        "moe_layer_freq": 1 if all(pattern) else pattern, "moe_router_pre_softmax": False,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        **routing_args(hf, source),
    }


def _mla_args(hf: dict, source: str) -> dict:
    rope = rope_args_from_hf(hf, source, yarn=True)
    if rope["rope_type"] == "yarn" and not rope["yarn_correction_range_round_to_int"]:
        raise ValueError(f"{source}: YaRN with truncate=false; multi-latent attention's YaRN rounds the ramp's "
                         "bounds (Megatron), only truncate=true converts")
    yarn = {name: rope[name] for name in ("rotary_scaling_factor", "mscale", "mscale_all_dim",
                                          "yarn_original_max_position_embeddings", "yarn_beta_fast",
                                          "yarn_beta_slow")} if rope["rope_type"] == "yarn" else {
        "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
        "yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0,
        "yarn_beta_slow": 1.0}
    return {"multi_latent_attention": True, "q_lora_rank": hf.get("q_lora_rank"),
            "kv_lora_rank": hf["kv_lora_rank"], "qk_head_dim": hf["qk_nope_head_dim"],
            "qk_pos_emb_head_dim": hf["qk_rope_head_dim"], "v_head_dim": hf["v_head_dim"],
            "rope_type": rope["rope_type"], "rotary_base": rope["rotary_base"], **yarn}


def deepseek_args(hf: dict, source: str) -> dict:
    """The model args of a deepseek_v3 config (the fields every family shares come from the caller)."""
    require_fields(hf, source, ["intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                "v_head_dim", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"])
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true (biases on q_a_proj, kv_a_proj_with_mqa and o_proj only); "
                         "teratron's multi-latent attention has no down-projection biases")
    eps = hf.get("rms_norm_eps", 1e-6)
    if eps != LATENT_NORM_EPS:
        warnings.warn(f"{source}: rms_norm_eps={eps}: transformers normalises the MLA latents with eps "
                      f"{LATENT_NORM_EPS}, teratron with rms_norm_eps; logits differ slightly", stacklevel=2)
    heads = hf["num_attention_heads"]
    return {"ffn_hidden_size": hf["intermediate_size"], "num_query_groups": heads,
            "kv_channels": hf["hidden_size"] // heads, "swiglu": True, "add_bias_linear": False,
            "add_qkv_bias": False, "qk_layernorm": True, "position_embedding_type": "rope",
            **_mla_args(hf, source), **_moe_args(hf, source)}


def mtp_args(hf: dict, names, source: str) -> dict:
    """{"mtp_num_layers": n} when the files hold the num_nextn_predict_layers = n MTP layers
    (model.layers.{L}.* to model.layers.{L + n - 1}.*); {} when they hold none (transformers saves
    none, whatever its config says: a warning then)."""
    layers, wanted = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers") or 0
    found = sorted({int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))
                    and int(m.group(1)) >= layers})
    if not found:
        if wanted:
            warnings.warn(f"{source}: config.json says num_nextn_predict_layers={wanted} but the files hold no "
                          f"multi-token-prediction layer (model.layers.{layers}.*); imported without", stacklevel=2)
        return {}
    if found != list(range(layers, layers + wanted)):
        raise ValueError(f"{source}: the files hold layers {found} past num_hidden_layers={layers}, but "
                         f"num_nextn_predict_layers={wanted} asks for layers {layers}..{layers + wanted - 1}; the "
                         "files and config.json disagree")
    return {"mtp_num_layers": wanted}


def check_mtp_copies(read, names, copies: dict, source: str) -> None:
    """DeepSeek's MTP layers carry copies of the embedding and output head (`copies`: copy name ->
    the model's tensor name); teratron's MTP uses the model's own, so a copy present in the files
    must equal it."""
    for copy, original in copies.items():
        if copy in names and not torch.equal(read(copy), read(original)):
            raise ValueError(f"{source}: {copy} differs from {original}; teratron's multi-token prediction shares "
                             "the model's embedding and output layer, so it cannot hold another")


def _halves_to_pairs(rows: torch.Tensor, d: int) -> torch.Tensor:
    """Rows [..., d, in] of rotate-half layout (pair i = channels i, i + d/2) -> pair layout
    (pair i = channels 2i, 2i + 1)."""
    order = torch.arange(d).view(2, d // 2).t().reshape(-1)
    return rows[..., order, :]


def rope_layout_fix(hf: dict):
    """(HF tensor name, tensor) -> the tensor with its positional rows in teratron's pair layout
    when the checkpoint rotates halves (rope_interleave false); None when it does not."""
    if hf.get("rope_interleave", True):
        return None
    d, nope = hf["qk_rope_head_dim"], hf["qk_nope_head_dim"]

    def reordered(name, t):
        if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            heads = t.view(-1, nope + d, t.shape[-1])
            return torch.cat([heads[:, :nope], _halves_to_pairs(heads[:, nope:], d)], dim=1).reshape(t.shape)
        if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            return torch.cat([t[:-d], _halves_to_pairs(t[-d:], d)])
        return t
    return reordered


def _check_exportable(a: dict) -> None:
    needed = {"qk_layernorm": True, "add_bias_linear": False, "swiglu": True, "quick_geglu": False,
              "openai_gelu": False, "window_size": None, "softmax_type": "vanilla", "no_rope_freq": None,
              "activation_func_clamp_value": None, "glu_linear_offset": 0.0, "position_embedding_type": "rope"}
    if a["num_experts"]:
        needed.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_shared_expert_gate=False)
    for name, value in needed.items():
        if a.get(name, value) != value:
            raise ValueError(f"the checkpoint's MLA model has {name}={a.get(name)!r}; DeepSeek-V3 needs {value!r}, so "
                             "it has no Hugging Face family to export to")


def _moe_fields(a: dict) -> dict:
    layers = a["num_layers"]
    if not a["num_experts"]:
        return {"first_k_dense_replace": layers}
    pattern = moe_layer_pattern(layers, a["moe_layer_freq"])
    dense = pattern.index(1)
    shared = a["moe_shared_expert_intermediate_size"] or 0
    groups, group_topk, topk = a.get("moe_router_num_groups"), a.get("moe_router_group_topk"), a["moe_router_topk"]
    if any(pattern[:dense]) or not all(pattern[dense:]) or shared % a["moe_ffn_hidden_size"] or not shared \
            or (group_topk and topk // group_topk != GROUP_SCORE_EXPERTS):
        raise ValueError(f"the checkpoint's MoE layout (moe_layer_freq={a['moe_layer_freq']}, shared experts "
                         f"{shared}, groups {groups}/{group_topk}) is not DeepSeek-V3's: leading dense layers then "
                         "MoE, shared experts a multiple of the experts' size, a group scored by its best two")
    return {"first_k_dense_replace": dense, "moe_intermediate_size": a["moe_ffn_hidden_size"],
            "n_routed_experts": a["num_experts"], "num_experts_per_tok": topk,
            "n_shared_experts": shared // a["moe_ffn_hidden_size"], "norm_topk_prob": topk > 1,
            "routed_scaling_factor": a["moe_router_topk_scaling_factor"] or 1.0,
            "n_group": groups or 1, "topk_group": group_topk or 1}


def deepseek_hf_fields(a: dict) -> dict:
    """The DeepSeek-V3 fields of the exported config.json but RoPE."""
    _check_exportable(a)
    return {"intermediate_size": a["ffn_hidden_size"], "num_key_value_heads": a["num_attention_heads"],
            "q_lora_rank": a["q_lora_rank"], "kv_lora_rank": a["kv_lora_rank"],
            "qk_nope_head_dim": a["qk_head_dim"], "qk_rope_head_dim": a["qk_pos_emb_head_dim"],
            "v_head_dim": a["v_head_dim"], "head_dim": a["qk_pos_emb_head_dim"],
            "qk_head_dim": a["qk_head_dim"] + a["qk_pos_emb_head_dim"], "rope_interleave": True,
            "attention_bias": False, "num_nextn_predict_layers": a.get("mtp_num_layers") or 0, **_moe_fields(a)}
