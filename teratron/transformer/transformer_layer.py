"""The pre-norm transformer layer:

    h   = x + dropout(attention(norm1(x)))
    out = h + dropout(mlp(norm2(h)))

(`apply_residual_connection_post_layernorm` adds to the normed input instead, BERT's order.)
Which attention, MLP and norms were decided by the spec when the layer was built. A spec that
leaves the attention (or the MLP) an IdentityOp gets a layer without that half: the hybrid
model's attention-only (`*`), MLP-only (`-`, `E`) and Gated DeltaNet (`G`, in the attention's
place) layers.
"""

import contextlib
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

from teratron import fusions, tensor_parallel
from teratron.topology import resolve_pg_collection
from teratron.transformer import activation_offload
from teratron.transformer.identity_op import IdentityOp
from teratron.transformer.moe.moe_layer import MoELayer
from teratron.transformer.spec_utils import ModuleSpec, build_module


def bias_dropout_add(x_with_bias, residual, prob: float, training: bool):
    """residual + dropout(x + bias), with x_with_bias = (x, bias or None)."""
    x, bias = x_with_bias
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


def get_bias_dropout_add(training: bool, fused: bool = False):
    """Megatron's factory: bias_dropout_add, compiled into one kernel when `fused`."""
    function = fusions.fused(bias_dropout_add) if fused else bias_dropout_add
    return lambda x_with_bias, residual, prob: function(x_with_bias, residual, prob, training)


@dataclass
class TransformerLayerSubmodules:
    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    self_attn_bda: Union[ModuleSpec, type] = get_bias_dropout_add
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp
    mlp_bda: Union[ModuleSpec, type] = get_bias_dropout_add


class TransformerLayer(torch.nn.Module):
    """[s, b, h] -> ([s, b, h], None); [s/tp, b, h] under sequence parallelism.

    layer_number is 1-based and global (counts layers of all pipeline stages).
    """

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: float | None = None, pg_collection=None, vp_stage=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        pg_collection = resolve_pg_collection(pg_collection)
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        hidden, eps = config.hidden_size, config.layernorm_epsilon
        self.input_layernorm = build_module(submodules.input_layernorm, config=config, hidden_size=hidden, eps=eps)
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=layer_number,
                                           pg_collection=pg_collection)
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config=config, hidden_size=hidden, eps=eps)
        self.mlp = build_module(submodules.mlp, config=config, pg_collection=pg_collection)
        self.mlp_bda = build_module(submodules.mlp_bda)
        is_moe = isinstance(self.mlp, MoELayer)
        if is_moe:
            self.mlp.set_layer_number(layer_number)
        selective = (config.recompute_modules or []) if config.recompute_granularity == "selective" else []
        self.recompute_layernorm = "layernorm" in selective
        self.recompute_mlp = ("moe" if is_moe else "mlp") in selective
        self.mlp_offload_name = None if is_moe else "mlp"  # an MoE layer offloads inside its experts

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        with activation_offload.layer_forward(self, hidden_states) as finish:
            if not isinstance(self.self_attention, IdentityOp):
                hidden_states = self._attention_residual(hidden_states, attention_mask, rotary_pos_emb,
                                                         inference_context)
            if not isinstance(self.mlp, IdentityOp):
                hidden_states = self._mlp_residual(hidden_states)
            return finish(hidden_states), None

    def _attention_residual(self, hidden_states, attention_mask, rotary_pos_emb, inference_context=None):
        normed = self._norm(self.input_layernorm, hidden_states, "attn_norm")
        attention_output = self.self_attention(normed, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                               inference_context=inference_context)
        return self._residual_add(self.self_attn_bda, attention_output, normed, hidden_states)

    def _mlp_residual(self, hidden_states):
        normed = self._norm(self.pre_mlp_layernorm, hidden_states, "mlp_norm")
        if self.recompute_mlp:
            mlp_output = (tensor_parallel.checkpoint(self._mlp_plus_bias, False, normed), None)
        else:
            with activation_offload.offload(self.mlp_offload_name):
                mlp_output = self.mlp(normed)
        return self._residual_add(self.mlp_bda, mlp_output, normed, hidden_states)

    def _mlp_plus_bias(self, x):
        # Selective recompute of 'mlp' (dense) or 'moe' (an MoE layer). The bias is added inside
        # the recomputed region, so its add is not kept as an activation either.
        output, bias = self.mlp(x)
        return output if bias is None else output + bias

    def _norm(self, norm, x, offload_name):
        if self.recompute_layernorm and not isinstance(norm, IdentityOp):
            return tensor_parallel.checkpoint(norm, False, x)
        with activation_offload.offload(offload_name):
            return norm(x)

    def _residual_add(self, bda, output_with_bias, normed, hidden_states):
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        if self.config.fp32_residual_connection:
            residual = residual.float()
        with self._dropout_rng():
            return bda(self.training, self.config.bias_dropout_fusion)(output_with_bias, residual, self.hidden_dropout)

    def _dropout_rng(self):
        return residual_dropout_rng(self.config, self.training, self.hidden_dropout)


def residual_dropout_rng(config, training: bool, hidden_dropout: float | None = None):
    """The RNG a layer's residual dropout draws from: under sequence parallelism each TP rank
    drops out a different slice of the sequence (the model-parallel stream); otherwise the ranks
    hold identical activations and must draw identical masks (the default stream)."""
    prob = config.hidden_dropout if hidden_dropout is None else hidden_dropout
    if training and prob > 0 and config.sequence_parallel:
        return tensor_parallel.get_cuda_rng_tracker().fork()
    return contextlib.nullcontext()
