"""GPT-2's config.json <-> teratron model args.

GPT-2 (model_type gpt2, GPT2LMHeadModel) is Megatron's GPT defaults: learned absolute positions
(position_embedding_type 'learned_absolute'), LayerNorm with biases, a GeLU MLP of n_inner
(4 h when null), biases on every linear layer, one key/value head per query head, tied
embeddings unless tie_word_embeddings is false. The GeLU is GPT-2's tanh approximation
(transformers' "gelu_new" or "gelu_pytorch_tanh": teratron's --openai-gelu, recorded as openai_gelu)
or the exact one ("gelu", F.gelu); exports write "gelu_new" or "gelu". The Hub's GPT-2 files
name the tensors without GPT2LMHeadModel's "transformer." prefix (GPT2Model's names, no
lm_head): `lm_head_model_names` adds it. Attention scores are scaled by
1 / sqrt(head_dim) in both; GPT-2's per-layer scaling (scale_attn_by_inverse_layer_idx),
unscaled scores and cross-attention are refused.
"""

from teratron.convert.hf_fields import require_fields
from teratron.dist_checkpointing.model_args import MOE_DEFAULTS, VARIANT_DEFAULTS

FAMILY = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
# transformers' activation_function -> openai_gelu (teratron's tanh GeLU); exports write the first of each.
GELUS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}
HF_GELU = {True: "gelu_new", False: "gelu"}
LM_HEAD_PREFIX = "transformer."  # GPT2LMHeadModel's prefix of GPT2Model's tensor names
ROTARY_BASE_DEFAULT = 10000  # unused by learned positions; Megatron's default, as a training run records it


def _check_supported(hf: dict, source: str) -> None:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GELUS:
        raise ValueError(f"{source}: activation_function={activation!r}; teratron's MLP computes the exact GeLU "
                         f"or its tanh approximation, so only {', '.join(map(repr, GELUS))} convert")
    for name, supported in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                            ("add_cross_attention", False)):
        if bool(hf.get(name, supported)) != supported:
            raise ValueError(f"{source}: {name}={hf[name]}; teratron's attention scales scores by "
                             "1 / sqrt(head_dim) in every layer and has no cross-attention, so only "
                             f"{name}={str(supported).lower()} converts")
    if hf["n_embd"] % hf["n_head"]:
        raise ValueError(f"{source}: n_embd={hf['n_embd']} is not a multiple of n_head={hf['n_head']}; "
                         "it is not a valid GPT-2 config")


def gpt2_args(hf: dict, source: str) -> dict:
    """The model args of a gpt2 config (all but padded_vocab_size)."""
    require_fields(hf, source, ["n_layer", "n_embd", "n_head", "n_positions", "vocab_size"])
    _check_supported(hf, source)
    hidden, heads = hf["n_embd"], hf["n_head"]
    return {
        "num_layers": hf["n_layer"], "hidden_size": hidden, "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
        "num_attention_heads": heads, "num_query_groups": heads, "kv_channels": hidden // heads,
        "normalization": "LayerNorm", "norm_epsilon": hf.get("layer_norm_epsilon", 1e-5), "swiglu": False,
        "openai_gelu": GELUS[hf.get("activation_function", "gelu_new")],
        "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
        "position_embedding_type": "learned_absolute", "rotary_base": ROTARY_BASE_DEFAULT, "rotary_percent": 1.0,
        "rotary_interleaved": False, "use_rope_scaling": False,
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", True),
        "max_position_embeddings": hf["n_positions"], "vocab_size": hf["vocab_size"], **MOE_DEFAULTS,
    }


# model arg -> the value GPT-2's shape needs (absent args take it).
_GPT2_SHAPE = {"normalization": "LayerNorm", "swiglu": False, "quick_geglu": False, "squared_relu": False,
               "add_bias_linear": True,
               "qk_layernorm": False, "num_experts": None, "multi_latent_attention": False, "mtp_num_layers": None,
               **VARIANT_DEFAULTS}


def _check_gpt2_shaped(a: dict) -> None:
    wrong = [f"{name}={a[name]}" for name, needed in _GPT2_SHAPE.items() if a.get(name, needed) != needed]
    if a["num_query_groups"] != a["num_attention_heads"]:
        wrong.append(f"num_query_groups={a['num_query_groups']} (heads {a['num_attention_heads']})")
    if a["kv_channels"] * a["num_attention_heads"] != a["hidden_size"]:
        wrong.append(f"kv_channels={a['kv_channels']} (hidden size {a['hidden_size']})")
    if wrong:
        raise ValueError(f"the checkpoint's model has learned absolute positions, as Hugging Face's GPT-2, but "
                         f"{', '.join(wrong)}; GPT-2 has LayerNorm, a GeLU MLP, biases on every linear layer and "
                         "one key/value head per query head of hidden/heads channels, so the model has no Hugging "
                         "Face counterpart")


def gpt2_hf_config(a: dict, base: dict | None) -> dict:
    """The GPT-2 config.json of a model with learned absolute positions; `base` (an imported
    GPT-2's config) keeps its other fields."""
    _check_gpt2_shaped(a)
    hf = dict(base or {})
    hf.update({
        "model_type": FAMILY, "architectures": [ARCHITECTURE], "n_layer": a["num_layers"],
        "n_embd": a["hidden_size"], "n_head": a["num_attention_heads"], "n_inner": a["ffn_hidden_size"],
        "n_positions": a["max_position_embeddings"], "vocab_size": a["vocab_size"],
        "activation_function": HF_GELU[bool(a.get("openai_gelu"))], "layer_norm_epsilon": a["norm_epsilon"],
        "tie_word_embeddings": not a["untie_embeddings_and_output_weights"], "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
    })
    return hf


def lm_head_model_names(stored: list) -> dict:
    """Stored tensor name -> GPT2LMHeadModel's, for files saved from GPT2Model (the Hub's GPT-2:
    `h.0.attn.c_attn.weight`, `wte.weight`); empty when any name has the prefix already, so
    files mixing the two spellings still fail the header check."""
    if any(name.startswith(LM_HEAD_PREFIX) for name in stored):
        return {}
    return {name: LM_HEAD_PREFIX + name for name in stored if name != "lm_head.weight"}
