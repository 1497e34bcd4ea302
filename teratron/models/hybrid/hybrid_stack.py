"""A multi-token-prediction depth's layers in a hybrid model (the pattern after '/'): run in order,
in the place a GPT MTP depth runs its one TransformerLayer (Megatron's hybrid `mtp_model_layer`).

    "M*M*/M-/M-": two depths, each a HybridStack of an M layer and a - layer.

Layer numbers continue past the decoder's: depth d's i-th layer is num_layers + (d - 1) k + i
(1-based, k layers a depth), so with k = 1 they are GPT's MTP layer numbers.
"""

import torch

from teratron.models.hybrid.hybrid_layer_allocation import mtp_depth_layer_numbers
from teratron.transformer.spec_utils import build_module


class HybridStack(torch.nn.Module):
    """[s, b, h] -> ([s, b, h], None), through `layer_specs` in order."""

    def __init__(self, config, layer_specs: list, layer_number: int, pg_collection=None, vp_stage=None):
        super().__init__()
        numbers = mtp_depth_layer_numbers(config.num_layers, len(layer_specs), layer_number - config.num_layers)
        self.layers = torch.nn.ModuleList(
            build_module(spec, config=config, layer_number=number, pg_collection=pg_collection, vp_stage=vp_stage)
            for number, spec in zip(numbers, layer_specs))

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        for layer in self.layers:
            hidden_states, _ = layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                     inference_context=inference_context)
        return hidden_states, None
