"""Megatron Core's MambaLayer: a pre-norm residual block around a sequence mixer.

    out = x + dropout(mixer(norm(x)))            x, out [s, b, h] ([s/tp, b, h] under SP)

The mixer is the hybrid pattern's `M`: Mamba-2's (`MambaMixer`), or Gated Delta Product's
(`GatedDeltaProductMixer`, with gdp_layers); Megatron's names (`norm`, `mixer`) so its checkpoints map
one to one.
"""

from dataclasses import dataclass
from typing import Union

import torch

from teratron.topology import resolve_pg_collection
from teratron.transformer.identity_op import IdentityOp
from teratron.transformer.spec_utils import ModuleSpec, build_module
from teratron.transformer.transformer_layer import get_bias_dropout_add, residual_dropout_rng


@dataclass
class MambaLayerSubmodules:
    norm: Union[ModuleSpec, type] = IdentityOp
    mixer: Union[ModuleSpec, type] = IdentityOp
    mamba_bda: Union[ModuleSpec, type] = get_bias_dropout_add


class MambaLayer(torch.nn.Module):
    """[s, b, h] -> ([s, b, h], None); layer_number is 1-based and global."""

    def __init__(self, config, submodules: MambaLayerSubmodules, layer_number: int = 1, pg_collection=None,
                 vp_stage=None):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        pg_collection = resolve_pg_collection(pg_collection)
        self.norm = build_module(submodules.norm, config=config, hidden_size=config.hidden_size,
                                 eps=config.layernorm_epsilon)
        self.mixer = build_module(submodules.mixer, config=config, layer_number=layer_number,
                                  pg_collection=pg_collection)
        self.mamba_bda = build_module(submodules.mamba_bda)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        # the mixer reads attention_mask only for packed documents (a PackedSeqParams)
        mixed = self.mixer(self.norm(hidden_states), attention_mask=attention_mask, inference_context=inference_context)
        residual = hidden_states.float() if self.config.fp32_residual_connection else hidden_states
        with residual_dropout_rng(self.config, self.training):
            out = self.mamba_bda(self.training, self.config.bias_dropout_fusion)(mixed, residual,
                                                                                 self.config.hidden_dropout)
        return out, None
