"""Multi-token prediction (DeepSeek-V3's MTP; Megatron's `transformer.multi_token_prediction`).

Depth k = 1..D predicts, at every position t, the token t + k + 1 (the main model predicts t + 1):

    e_k = embedding(input_ids shifted left by k)                    the model's own embedding
    h_k = final_layernorm_k(transformer_layer_k(eh_proj([enorm_k(e_k), hnorm_k(h_{k-1})])))
    loss_k = cross_entropy(output_layer(h_k), labels shifted left by k)   the model's output layer

h_0 is the main model's output (after its final norm). A shift fills the end with zeros, and
those positions leave the loss (the loss mask is shifted alike; Megatron's `roll_tensor`).
Each depth's transformer layer has the spec of the model's last decoder layer (MoE when that
one is) and the global layer number num_layers + k, which names its init stream, its MoE
statistics and its router replay. The layers live on the last pipeline stage, with the loss.

The loss: each depth's masked mean over the micro-batch, averaged over the depths, times
`mtp_loss_scaling_factor`, joins the backward through `MoEAuxLossAutoScaler` on the LM loss
(so with the schedule's factor 1 / num_microbatches, like an auxiliary loss) and leaves the
LM loss's value unchanged; each depth's [loss sum, token count] is kept for the log
(`pop_mtp_losses`, read by the training step right after the forward).
"""

import functools
from dataclasses import dataclass, field
from typing import List, Optional, Union

import torch

from teratron import tensor_parallel
from teratron.comm import sum_over_ranks
from teratron.process_groups import get_pg_size
from teratron.tensor_parallel import mappings
from teratron.topology import resolve_pg_collection
from teratron.transformer.context_parallel import gather_sequence, scatter_sequence
from teratron.transformer.init_rng import build_component
from teratron.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from teratron.transformer.norms import Norm
from teratron.transformer.spec_utils import ModuleSpec, build_module


def roll_left(tensor: torch.Tensor, shift: int, cp_group=None, attention_mask=None) -> torch.Tensor:
    """[b, s] -> [b, s] with position j holding position j + shift's value; zeros at the end and,
    for packed documents (`attention_mask` a PackedSeqParams), where j + shift is in another
    document. Under context parallelism the tensor is this CP rank's tokens and the shift is
    along the whole sequence (`gather_sequence`)."""
    full, documents = gather_sequence(tensor, cp_group, attention_mask)
    length = full.shape[-1]
    rolled = torch.zeros_like(full)
    if shift < length:
        rolled[..., :length - shift] = full[..., shift:]
        if documents is not None:
            other = documents[..., shift:] != documents[..., :length - shift]
            rolled[..., :length - shift] = rolled[..., :length - shift].masked_fill(other, 0)
    return scatter_sequence(rolled, cp_group, attention_mask)


@dataclass
class MultiTokenPredictionLayerSubmodules:
    enorm: Union[ModuleSpec, type] = Norm
    hnorm: Union[ModuleSpec, type] = Norm
    eh_proj: Union[ModuleSpec, type] = tensor_parallel.ColumnParallelLinear
    transformer_layer: Union[ModuleSpec, type] = None
    layer_norm: Union[ModuleSpec, type] = Norm


class MultiTokenPredictionLayer(torch.nn.Module):
    """One depth: (embeddings e_k, hidden states h_{k-1}) -> h_k, all [s, b, h] ([s/tp, b, h]
    under sequence parallelism)."""

    def __init__(self, config, submodules: MultiTokenPredictionLayerSubmodules, depth: int,
                 pg_collection=None, vp_stage=None):
        super().__init__()
        self.config = config
        self.depth = depth
        self.pg_collection = resolve_pg_collection(pg_collection)
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.enorm = build_module(submodules.enorm, config=config, hidden_size=h, eps=eps)
        self.hnorm = build_module(submodules.hnorm, config=config, hidden_size=h, eps=eps)
        # Column-parallel with its output gathered (Megatron's layout of the [h, 2h] weight).
        self.eh_proj = build_module(submodules.eh_proj, 2 * h, h, config=config, init_method=config.init_method,
                                    gather_output=True, bias=False, skip_bias_add=False, tp_group=self.pg_collection.tp)
        self.transformer_layer = build_module(submodules.transformer_layer, config=config,
                                              layer_number=config.num_layers + depth,
                                              pg_collection=self.pg_collection, vp_stage=vp_stage)
        self.final_layernorm = build_module(submodules.layer_norm, config=config, hidden_size=h, eps=eps)

    def forward(self, embeddings, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        combined = torch.cat([self.enorm(embeddings), self.hnorm(hidden_states)], dim=-1)  # [s, b, 2h]
        projected, _ = self.eh_proj(combined)  # [s, b, h], the whole sequence under sequence parallelism
        if self.config.sequence_parallel:
            projected = mappings.scatter_to_sequence_parallel_region(projected, group=self.pg_collection.tp)
        hidden_states, _ = self.transformer_layer(projected, attention_mask=attention_mask,
                                                  rotary_pos_emb=rotary_pos_emb, inference_context=inference_context)
        return self.final_layernorm(hidden_states)


@dataclass
class MultiTokenPredictionBlockSubmodules:
    layer_specs: List[ModuleSpec] = field(default_factory=list)


def get_mtp_layer_spec(transformer_layer_spec: ModuleSpec, norm=Norm) -> ModuleSpec:
    """One depth around `transformer_layer_spec`, with `norm` for enorm, hnorm and its final norm."""
    return ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=tensor_parallel.ColumnParallelLinear,
        transformer_layer=transformer_layer_spec, layer_norm=norm))


