"""The Hugging Face <-> teratron weight table and its few transforms.

Names on the teratron side are global (layer indices count every pipeline stage, as in a
checkpoint). A row maps one teratron tensor to one or more HF tensors through a named transform:

    qkv      q, k, v projections <-> Megatron's fused QKV, interleaved per query group as
             [ng, (np/ng + 2) * hn, h]: each group's query heads, then its key and value head
    gate_up  gate_proj, up_proj <-> linear_fc1 = [gate; up] (SwiGLU); also each expert's
    vocab    the HF vocabulary <-> teratron's padded one (padding rows are zero)
    grouped_fc1, grouped_fc2
             every expert's (gate, up) / down <-> GroupedMLP's stacked, transposed
             weight1 [E, h, 2f] = [gate; up]^T and weight2 [E, f, h] = down^T

MoE layers (where moe_layer_freq puts them) map the router and the experts (SequentialMLP's
`local_experts.{e}` or GroupedMLP's weight1/weight2) to the family's names; dense layers the MLP.

No RoPE permutation: HF Llama-style checkpoints and teratron both rotate halves (i, i + d/2).
"""

import re

import torch

from teratron.dist_checkpointing.model_args import moe_arg
from teratron.transformer.moe import moe_layer_pattern

_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
TABLE = [  # once per model
    ("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], "vocab"),
    ("decoder.final_layernorm.weight", ["model.norm.weight"], None),
    ("output_layer.weight", ["lm_head.weight"], "vocab"),
]
LAYER_TABLE = [  # every layer
    (_L + "input_layernorm.weight", [_H + "input_layernorm.weight"], None),
    (_L + "self_attention.linear_qkv.weight",
     [_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"], "qkv"),
    (_L + "self_attention.linear_qkv.bias",
     [_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"], "qkv"),
    (_L + "self_attention.q_layernorm.weight", [_H + "self_attn.q_norm.weight"], None),
    (_L + "self_attention.k_layernorm.weight", [_H + "self_attn.k_norm.weight"], None),
    (_L + "self_attention.linear_proj.weight", [_H + "self_attn.o_proj.weight"], None),
    (_L + "self_attention.linear_proj.bias", [_H + "self_attn.o_proj.bias"], None),
    (_L + "pre_mlp_layernorm.weight", [_H + "post_attention_layernorm.weight"], None),
]
DENSE_MLP_TABLE = [  # dense layers
    (_L + "mlp.linear_fc1.weight", [_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"], "gate_up"),
    (_L + "mlp.linear_fc1.bias", [_H + "mlp.gate_proj.bias", _H + "mlp.up_proj.bias"], "gate_up"),
    (_L + "mlp.linear_fc2.weight", [_H + "mlp.down_proj.weight"], None),
    (_L + "mlp.linear_fc2.bias", [_H + "mlp.down_proj.bias"], None),
]
# MoE layers. HF names take the family's words (HF_MOE_NAMES); {e} is the global expert index.
_X = _H + "{moe}experts.{e}."
ROUTER_TABLE = [(_L + "mlp.router.weight", [_H + "{moe}gate.weight"], None)]
EXPERT_TABLE = [  # SequentialMLP: once per expert
    (_L + "mlp.experts.local_experts.{e}.linear_fc1.weight", [_X + "{gate}.weight", _X + "{up}.weight"], "gate_up"),
    (_L + "mlp.experts.local_experts.{e}.linear_fc2.weight", [_X + "{down}.weight"], None),
]
GROUPED_EXPERTS_TABLE = [  # GroupedMLP: one tensor <-> the HF names of every expert in turn
    (_L + "mlp.experts.weight1", [_X + "{gate}.weight", _X + "{up}.weight"], "grouped_fc1"),
    (_L + "mlp.experts.weight2", [_X + "{down}.weight"], "grouped_fc2"),
]
HF_MOE_NAMES = {
    "mixtral": dict(moe="block_sparse_moe.", gate="w1", up="w3", down="w2"),
    "qwen3_moe": dict(moe="mlp.", gate="gate_proj", up="up_proj", down="down_proj"),
}
# Buffers some HF checkpoints carry that hold no weights.
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


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


TRANSFORMS = {  # name -> (HF tensors -> teratron tensor, teratron tensor -> HF tensors)
    None: (lambda ts, a: ts[0], lambda t, a: [t]),
    "qkv": (lambda ts, a: fuse_qkv(*ts, a), split_qkv),
    "gate_up": (lambda ts, a: torch.cat(ts), lambda t, a: list(t.chunk(2))),
    "vocab": (lambda ts, a: _pad_vocab(ts[0], a), lambda t, a: [t[:a["vocab_size"]]]),
    "grouped_fc1": (lambda ts, a: torch.stack([torch.cat(pair).t() for pair in zip(ts[0::2], ts[1::2])]),
                    lambda t, a: [half for w in t for half in w.t().chunk(2)]),
    "grouped_fc2": (lambda ts, a: torch.stack([w.t() for w in ts]), lambda t, a: [w.t() for w in t]),
}


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
    """Whether the model has the tensor: biases, q/k norms and the output layer follow the args."""
    if name.endswith("linear_qkv.bias"):
        return a["add_qkv_bias"] or a["add_bias_linear"]
    if name.endswith(".bias"):
        return a["add_bias_linear"]
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return a["qk_layernorm"]
    if name == "output_layer.weight":
        return a["untie_embeddings_and_output_weights"]
    return True


def _rows(a, family):
    """(teratron name, HF names, transform) of every tensor the model holds."""
    return (row for row in _all_rows(a, family) if _holds(row[0], a))


def _all_rows(a, family):
    yield from TABLE
    num_experts = moe_arg(a, "num_experts")
    moe = moe_layer_pattern(a["num_layers"], moe_arg(a, "moe_layer_freq")) if num_experts else []
    for i in range(a["num_layers"]):
        yield from _expand(LAYER_TABLE, i=i)
        if not (moe and moe[i]):
            yield from _expand(DENSE_MLP_TABLE, i=i)
            continue
        words = HF_MOE_NAMES[family]
        yield from _expand(ROUTER_TABLE, i=i, **words)
        if moe_arg(a, "moe_grouped_gemm"):
            yield from _expand(GROUPED_EXPERTS_TABLE, range(num_experts), i=i, **words)
        else:
            for e in range(num_experts):
                yield from _expand(EXPERT_TABLE, i=i, e=e, **words)


def check_hf_tensors(weights, expected: dict, a, source: str) -> None:
    """Refuse HF files whose tensors are not exactly the model's: one missing, one unknown, or one
    whose shape differs from `expected` (HF name -> shape, from the config). `weights` has the
    files' `shapes` and `files` (name -> shape / file name); nothing is read but the headers."""
    allowed = dict(expected)
    if not a["untie_embeddings_and_output_weights"]:  # a tied copy of the embedding, if saved
        allowed["lm_head.weight"] = expected["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(weights.shapes))
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


def hf_to_teratron(read, a, family: str) -> dict:
    """Global teratron state dict from the HF tensors of `family` (its model_type); `read(name)`
    loads one HF tensor. Check the files first (`check_hf_tensors`)."""
    return {name: TRANSFORMS[transform][0]([read(n) for n in names], a)
            for name, names, transform in _rows(a, family)}


def teratron_to_hf(state: dict, a, family: str) -> dict:
    """HF state dict of `family` from a global teratron state dict (every tensor of the model)."""
    out, left = {}, dict(state)
    for name, names, transform in _rows(a, family):
        if name not in left:
            raise ValueError(f"checkpoint tensor {name} is missing (the model args say the model has it); "
                             "the checkpoint is incomplete or its metadata.json does not match it")
        out.update(zip(names, TRANSFORMS[transform][1](left.pop(name), a)))
    if left:
        raise ValueError(f"checkpoint tensor {sorted(left)[0]} has no Hugging Face counterpart; "
                         "the model has parts the converter does not know")
    return {k: v.contiguous() for k, v in out.items()}
