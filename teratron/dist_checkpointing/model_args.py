"""What model a checkpoint holds: a small JSON-able dict of `teratron train` flag values.

Every checkpoint records it (metadata.json), so a checkpoint can be rebuilt, exported to Hugging
Face and checked against another one without the run's full argument list. The keys are the
training flags' dest names (Megatron's), so `model_args_from_args(args)` is a lookup.

Only what shapes the model's weights or forward math is recorded; training-only MoE settings
(load balancing, aux-loss coefficients, capacity, dispatcher) are not, so a fine-tune may change
them. MoE keys default to Megatron's values (`MOE_DEFAULTS`) when a run or an older checkpoint
lacks them.
"""

import torch
import torch.nn.functional as F

# The MoE architecture and its meaning when absent: a dense model (num_experts None).
MOE_DEFAULTS = {
    "num_experts": None, "moe_ffn_hidden_size": None, "moe_router_topk": None, "moe_grouped_gemm": False,
    "moe_shared_expert_intermediate_size": None, "moe_layer_freq": 1, "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False,
}

MODEL_ARG_NAMES = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "norm_epsilon", "swiglu", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "position_embedding_type", "rotary_base", "rotary_percent", "rotary_interleaved",
    "untie_embeddings_and_output_weights", "max_position_embeddings", "vocab_size", "padded_vocab_size",
    *MOE_DEFAULTS,
)


def model_args_from_args(args) -> dict:
    """The model section of a training run's args (query groups resolved, true vocab recorded)."""
    out = {name: getattr(args, name, None) for name in MODEL_ARG_NAMES if name not in MOE_DEFAULTS}
    if not getattr(args, "group_query_attention", False):
        out["num_query_groups"] = args.num_attention_heads
    if getattr(args, "num_experts", None):
        out.update({name: getattr(args, name, default) for name, default in MOE_DEFAULTS.items()})
        out["moe_layer_freq"] = canonical_moe_layer_freq(args.num_layers, out["moe_layer_freq"])
    else:  # MoE flags mean nothing to a dense model
        out.update(MOE_DEFAULTS)
    if out["vocab_size"] is None:
        out["vocab_size"] = out["padded_vocab_size"]
    return out


def canonical_moe_layer_freq(num_layers: int, moe_layer_freq):
    """1 when every layer is MoE, else the 0/1 list: one record per layer pattern, so a run's
    `--moe-layer-freq 2` and an import's [1, 0, 1, 0] are the same model."""
    from teratron.transformer.moe import moe_layer_pattern

    pattern = moe_layer_pattern(num_layers, moe_layer_freq)
    return 1 if all(pattern) else pattern


def moe_arg(model_args: dict, name: str):
    """An MoE model arg, Megatron's default when the dict predates it."""
    return model_args.get(name, MOE_DEFAULTS[name])


def transformer_config(model_args: dict, **overrides):
    """TransformerConfig of the model (dropout off, fp32 unless overridden)."""
    from teratron.transformer.transformer_config import TransformerConfig

    a = model_args
    kwargs = dict(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], ffn_hidden_size=a["ffn_hidden_size"],
        num_attention_heads=a["num_attention_heads"], num_query_groups=a["num_query_groups"],
        kv_channels=a["kv_channels"], normalization=a["normalization"], layernorm_epsilon=a["norm_epsilon"],
        gated_linear_unit=a["swiglu"], activation_func=F.silu if a["swiglu"] else F.gelu,
        add_bias_linear=a["add_bias_linear"], add_qkv_bias=a["add_qkv_bias"], qk_layernorm=a["qk_layernorm"],
        rotary_interleaved=a["rotary_interleaved"], hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32,
    )
    if a.get("num_experts"):
        kwargs.update({name: moe_arg(a, name) for name in MOE_DEFAULTS if name != "num_experts"},
                      num_moe_experts=a["num_experts"])
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(model_args: dict, config, pre_process=True, post_process=True, vp_stage=None,
                    pg_collection=None, padded_vocab_size=None):
    """A GPTModel (one stage) with the recorded architecture under `config`'s layout; MoE
    layers where `moe_layer_freq` puts them."""
    from teratron.models.gpt import GPTModel, get_gpt_decoder_block_spec
    from teratron.process_groups import get_pg_rank, get_pg_size
    from teratron.topology import resolve_pg_collection

    a = model_args
    pg = resolve_pg_collection(pg_collection)
    spec = get_gpt_decoder_block_spec(config, normalization=a["normalization"], vp_stage=vp_stage,
                                      pp_rank=get_pg_rank(pg.pp), pp_size=get_pg_size(pg.pp))
    return GPTModel(
        config, spec, vocab_size=padded_vocab_size or a["padded_vocab_size"],
        max_sequence_length=a["max_position_embeddings"], pre_process=pre_process,
        post_process=post_process, share_embeddings_and_output_weights=not a["untie_embeddings_and_output_weights"],
        position_embedding_type=a["position_embedding_type"], rotary_percent=a["rotary_percent"],
        rotary_base=a["rotary_base"], pg_collection=pg, vp_stage=vp_stage,
        unpadded_vocab_size=a["vocab_size"],
    )