class MultiTokenPredictionBlock(torch.nn.Module):
    """The D depths, chained: h_0 -> [h_1, ..., h_D]."""

    def __init__(self, config, spec: MultiTokenPredictionBlockSubmodules, pg_collection=None, vp_stage=None):
        super().__init__()
        self.config = config
        self.pg_collection = resolve_pg_collection(pg_collection)
        if len(spec.layer_specs) != config.mtp_num_layers:
            raise ValueError(f"the MTP block spec lists {len(spec.layer_specs)} layers but mtp_num_layers is "
                             f"{config.mtp_num_layers}; give one spec per depth")
        layers = []
        for depth, layer_spec in enumerate(spec.layer_specs, 1):
            layers.append(build_component(f"mtp{depth}", functools.partial(
                build_module, layer_spec, config=config, depth=depth, pg_collection=self.pg_collection,
                vp_stage=vp_stage), config.init_model_with_meta_device))
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, input_ids, position_ids, hidden_states, embedding, attention_mask=None,
                rotary_pos_emb=None) -> list:
        """input_ids, position_ids [b, s]; hidden_states h_0 [s, b, h]; `embedding` the model's
        (ids, positions) -> [s, b, h]. Returns [h_1, ..., h_D]."""
        recompute = self.config.recompute_granularity == "full" and self.training
        if recompute and torch.is_grad_enabled() and not hidden_states.requires_grad:
            # A frozen main model: the checkpoint's output needs an input that requires grad.
            hidden_states = hidden_states.detach().requires_grad_()
        outputs = []
        for depth, layer in enumerate(self.layers, 1):
            cp = self.pg_collection.cp
            embeddings = embedding(roll_left(input_ids, depth, cp, attention_mask),
                                   roll_left(position_ids, depth, cp, attention_mask))
            if recompute:
                hidden_states = tensor_parallel.checkpoint(layer, False, embeddings, hidden_states, attention_mask,
                                                           rotary_pos_emb, tp_group=self.pg_collection.tp)
            else:
                hidden_states = layer(embeddings, hidden_states, attention_mask, rotary_pos_emb)
            outputs.append(hidden_states)
        return outputs


# ----- the loss -------------------------------------------------------------------------------

_LAST_MTP_LOSSES: Optional[list] = None


def pop_mtp_losses() -> list:
    """The last forward's per-depth [loss sum, token count] (detached, each [2]); [] when the
    last forward computed none. Cleared by the call."""
    global _LAST_MTP_LOSSES
    losses, _LAST_MTP_LOSSES = _LAST_MTP_LOSSES or [], None
    return losses


def attach_mtp_loss(lm_loss: torch.Tensor, depth_losses: list, config, num_tokens: torch.Tensor,
                    cp_group=None) -> torch.Tensor:
    """lm_loss [b, s] with the MTP loss joined to its backward (its value unchanged).

    depth_losses: per depth (per-token loss [b, s], its loss mask [b, s]); num_tokens: the
    micro-batch's LM tokens (calculate_per_token_loss scales each depth's mean by it, so the
    global token division of the gradients gives each depth its mean). Under context
    parallelism each rank holds a part of the micro-batch: its share of a depth's mean is its
    loss sum over the micro-batch's count (the CP ranks' shares add up; the backward scale's
    factor CP and the gradients' DP x CP average cancel), and the log keeps its own [sum, count]."""
    global _LAST_MTP_LOSSES
    total, report = 0.0, []
    cp_size = get_pg_size(cp_group)
    for token_loss, mask in depth_losses:
        loss_sum = torch.sum(token_loss.float() * mask)
        count = mask.sum()
        report.append(torch.stack([loss_sum.detach(), count.detach()]))
        mean = loss_sum / sum_over_ranks(count, cp_group).clamp(min=1)
        if config.calculate_per_token_loss:  # no average over CP ranks follows: undo the scale's CP
            mean = mean * sum_over_ranks(num_tokens, cp_group) / cp_size
        total = total + mean
    _LAST_MTP_LOSSES = report
    scaled = total * (config.mtp_loss_scaling_factor / len(depth_losses))
    return MoEAuxLossAutoScaler.apply(lm_loss, scaled)
