"""The Hugging Face <-> teratron weight table and its few transforms.

Names on the teratron side are global (layer indices count every pipeline stage, as in a
checkpoint). A row maps one teratron tensor to one or more HF tensors through a named transform:

    qkv      q, k, v projections <-> Megatron's fused QKV, interleaved per query group as
             [ng, (np/ng + 2) * hn, h]: each group's query heads, then its key and value head
    gate_up  gate_proj, up_proj <-> linear_fc1 = [gate; up] (SwiGLU)
    vocab    the HF vocabulary <-> teratron's padded one (padding rows are zero)

No RoPE permutation: HF Llama-style checkpoints and teratron both rotate halves (i, i + d/2).
"""

import re

import torch

_L, _H = "decoder.layers.{}.", "model.layers.{}."
TABLE = [
    ("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], "vocab"),
    ("decoder.final_layernorm.weight", ["model.norm.weight"], None),
    ("output_layer.weight", ["lm_head.weight"], "vocab"),
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
    (_L + "mlp.linear_fc1.weight", [_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"], "gate_up"),
    (_L + "mlp.linear_fc1.bias", [_H + "mlp.gate_proj.bias", _H + "mlp.up_proj.bias"], "gate_up"),
    (_L + "mlp.linear_fc2.weight", [_H + "mlp.down_proj.weight"], None),
    (_L + "mlp.linear_fc2.bias", [_H + "mlp.down_proj.bias"], None),
]
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
    if t.shape[0] != a["vocab_size"]:
        raise ValueError(f"a vocabulary tensor has {t.shape[0]} rows but config.json says vocab_size="
                         f"{a['vocab_size']}; the files and config disagree")
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if padded > t.shape[0] else t


TRANSFORMS = {  # name -> (HF tensors -> teratron tensor, teratron tensor -> HF tensors)
    None: (lambda ts, a: ts[0], lambda t, a: [t]),
    "qkv": (lambda ts, a: fuse_qkv(*ts, a), split_qkv),
    "gate_up": (lambda ts, a: torch.cat(ts), lambda t, a: list(t.chunk(2))),
    "vocab": (lambda ts, a: _pad_vocab(ts[0], a), lambda t, a: [t[:a["vocab_size"]]]),
}


def _rows(a):
    """(teratron name, HF names, transform) of every tensor the model may hold."""
    for name, hf_names, transform in TABLE:
        layers = range(a["num_layers"]) if "{}" in name else [None]
        for i in layers:
            yield name.format(i), [n.format(i) for n in hf_names], transform


def hf_to_teratron(hf_names, read, a, source: str) -> dict:
    """Global teratron state dict from HF tensors; `read(name)` loads one HF tensor."""
    tied = not a["untie_embeddings_and_output_weights"]
    hf_names, out, used = set(hf_names), {}, set()
    for name, names, transform in _rows(a):
        present = [n for n in names if n in hf_names]
        if not present or (tied and name == "output_layer.weight"):
            used.update(present)
            continue
        if len(present) != len(names):
            missing = sorted(set(names) - set(present))
            raise ValueError(f"{source}: {missing[0]} is missing (needed with {present[0]}); the files are incomplete")
        out[name] = TRANSFORMS[transform][0]([read(n) for n in names], a)
        used.update(names)
    unknown = sorted(n for n in hf_names - used if not _IGNORED_HF.match(n))
    if unknown:
        raise ValueError(f"{source}: {len(unknown)} tensors have no teratron counterpart, e.g. {unknown[0]}; "
                         "the model has parts this converter does not know")
    return out


def teratron_to_hf(state: dict, a) -> dict:
    """HF state dict from a global teratron state dict (every tensor of the model)."""
    out, left = {}, dict(state)
    for name, names, transform in _rows(a):
        if name in left:
            out.update(zip(names, TRANSFORMS[transform][1](left.pop(name), a)))
    if left:
        raise ValueError(f"checkpoint tensor {sorted(left)[0]} has no Hugging Face counterpart; "
                         "the model has parts the converter does not know")
    return {k: v.contiguous() for k, v in out.items()}
