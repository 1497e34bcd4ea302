"""The Hugging Face <-> teratron weight table and its few transforms.

Names on the teratron side are global (layer indices count every pipeline stage, as in a
checkpoint). A row maps one teratron tensor to one or more HF tensors through a named transform:

    qkv      q, k, v projections <-> Megatron's fused QKV, interleaved per query group as
             [ng, (np/ng + 2) * hn, h]: each group's query heads, then its key and value head
    gate_up  gate_proj, up_proj <-> linear_fc1 = [gate; up] (SwiGLU); also each expert's
    vocab    the HF vocabulary <-> teratron's padded one (padding rows are zero); vocab_and_copy
             also writes a tied embedding as the output layer (Nemotron-H's lm_head is never tied)
    grouped_fc1, grouped_fc2
             every expert's (gate, up) / down <-> GroupedMLP's stacked, transposed
             weight1 [E, h, 2f] = [gate; up]^T and weight2 [E, f, h] = down^T
    interleaved, interleaved_fc1, grouped_interleaved, transpose, stack
             gpt-oss's experts: gate and up columns alternate in gate_up_proj [h, 2f] (and its
             bias), teratron's fc1 is [gate; up]; down_proj [f, h] is fc2 transposed
    conv1d_qkv, packed_qkv
             GPT-2's c_attn, a Conv1D [h, 3h] (weights stored [in, out], so every GPT-2 linear
             is `transpose`d) whose outputs are q | k | v, each heads in order, and its bias
             [3h] <-> the fused QKV above (one query per group: q_i, k_i, v_i per head)

MoE layers (where moe_layer_freq puts them) map the router (its bias, DeepSeek's expert bias),
the shared experts (and Qwen2-MoE's shared-expert gate) and the experts (SequentialMLP's
`local_experts.{e}` or GroupedMLP's
weight1/weight2) to the family's names; dense layers the MLP. Attention is grouped-query (with
gpt-oss's sinks, `core_attention.softmax_offset`) or DeepSeek's multi-latent attention.
Nemotron-H's hybrid layers take their rows from `hf_nemotron_h` (one table per layer symbol).
DeepSeek's MTP layers (HF layers L, L + 1, ...) map their own tensors and, through the same
rows as a decoder layer, their transformer layer's (`mtp.layers.{k}.transformer_layer.*`).
Qwen3-Next's rows (a hybrid model: two teratron layers per HF layer) come from `hf_qwen3_next`,
built on these tables; a row's transform may be such a module's own (to teratron, to HF) pair.

No RoPE permutation: HF Llama-style checkpoints and teratron both rotate halves (i, i + d/2), and
DeepSeek's (2i, 2i + 1) pairs are MLA's (a rotate-half DeepSeek checkpoint is reordered on
reading, `hf_deepseek.rope_layout_fix`).
"""

import collections
import re

import torch

from teratron.convert.hf_nemotron_h import FAMILY as NEMOTRON_H, nemotron_h_rows
from teratron.dist_checkpointing.model_args import moe_arg
from teratron.transformer.moe import moe_layer_pattern

