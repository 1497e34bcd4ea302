"""Layer specs for GPT: which modules a transformer layer is built from (Megatron's local spec)."""

from teratron.pipeline_parallel.layout import (get_mtp_num_layers_to_build, get_num_layers_to_build,
                                               get_transformer_layer_offset)
from teratron.tensor_parallel import ColumnParallelLinear, DuplicatedLinear, RowParallelLinear
from teratron.transformer.attention import SelfAttention, SelfAttentionSubmodules
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.enums import AttnMaskType
from teratron.transformer.identity_op import IdentityOp
from teratron.transformer.mlp import MLP, MLPSubmodules
from teratron.transformer.moe import get_moe_module_spec, moe_layer_pattern
from teratron.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from teratron.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules, get_mtp_layer_spec
from teratron.transformer.norms import NORMALIZATIONS, LayerNorm, Norm, RMSNorm
from teratron.transformer.spec_utils import ModuleSpec
from teratron.transformer.transformer_block import TransformerBlockSubmodules
from teratron.transformer.transformer_layer import (TransformerLayer, TransformerLayerSubmodules,
                                                    get_bias_dropout_add)


def _norm_class(normalization):
    """None follows `config.normalization` at build time; a name fixes the norm in the spec."""
    if normalization is None:
        return Norm
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}; use one of {NORMALIZATIONS} or None")
    return LayerNorm if normalization == "LayerNorm" else RMSNorm


def get_mlp_module_spec(num_experts=None, moe_grouped_gemm=False) -> ModuleSpec:
    """The dense MLP, or with num_experts the MoE layer."""
    if num_experts is not None:
        return get_moe_module_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm)
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear))


def get_mla_module_spec(qk_layernorm=False, normalization=None) -> ModuleSpec:
    """Multi-latent attention: replicated down projections, column-parallel up projections, the
    latent norms with qk_layernorm (as in Megatron)."""
    latent_norm = _norm_class(normalization) if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=DuplicatedLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=DuplicatedLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=latent_norm,
            kv_layernorm=latent_norm,
        ),
    )


def get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                             multi_latent_attention=False, normalization=None) -> ModuleSpec:
    """A pre-norm layer of our own modules: self-attention (causal; multi-latent with
    multi_latent_attention) and an MLP (MoE with num_experts)."""
    norm = _norm_class(normalization)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=get_mla_module_spec(qk_layernorm, normalization) if multi_latent_attention else ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=norm if qk_layernorm else IdentityOp,
                    k_layernorm=norm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=get_mlp_module_spec(num_experts, moe_grouped_gemm),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _layer_specs(config, normalization) -> list:
    """The spec of every decoder layer of the model: MoE layers where `config.moe_layer_freq` puts
    them (with `num_moe_experts`), dense ones elsewhere; multi-latent attention with
    `multi_latent_attention`."""
    if config.hybrid_layer_pattern is not None:
        raise ValueError("a hybrid model's config (hybrid_layer_pattern): its layer specs come from "
                         "models.hybrid.get_hybrid_decoder_block_spec (build_gpt_model picks it)")
    attention = dict(qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention)
    dense = get_gpt_layer_local_spec(**attention, normalization=normalization)
    if config.num_moe_experts is None:
        return [dense] * config.num_layers
    moe = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                   **attention, normalization=normalization)
    return [moe if is_moe else dense for is_moe in moe_layer_pattern(config.num_layers, config.moe_layer_freq)]


def get_gpt_decoder_block_spec(config, use_transformer_engine: bool = False, normalization=None,
                               vp_stage=None, pp_rank=None, pp_size=None) -> TransformerBlockSubmodules:
    """This stage's layer specs (`_layer_specs`). `use_transformer_engine` is accepted for
    Megatron's signature; both kinds are our own layers."""
    placement = dict(vp_stage=vp_stage, pp_rank=pp_rank, pp_size=pp_size)
    offset = get_transformer_layer_offset(config, **placement)
    local = range(offset, offset + get_num_layers_to_build(config, **placement))
    specs = _layer_specs(config, normalization)
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in local], layer_norm=_norm_class(normalization))


def get_gpt_mtp_block_spec(config, spec=None, use_transformer_engine: bool = False, normalization=None,
                           vp_stage=None, pp_rank=None, pp_size=None):
    """The multi-token-prediction block of this stage, or None where it holds no MTP layer (all
    of them sit on the last stage). Each depth wraps `spec` (default: the model's last decoder
    layer's, as Megatron's GPT builder passes)."""
    depths = get_mtp_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank, pp_size=pp_size)
    if depths == 0:
        return None
    layer = spec if spec is not None else _layer_specs(config, normalization)[-1]
    return MultiTokenPredictionBlockSubmodules(
        layer_specs=[get_mtp_layer_spec(layer, _norm_class(normalization))] * depths)


# No Transformer Engine: the "TE" spec is the local one, so Megatron scripts that ask for it run.
get_gpt_layer_with_transformer_engine_spec = get_gpt_layer_local_spec
