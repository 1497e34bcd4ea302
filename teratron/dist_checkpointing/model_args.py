"""What model a checkpoint holds: a small JSON-able dict of `teratron train` flag values.

Every checkpoint records it (metadata.json), so a checkpoint can be rebuilt, exported to Hugging
Face and checked against another one without the run's full argument list. The keys are the
training flags' dest names (Megatron's), so `model_args_from_args(args)` is a lookup.
"""

import torch
import torch.nn.functional as F

MODEL_ARG_NAMES = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "norm_epsilon", "swiglu", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "position_embedding_type", "rotary_base", "rotary_percent", "rotary_interleaved",
    "untie_embeddings_and_output_weights", "max_position_embeddings", "vocab_size", "padded_vocab_size",
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_grouped_gemm",
)


def model_args_from_args(args) -> dict:
    """The model section of a training run's args (query groups resolved, true vocab recorded)."""
    out = {name: getattr(args, name, None) for name in MODEL_ARG_NAMES}
    if not getattr(args, "group_query_attention", False):
        out["num_query_groups"] = args.num_attention_heads
    if not out["num_experts"]:  # MoE flags mean nothing to a dense model
        out.update(num_experts=None, moe_ffn_hidden_size=None, moe_router_topk=None, moe_grouped_gemm=False)
    if out["vocab_size"] is None:
        out["vocab_size"] = out["padded_vocab_size"]
    return out


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
        kwargs.update(num_moe_experts=a["num_experts"], moe_ffn_hidden_size=a["moe_ffn_hidden_size"],
                      moe_router_topk=a["moe_router_topk"])
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(model_args: dict, config, pre_process=True, post_process=True, vp_stage=None,
                    pg_collection=None, padded_vocab_size=None):
    """A GPTModel (one stage) with the recorded architecture under `config`'s layout."""
    from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec

    a = model_args
    spec = get_gpt_layer_local_spec(num_experts=a.get("num_experts"), moe_grouped_gemm=bool(a.get("moe_grouped_gemm")),
                                    qk_layernorm=a["qk_layernorm"], normalization=a["normalization"])
    return GPTModel(
        config, spec, vocab_size=padded_vocab_size or a["padded_vocab_size"],
        max_sequence_length=a["max_position_embeddings"], pre_process=pre_process,
        post_process=post_process, share_embeddings_and_output_weights=not a["untie_embeddings_and_output_weights"],
        position_embedding_type=a["position_embedding_type"], rotary_percent=a["rotary_percent"],
        rotary_base=a["rotary_base"], pg_collection=pg_collection, vp_stage=vp_stage,
        unpadded_vocab_size=a["vocab_size"],
    )