_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
TABLE = [  # once per model
    ("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], "vocab"),
    ("decoder.final_layernorm.weight", ["model.norm.weight"], None),
    ("output_layer.weight", ["lm_head.weight"], "vocab"),
]
NORM_TABLE = [  # every layer
    (_L + "input_layernorm.weight", [_H + "input_layernorm.weight"], None),
    (_L + "pre_mlp_layernorm.weight", [_H + "post_attention_layernorm.weight"], None),
]
ATTENTION_TABLE = [  # grouped-query attention
    (_L + "self_attention.linear_qkv.weight",
     [_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"], "qkv"),
    (_L + "self_attention.linear_qkv.bias",
     [_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"], "qkv"),
    (_L + "self_attention.q_layernorm.weight", [_H + "self_attn.q_norm.weight"], None),
    (_L + "self_attention.k_layernorm.weight", [_H + "self_attn.k_norm.weight"], None),
    (_L + "self_attention.linear_proj.weight", [_H + "self_attn.o_proj.weight"], None),
    (_L + "self_attention.linear_proj.bias", [_H + "self_attn.o_proj.bias"], None),
    (_L + "self_attention.core_attention.softmax_offset", [_H + "self_attn.sinks"], None),
]
_A = _L + "self_attention."
MLA_TABLE = [  # DeepSeek's multi-latent attention; q_lora_rank None: linear_q_proj instead of the first three
    (_A + "linear_q_down_proj.weight", [_H + "self_attn.q_a_proj.weight"], None),
    (_A + "q_layernorm.weight", [_H + "self_attn.q_a_layernorm.weight"], None),
    (_A + "linear_q_up_proj.weight", [_H + "self_attn.q_b_proj.weight"], None),
    (_A + "linear_q_proj.weight", [_H + "self_attn.q_proj.weight"], None),
    (_A + "linear_kv_down_proj.weight", [_H + "self_attn.kv_a_proj_with_mqa.weight"], None),
    (_A + "kv_layernorm.weight", [_H + "self_attn.kv_a_layernorm.weight"], None),
    (_A + "linear_kv_up_proj.weight", [_H + "self_attn.kv_b_proj.weight"], None),
    (_A + "linear_proj.weight", [_H + "self_attn.o_proj.weight"], None),
]
DENSE_MLP_TABLE = [  # dense layers
    (_L + "mlp.linear_fc1.weight", [_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"], "gate_up"),
    (_L + "mlp.linear_fc1.bias", [_H + "mlp.gate_proj.bias", _H + "mlp.up_proj.bias"], "gate_up"),
    (_L + "mlp.linear_fc2.weight", [_H + "mlp.down_proj.weight"], None),
    (_L + "mlp.linear_fc2.bias", [_H + "mlp.down_proj.bias"], None),
]
# MoE layers. HF names take the family's words (HF_MOE_NAMES); {e} is the global expert index.
_X = _H + "{moe}experts.{e}."
ROUTER_TABLE = [
    (_L + "mlp.router.weight", [_H + "{router}.weight"], None),
    (_L + "mlp.router.bias", [_H + "{router}.bias"], None),
    (_L + "mlp.router.expert_bias", [_H + "{router}.e_score_correction_bias"], None),
]
SHARED_EXPERTS_TABLE = [  # DeepSeek-V3 (mlp.shared_experts.), Qwen2-MoE (mlp.shared_expert.)
    (_L + "mlp.shared_experts.linear_fc1.weight",
     [_H + "{shared}gate_proj.weight", _H + "{shared}up_proj.weight"], "gate_up"),
    (_L + "mlp.shared_experts.linear_fc2.weight", [_H + "{shared}down_proj.weight"], None),
]
SHARED_EXPERT_GATE_TABLE = [  # Qwen2-MoE: sigmoid(x . w) scales the shared expert, w [1, h]
    (_L + "mlp.shared_experts.gate_weight", [_H + "mlp.shared_expert_gate.weight"], None),
]
EXPERT_TABLE = [  # SequentialMLP: once per expert
    (_L + "mlp.experts.local_experts.{e}.linear_fc1.weight", [_X + "{gate}.weight", _X + "{up}.weight"], "gate_up"),
    (_L + "mlp.experts.local_experts.{e}.linear_fc2.weight", [_X + "{down}.weight"], None),
]
GROUPED_EXPERTS_TABLE = [  # GroupedMLP: one tensor <-> the HF names of every expert in turn
    (_L + "mlp.experts.weight1", [_X + "{gate}.weight", _X + "{up}.weight"], "grouped_fc1"),
    (_L + "mlp.experts.weight2", [_X + "{down}.weight"], "grouped_fc2"),
]
# gpt-oss stores each layer's experts stacked (STACKED_EXPERTS); the tables read expert e's slice
# under the name {moe}experts.{e}.<stacked name>: gate_up_proj [h, 2f] (gate and up columns
# alternating), gate_up_proj_bias [2f], down_proj [f, h], down_proj_bias [h].
STACKED_EXPERT_TABLE = [  # SequentialMLP
    (_L + "mlp.experts.local_experts.{e}.linear_fc1.weight", [_X + "gate_up_proj"], "interleaved_fc1"),
    (_L + "mlp.experts.local_experts.{e}.linear_fc1.bias", [_X + "gate_up_proj_bias"], "interleaved"),
    (_L + "mlp.experts.local_experts.{e}.linear_fc2.weight", [_X + "down_proj"], "transpose"),
    (_L + "mlp.experts.local_experts.{e}.linear_fc2.bias", [_X + "down_proj_bias"], None),
]
STACKED_GROUPED_EXPERTS_TABLE = [  # GroupedMLP
    (_L + "mlp.experts.weight1", [_X + "gate_up_proj"], "grouped_interleaved"),
    (_L + "mlp.experts.bias1", [_X + "gate_up_proj_bias"], "grouped_interleaved"),
    (_L + "mlp.experts.weight2", [_X + "down_proj"], "stack"),
    (_L + "mlp.experts.bias2", [_X + "down_proj_bias"], "stack"),
]
# Multi-token prediction (DeepSeek-V3): depth k + 1 is HF layer L + k (i), its transformer layer
# those rows under mtp.layers.{k}.transformer_layer.
MTP_TABLE = [
    ("mtp.layers.{k}.enorm.weight", [_H + "enorm.weight"], None),
    ("mtp.layers.{k}.hnorm.weight", [_H + "hnorm.weight"], None),
    ("mtp.layers.{k}.eh_proj.weight", [_H + "eh_proj.weight"], None),
    ("mtp.layers.{k}.final_layernorm.weight", [_H + "shared_head.norm.weight"], None),
]
STACKED_EXPERTS = {"gpt_oss": ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
_Q = dict(moe="mlp.", router="mlp.gate", gate="gate_proj", up="up_proj", down="down_proj")
HF_MOE_NAMES = {
    "mixtral": dict(moe="block_sparse_moe.", router="block_sparse_moe.gate", gate="w1", up="w3", down="w2"),
    "qwen2_moe": dict(_Q, shared="mlp.shared_expert."), "qwen3_moe": _Q,
    "deepseek_v3": dict(_Q, shared="mlp.shared_experts."), "gpt_oss": dict(moe="mlp.", router="mlp.router"),
    "qwen3_next": dict(_Q, shared="mlp.shared_expert."),
}
# GPT-2 (model_type gpt2): learned positions (wpe), LayerNorms with biases, biases on every
# linear layer; Conv1D weights [in, out].
_G = "transformer.h.{i}."
GPT2_TABLE = [  # once per model
    ("embedding.word_embeddings.weight", ["transformer.wte.weight"], "vocab"),
    ("embedding.position_embeddings.weight", ["transformer.wpe.weight"], None),
    ("decoder.final_layernorm.weight", ["transformer.ln_f.weight"], None),
    ("decoder.final_layernorm.bias", ["transformer.ln_f.bias"], None),
    ("output_layer.weight", ["lm_head.weight"], "vocab"),
]
GPT2_LAYER_TABLE = [  # every layer
    (_L + "input_layernorm.weight", [_G + "ln_1.weight"], None),
    (_L + "input_layernorm.bias", [_G + "ln_1.bias"], None),
    (_L + "self_attention.linear_qkv.weight", [_G + "attn.c_attn.weight"], "conv1d_qkv"),
    (_L + "self_attention.linear_qkv.bias", [_G + "attn.c_attn.bias"], "packed_qkv"),
    (_L + "self_attention.linear_proj.weight", [_G + "attn.c_proj.weight"], "transpose"),
    (_L + "self_attention.linear_proj.bias", [_G + "attn.c_proj.bias"], None),
    (_L + "pre_mlp_layernorm.weight", [_G + "ln_2.weight"], None),
    (_L + "pre_mlp_layernorm.bias", [_G + "ln_2.bias"], None),
    (_L + "mlp.linear_fc1.weight", [_G + "mlp.c_fc.weight"], "transpose"),
    (_L + "mlp.linear_fc1.bias", [_G + "mlp.c_fc.bias"], None),
    (_L + "mlp.linear_fc2.weight", [_G + "mlp.c_proj.weight"], "transpose"),
    (_L + "mlp.linear_fc2.bias", [_G + "mlp.c_proj.bias"], None),
]
# The input embedding's HF name, whose copy a tied model's files may hold as lm_head.weight.
_EMBEDDING = {"gpt2": "transformer.wte.weight"}
# Buffers some HF checkpoints carry that hold no weights: RoPE's frequencies, older GPT-2 saves'
# causal masks (attn.bias, attn.masked_bias); Qwen3-Next's MTP layer (mtp.*, which transformers ignores).
_IGNORED_HF = re.compile(r".*(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$|^mtp\.")


def _qkv_shape(a):
    ng, hn = a["num_query_groups"], a["kv_channels"]
    return ng, a["num_attention_heads"] // ng, hn


def fuse_qkv(q, k, v, a):
    """q [np*hn, ...], k and v [ng*hn, ...] -> [ng * (np/ng + 2) * hn, ...]."""
    ng, per_group, hn = _qkv_shape(a)
    rest = q.shape[1:]
    parts = [q.reshape(ng, per_group * hn, *rest), k.reshape(ng, hn, *rest), v.reshape(ng, hn, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv, a):
    ng, per_group, hn = _qkv_shape(a)
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(ng, (per_group + 2) * hn, *rest).split([per_group * hn, hn, hn], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def _pad_vocab(t, a):
    padded = a["padded_vocab_size"]
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if padded > t.shape[0] else t


def deinterleave(t):
    """[..., 2f] with gate and up alternating (g0 u0 g1 u1 ...) -> [..., 2f] = [gate | up]."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def interleave(t):
    """deinterleave's inverse: [..., 2f] = [gate | up] -> g0 u0 g1 u1 ..."""
    return t.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


TRANSFORMS = {  # name -> (HF tensors -> teratron tensor, teratron tensor -> HF tensors)
    None: (lambda ts, a: ts[0], lambda t, a: [t]),
    "qkv": (lambda ts, a: fuse_qkv(*ts, a), split_qkv),
    "gate_up": (lambda ts, a: torch.cat(ts), lambda t, a: list(t.chunk(2))),
    "vocab": (lambda ts, a: _pad_vocab(ts[0], a), lambda t, a: [t[:a["vocab_size"]]]),
    "vocab_and_copy": (lambda ts, a: _pad_vocab(ts[0], a),  # a tied embedding also written as the output layer
                       lambda t, a: [t[:a["vocab_size"]], t[:a["vocab_size"]].clone()]),
    "grouped_fc1": (lambda ts, a: torch.stack([torch.cat(pair).t() for pair in zip(ts[0::2], ts[1::2])]),
                    lambda t, a: [half for w in t for half in w.t().chunk(2)]),
    "grouped_fc2": (lambda ts, a: torch.stack([w.t() for w in ts]), lambda t, a: [w.t() for w in t]),
    "transpose": (lambda ts, a: ts[0].t(), lambda t, a: [t.t()]),
    "interleaved": (lambda ts, a: deinterleave(ts[0]), lambda t, a: [interleave(t)]),
    "interleaved_fc1": (lambda ts, a: deinterleave(ts[0]).t(), lambda t, a: [interleave(t.t())]),
    "grouped_interleaved": (lambda ts, a: torch.stack([deinterleave(t) for t in ts]),
                            lambda t, a: [interleave(w) for w in t]),
    "stack": (lambda ts, a: torch.stack(ts), lambda t, a: list(t)),
    "packed_qkv": (lambda ts, a: fuse_qkv(*ts[0].chunk(3), a), lambda t, a: [torch.cat(split_qkv(t, a))]),
    "conv1d_qkv": (lambda ts, a: fuse_qkv(*ts[0].t().chunk(3), a), lambda t, a: [torch.cat(split_qkv(t, a)).t()]),
}


def _pair(transform) -> tuple:
    """A row's (to teratron, to HF) functions: a TRANSFORMS name, or a family module's own pair."""
    return transform if isinstance(transform, tuple) else TRANSFORMS[transform]


def _expand(table, experts=None, **words):
    """The table's rows with `words` filled in; a row's HF names repeat for each of `experts`
    when given (grouped experts: one tensor gathers every expert's)."""
    for name, hf_names, transform in table:
        if experts is None:
            hf_names = [n.format(**words) for n in hf_names]
        else:
            hf_names = [n.format(**words, e=e) for e in experts for n in hf_names]
        yield name.format(**words), hf_names, transform


def _holds(name: str, a) -> bool:
    """Whether the model has the tensor: biases, q/k norms, sinks, the expert bias and the output
    layer follow the args."""
    if name.endswith("layernorm.bias"):
        return a["normalization"] == "LayerNorm"
    if name.endswith("mixer.conv1d.bias"):  # Mamba's convolution always has one
        return True
    if name.endswith("linear_qkv.bias"):
        return a["add_qkv_bias"] or a["add_bias_linear"]
    if name.endswith(".bias"):
        return a["add_bias_linear"]
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight", "kv_layernorm.weight")):
        return a["qk_layernorm"]
    if name.endswith("softmax_offset"):
        return a.get("softmax_type", "vanilla") == "learnable"
    if name.endswith("router.expert_bias"):
        return moe_arg(a, "moe_router_enable_expert_bias")
    if name == "output_layer.weight":
        return a["untie_embeddings_and_output_weights"]
    return True


def _rows(a, family):
    """(teratron name, HF names, transform) of every tensor the model holds."""
    return (row for row in _all_rows(a, family) if _holds(row[0], a))


def _attention_rows(a, i):
    if not a.get("multi_latent_attention"):
        return _expand(ATTENTION_TABLE, i=i)
    without = ("linear_q_proj",) if a["q_lora_rank"] else ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj")
    return (row for row in _expand(MLA_TABLE, i=i) if not any(f".{w}." in row[0] for w in without))


def _moe_rows(a, family, i):
    num_experts, words = moe_arg(a, "num_experts"), HF_MOE_NAMES[family]
    yield from _expand(ROUTER_TABLE, i=i, **words)
    if moe_arg(a, "moe_shared_expert_intermediate_size"):
        yield from _expand(SHARED_EXPERTS_TABLE, i=i, **words)
    if moe_arg(a, "moe_shared_expert_gate"):
        yield from _expand(SHARED_EXPERT_GATE_TABLE, i=i)
    stacked = family in STACKED_EXPERTS
    if moe_arg(a, "moe_grouped_gemm"):
        table = STACKED_GROUPED_EXPERTS_TABLE if stacked else GROUPED_EXPERTS_TABLE
        yield from _expand(table, range(num_experts), i=i, **words)
        return
    for e in range(num_experts):
        yield from _expand(STACKED_EXPERT_TABLE if stacked else EXPERT_TABLE, i=i, e=e, **words)


def _layer_rows(a, family, i, moe: bool):
    yield from _expand(NORM_TABLE, i=i)
    yield from _attention_rows(a, i)
    yield from _moe_rows(a, family, i) if moe else _expand(DENSE_MLP_TABLE, i=i)


def _mtp_rows(a, family, moe: bool):
    """Depth k + 1's rows (HF layer L + k): its own tensors, then its transformer layer's."""
    layers = a["num_layers"]
    for k in range(a.get("mtp_num_layers") or 0):
        yield from _expand(MTP_TABLE, i=layers + k, k=k)
        decoder, mtp = f"decoder.layers.{layers + k}.", f"mtp.layers.{k}.transformer_layer."
        for name, hf_names, transform in _layer_rows(a, family, layers + k, moe):
            yield name.replace(decoder, mtp), hf_names, transform


# family -> rows(model args) for families whose module builds its rows on this module's tables and
# registers them when imported (hf_qwen3_next; hf_config imports it with the other families).
FAMILY_ROWS = {}


def _all_rows(a, family):
    if family == NEMOTRON_H:
        yield from nemotron_h_rows(a)
        return
    if family == "gpt2":
        yield from GPT2_TABLE
        for i in range(a["num_layers"]):
            yield from _expand(GPT2_LAYER_TABLE, i=i)
        return
    if family in FAMILY_ROWS:  # a family whose own module builds its rows on these tables
        yield from FAMILY_ROWS[family](a)
        return
    yield from TABLE
    moe = moe_layer_pattern(a["num_layers"], moe_arg(a, "moe_layer_freq")) if moe_arg(a, "num_experts") else []
    for i in range(a["num_layers"]):
        yield from _layer_rows(a, family, i, bool(moe and moe[i]))
    yield from _mtp_rows(a, family, bool(moe and moe[-1]))  # an MTP layer is the last layer's kind


def mtp_copies(a) -> dict:
    """DeepSeek's copies of the embedding and output head in each MTP layer: copy -> original."""
    head = "lm_head.weight" if a["untie_embeddings_and_output_weights"] else "model.embed_tokens.weight"
    return {copy.format(i=a["num_layers"] + k): original for k in range(a.get("mtp_num_layers") or 0)
            for copy, original in ((_H + "embed_tokens.weight", "model.embed_tokens.weight"),
                                   (_H + "shared_head.head.weight", head))}


_EXPERT_SLICE = re.compile(r"^(?P<layer>model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)\.(?P<name>\w+)$")


def _source(name: str, family: str) -> tuple:
    """(the file's tensor name, expert index or None) of a row's HF name: gpt-oss's per-expert
    names are slices of the stacked tensor {layer}.experts.{name}."""
    match = _EXPERT_SLICE.match(name) if family in STACKED_EXPERTS else None
    if not match:
        return name, None
    return f"{match['layer']}.{match['name']}", int(match["e"])


def _stack_experts(tensors: dict, family) -> dict:
    """The per-expert slices {layer}.experts.{e}.{name} stacked into {layer}.experts.{name}."""
    if family not in STACKED_EXPERTS:
        return tensors
    out, slices = {}, {}
    for name, t in tensors.items():
        match = _EXPERT_SLICE.match(name)
        if match:
            slices.setdefault(f"{match['layer']}.{match['name']}", {})[int(match["e"])] = t
        else:
            out[name] = t
    for name, by_expert in slices.items():
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def check_hf_tensors(weights, expected: dict, a, family: str, source: str) -> None:
    """Refuse HF files whose tensors are not exactly the model's: one missing, one unknown, or one
    whose shape differs from `expected` (HF name -> shape, from the config; the MTP layers'
    copies of the embedding and head may be absent). `weights` has the files' `shapes` and
    `files` (name -> shape / file name); nothing is read but the headers."""
    allowed = dict(expected)
    if not a["untie_embeddings_and_output_weights"]:  # a tied copy of the embedding, if saved
        allowed["lm_head.weight"] = expected[_EMBEDDING.get(family, "model.embed_tokens.weight")]
    missing = sorted(set(expected) - set(weights.shapes) - set(mtp_copies(a)))
    if missing:
        raise ValueError(f"{source}: {missing[0]} is missing{_more(missing)} (config.json says the model has "
                         "it); the files are incomplete or do not match the config")
    unknown = sorted(n for n in set(weights.shapes) - set(allowed) if not _IGNORED_HF.match(n))
    if unknown:
        raise ValueError(f"{source}: {len(unknown)} tensors have no teratron counterpart, e.g. {unknown[0]}; "
                         "the model has parts this converter does not know, or config.json describes another model")
    wrong = [n for n in sorted(weights.shapes) if n in allowed and tuple(weights.shapes[n]) != tuple(allowed[n])]
    if wrong:
        name = wrong[0]
        raise ValueError(f"{source}: {name} in {weights.files[name]} has shape {list(weights.shapes[name])} but "
                         f"config.json (hidden_size, intermediate_size, heads, vocab_size, ...) gives "
                         f"{list(allowed[name])}{_more(wrong)}; the weights and config.json disagree: use the "
                         "config.json saved with these weights")


def _more(names) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _shard_schedule(rows: list, weights, family: str) -> list:
    """For each shard file in order: (file, the tensors rows read from it, the rows whose last
    input it holds), so a row is converted as soon as its inputs are in."""
    position = {filename: i for i, filename in enumerate(weights.shard_files())}
    schedule = [(filename, set(), []) for filename in weights.shard_files()]
    for row in rows:
        files = []
        for name in row[1]:
            tensor_name = _source(name, family)[0]
            files.append(position[weights.files[tensor_name]])
            schedule[files[-1]][1].add(tensor_name)
        schedule[max(files)][2].append(row)
    return schedule


def stream_hf_to_teratron(weights, a, family: str, fix=None, meta: bool = False):
    """Yield (teratron name, global tensor) for every tensor of the model, reading the HF files of
    `family` shard by shard (`weights`: safetensors_io.HFWeights; check them first with
    `check_hf_tensors`). A row is converted once its last input is read, and each HF tensor is
    dropped once every row using it is done: at most one shard plus the inputs of rows that span
    shards is held. Dtypes stay as stored. `fix(name, tensor)` adjusts an HF tensor as it is read
    (DeepSeek's RoPE layout); `meta` yields meta tensors of the right shapes and dtypes, reading
    no data (in the same order)."""
    rows = list(_rows(a, family))
    uses = collections.Counter(_source(name, family)[0] for row in rows for name in row[1])
    held = {}
    for filename, names, done in _shard_schedule(rows, weights, family):
        shard = (weights.meta_shard if meta else weights.read_shard)(filename, sorted(names))
        held.update({name: fix(name, t) if fix else t for name, t in shard.items()})
        del shard  # `held` alone keeps the tensors, so each goes when its last row is done
        for name, hf_names, transform in done:
            sources = [_source(n, family) for n in hf_names]
            inputs = [held[tensor_name] if e is None else held[tensor_name][e] for tensor_name, e in sources]
            tensor = _pair(transform)[0](inputs, a).contiguous()
            if tensor.untyped_storage().nbytes() > tensor.nbytes:  # a slice of a stacked tensor: not all of it
                tensor = tensor.clone()
            del inputs
            for tensor_name, _ in sources:
                uses[tensor_name] -= 1
                if not uses[tensor_name]:
                    del held[tensor_name]
            yield name, tensor
            del tensor  # the consumer's now


def teratron_to_hf(state: dict, a, family: str) -> dict:
    """HF state dict of `family` from a global teratron state dict (every tensor of the model)."""
    out, left = {}, dict(state)
    for name, names, transform in _rows(a, family):
        if name not in left:
            raise ValueError(f"checkpoint tensor {name} is missing (the model args say the model has it); "
                             "the checkpoint is incomplete or its metadata.json does not match it")
        out.update(zip(names, _pair(transform)[1](left.pop(name), a)))
    if left:
        raise ValueError(f"checkpoint tensor {sorted(left)[0]} has no Hugging Face counterpart; "
                         "the model has parts the converter does not know")
    out.update({copy: out[original].clone() for copy, original in mtp_copies(a).items()})  # files hold copies
    return {k: v.contiguous() for k, v in _stack_experts(out, family).items()}
