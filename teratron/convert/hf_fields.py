"""config.json fields every family reads alike: the required ones, per-layer sliding windows, and
RoPE with YaRN or Llama 3's scaling.

Per-layer windows (gpt-oss, Qwen2-MoE): `layer_types` marks each layer "sliding_attention" or
"full_attention"; a sliding layer's query sees itself and the `sliding_window` - 1 tokens before
it (transformers' mask), teratron's window_size (W - 1, 0), with window_attn_skip_freq the 0/1
list (1 = windowed) when not every layer is.

transformers 5 writes `rope_parameters` (rope_type, rope_theta, and YaRN's factor,
original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, truncate);
transformers 4 and the Hub's configs `rope_theta` and `rope_scaling`. Both read the same.

Llama 3.x's scaling (rope_type llama3: factor, low_freq_factor, high_freq_factor,
original_max_position_embeddings) is teratron's `--use-rope-scaling` with the config's values
(Megatron's fixed 1, 4 and 8192 where the config lacks the two factors; the original length, as
transformers reads it, from the config's top-level original_max_position_embeddings, else
max_position_embeddings).

YaRN's concentration factor in transformers is mscale(s, mscale) / mscale(s, mscale_all_dim)
when both are non-zero, else mscale(s, 1) (mscale ignored): Megatron's mscale 1 with
mscale_all_dim 0. `truncate` False keeps the ramp's bounds fractional
(yarn_correction_range_round_to_int False). Other RoPE types, partial rotation and an explicit
attention_factor are refused.
"""

from teratron.dist_checkpointing.model_args import ROPE_SCALING_ARGS, YARN_ARGS
from teratron.transformer.dot_product_attention import is_layer_window_attention

ROPE_THETA_DEFAULT = 10000.0
SLIDING, FULL = "sliding_attention", "full_attention"


def require_fields(hf: dict, source: str, names) -> None:
    """Refuse a config.json that lacks one of the fields the conversion reads."""
    missing = [name for name in names if hf.get(name) is None]
    if missing:
        raise ValueError(f"{source}: config.json lacks {', '.join(missing)}; it is not a complete "
                         f"{hf.get('model_type')} config")


def layer_window_args(types: list, window, layers: int, source: str) -> dict:
    """window_size and window_attn_skip_freq of per-layer `types` with window `window` ({} when
    no layer is windowed)."""
    if len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"{source}: layer_types must give {layers} entries of {SLIDING!r} or {FULL!r}, got {types}")
    pattern = [int(t == SLIDING) for t in types]
    if not any(pattern):
        return {}
    if not window or window < 1:
        raise ValueError(f"{source}: layer_types has sliding layers but sliding_window={window}; give the window's "
                         "size in tokens")
    return {"window_size": [window - 1, 0], "window_attn_skip_freq": None if all(pattern) else pattern}


def layer_types(a: dict) -> list:
    """`layer_window_args`' inverse: the layer_types of the model's windows (causal, (W - 1, 0))."""
    window, skip = a.get("window_size"), a.get("window_attn_skip_freq")
    return [SLIDING if window is not None and is_layer_window_attention(window, skip, n) else FULL
            for n in range(1, a["num_layers"] + 1)]


