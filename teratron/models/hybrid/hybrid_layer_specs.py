"""The layer specs of a hybrid model, one per symbol of `config.hybrid_layer_pattern`.

Attention (`*`, `+` multi-latent), MLP and MoE layers are GPT's local layer with the other half left
out (an IdentityOp submodule: `TransformerLayer` skips it); Gated DeltaNet takes the attention's place in that layer
(Megatron's `gdn_layer`); Mamba layers are Megatron's `MambaLayer` (norm + mixer: Mamba-2's, or Gated
Delta Product's with `config.gdp_layers`, Megatron's `gdp_stack_spec`). Norms follow
`config.normalization` unless `normalization` fixes them, as GPT's specs do.
"""

import dataclasses

from teratron.models.gpt.gpt_layer_specs import _norm_class, get_gpt_layer_local_spec
from teratron.pipeline_parallel.layout import get_num_layers_to_build, get_transformer_layer_offset
from teratron.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern
from teratron.models.hybrid.hybrid_stack import HybridStack
from teratron.models.hybrid.mamba_layer import MambaLayer, MambaLayerSubmodules
from teratron.ssm.gated_delta_product import GatedDeltaProductMixer
from teratron.ssm.mamba_mixer import MambaMixer
from teratron.transformer.identity_op import IdentityOp
from teratron.transformer.spec_utils import ModuleSpec
from teratron.transformer.transformer_block import TransformerBlockSubmodules
from teratron.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def _without(spec: ModuleSpec, *names) -> ModuleSpec:
    """`spec` with the named submodules switched off."""
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                    **{name: IdentityOp for name in names}))


def _attention_layer(config, normalization):
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=normalization)
    return _without(spec, "pre_mlp_layernorm", "mlp")


def _mla_layer(config, normalization):
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, multi_latent_attention=True,
                                    normalization=normalization)
    return _without(spec, "pre_mlp_layernorm", "mlp")


def _mlp_layer(config, normalization):
    return _without(get_gpt_layer_local_spec(normalization=normalization), "input_layernorm", "self_attention")


def _moe_layer(config, normalization):
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                    normalization=normalization)
    return _without(spec, "input_layernorm", "self_attention")


def _mamba_layer(config, normalization):
    mixer = GatedDeltaProductMixer if config.gdp_layers else MambaMixer
    return ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(norm=_norm_class(normalization),
                                                                         mixer=mixer))


def _gated_delta_net_layer(config, normalization):
    from teratron.ssm.gated_delta_net import GatedDeltaNet

    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=_norm_class(normalization), self_attention=GatedDeltaNet))


_LAYER_SPECS = {Symbols.ATTENTION: _attention_layer, Symbols.MLA: _mla_layer, Symbols.MLP: _mlp_layer,
                Symbols.MOE: _moe_layer, Symbols.MAMBA: _mamba_layer, Symbols.GDN: _gated_delta_net_layer}


def _specs(symbols: str, config, normalization) -> list:
    built = {symbol: _LAYER_SPECS[symbol](config, normalization) for symbol in set(symbols)}
    return [built[symbol] for symbol in symbols]


def hybrid_layer_specs(config, normalization=None) -> list:
    """The spec of every decoder layer of the hybrid model, in the pattern's order."""
    return _specs(parse_hybrid_pattern(config.hybrid_layer_pattern).layers, config, normalization)


def hybrid_mtp_layer_spec(config, normalization=None):
    """What each multi-token-prediction depth runs: the layers after '/' (None without them)."""
    mtp_layers = parse_hybrid_pattern(config.hybrid_layer_pattern).mtp_layers
    if not mtp_layers:
        return None
    return ModuleSpec(module=HybridStack, params={"layer_specs": _specs(mtp_layers, config, normalization)})


def get_hybrid_decoder_block_spec(config, normalization=None, vp_stage=None, pp_rank=None,
                                  pp_size=None) -> TransformerBlockSubmodules:
    """This (virtual) pipeline stage's layer specs and the final norm: GPT's
    `get_gpt_decoder_block_spec` for a hybrid config."""
    placement = dict(vp_stage=vp_stage, pp_rank=pp_rank, pp_size=pp_size)
    offset = get_transformer_layer_offset(config, **placement)
    specs = hybrid_layer_specs(config, normalization)
    local = specs[offset:offset + get_num_layers_to_build(config, **placement)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=_norm_class(normalization))