def _rope_fields(hf: dict) -> dict:
    """rope_parameters (transformers 5) updated by rope_scaling and rope_theta (transformers 4)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params.update({"rope_type" if key == "type" else key: value for key, value in scaling.items()})
    if hf.get("rope_theta") is not None:
        params["rope_theta"] = hf["rope_theta"]
    return params


def rope_args_from_hf(hf: dict, source: str, default_theta: float = ROPE_THETA_DEFAULT, yarn: bool = False,
                      llama3: bool = False) -> dict:
    """{"rotary_base"} and, with `yarn` allowed and a YaRN config, {"rope_type": "yarn"} plus the
    YaRN args under their flag names (model_args.YARN_ARGS); with `llama3` allowed and a Llama 3
    config, {"rope_type": "llama3"} plus the scaling's (model_args.ROPE_SCALING_ARGS); else
    {"rope_type": "rope"}."""
    params = _rope_fields(hf)
    rope_type = params.get("rope_type") or "default"
    base = float(params.get("rope_theta", default_theta))
    allowed = ["default"] + ["yarn"] * yarn + ["llama3"] * llama3
    if rope_type not in allowed:
        raise ValueError(f"{source}: rope type {rope_type!r} (rope_scaling) is not supported by teratron's "
                         f"RoPE for {hf.get('model_type')}; only {' and '.join(allowed)} rotary embeddings convert")
    if rope_type == "default":
        return {"rotary_base": base, "rope_type": "rope"}
    if rope_type == "llama3":
        return {"rotary_base": base, "rope_type": "llama3", **_llama3_args(hf, params, source)}
    if params.get("partial_rotary_factor", 1.0) != 1.0 or params.get("attention_factor") is not None:
        name = "partial_rotary_factor" if params.get("partial_rotary_factor", 1.0) != 1.0 else "attention_factor"
        raise ValueError(f"{source}: YaRN with {name}={params[name]} does not convert; teratron's YaRN rotates "
                         "every channel and derives its attention factor from mscale and mscale_all_dim")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"{source}: rope_scaling of type yarn lacks original_max_position_embeddings; it is not a "
                         "complete YaRN config")
    factor = params.get("factor") or hf.get("max_position_embeddings", 4096) / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise ValueError(f"{source}: YaRN mscale_all_dim={mscale_all_dim} without mscale: transformers then ignores "
                         "it for the rotation but not for DeepSeek's softmax, which teratron cannot express")
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    return {"rotary_base": base, "rope_type": "yarn", "rotary_scaling_factor": float(factor),
            "mscale": float(mscale), "mscale_all_dim": float(mscale_all_dim),
            "yarn_original_max_position_embeddings": int(original),
            "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
            "yarn_correction_range_round_to_int": bool(params.get("truncate", True))}


def _llama3_args(hf: dict, params: dict, source: str) -> dict:
    if params.get("factor") is None:
        raise ValueError(f"{source}: rope_scaling of type llama3 lacks factor; it is not a complete Llama 3 config")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: Llama 3 RoPE scaling with partial_rotary_factor={params['partial_rotary_factor']} "
                         "does not convert; only full rotation does")
    original = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") \
        or hf.get("max_position_embeddings")
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    if not high > low > 0 or params["factor"] <= 0 or not original:
        raise ValueError(f"{source}: Llama 3 RoPE scaling with factor={params['factor']}, low_freq_factor={low}, "
                         f"high_freq_factor={high}, original_max_position_embeddings={original}; it needs "
                         "high_freq_factor > low_freq_factor > 0 and a positive factor and original length")
    return dict(zip(ROPE_SCALING_ARGS, (float(params["factor"]), low, high, int(original))))


def hf_rope_parameters(rope: dict) -> dict:
    """transformers 5's rope_parameters of `rope` (as `rope_args_from_hf` returns it)."""
    if rope["rope_type"] == "llama3":
        return {"rope_type": "llama3", "rope_theta": rope["rotary_base"],
                **dict(zip(("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                           (rope[arg] for arg in ROPE_SCALING_ARGS)))}
    if rope["rope_type"] != "yarn":
        return {"rope_type": "default", "rope_theta": rope["rotary_base"]}
    mscale, mscale_all_dim = rope["mscale"], rope["mscale_all_dim"]
    if (mscale, mscale_all_dim) != (1.0, 0.0) and not (mscale and mscale_all_dim):
        raise ValueError(f"the checkpoint's YaRN has mscale={mscale} with mscale_all_dim={mscale_all_dim}; "
                         "transformers uses mscale only with a non-zero mscale_all_dim, so it has no Hugging Face "
                         "counterpart")
    params = {"rope_type": "yarn", "rope_theta": rope["rotary_base"], "factor": rope["rotary_scaling_factor"],
              "original_max_position_embeddings": rope["yarn_original_max_position_embeddings"],
              "beta_fast": rope["yarn_beta_fast"], "beta_slow": rope["yarn_beta_slow"]}
    if mscale_all_dim:
        params.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    if not rope["yarn_correction_range_round_to_int"]:
        params["truncate"] = False
    return params


def rope_of_model_args(a: dict) -> dict:
    """The RoPE of a model, as `rope_args_from_hf` gives it: plain attention's YaRN
    (position_embedding_type 'yarn') or MLA's (rope_type 'yarn', ramp bounds always rounded), or
    Llama 3's scaling (use_rope_scaling)."""
    if a.get("use_rope_scaling"):
        return {"rotary_base": float(a["rotary_base"]), "rope_type": "llama3",
                **{name: a[name] for name in ROPE_SCALING_ARGS}}
    yarn = a["position_embedding_type"] == "yarn" or (a.get("multi_latent_attention") and a["rope_type"] == "yarn")
    if not yarn:
        return {"rotary_base": float(a["rotary_base"]), "rope_type": "rope"}
    return {"rotary_base": float(a["rotary_base"]), "rope_type": "yarn",
            **{name: a.get(name, True) for name in YARN_ARGS}}


_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")


def set_rope_fields(hf: dict, rope: dict, base: dict) -> None:
    """Write `rope` into the exported config `hf`: the imported config's own fields when they
    still describe it, else transformers 5's rope_parameters."""
    for key in _ROPE_KEYS:
        hf.pop(key, None)
    try:
        unchanged = bool(base) and rope_args_from_hf(base, "", yarn=True, llama3=True) == rope
    except (ValueError, KeyError, TypeError):
        unchanged = False
    if unchanged:
        hf.update({key: base[key] for key in _ROPE_KEYS if key in base})
    else:
        hf["rope_parameters"] = hf_rope_parameters(rope)
