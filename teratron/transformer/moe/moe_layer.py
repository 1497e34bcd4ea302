"""MoELayer: a drop-in `mlp` of the transformer layer that sends each token to k experts.

    y = sum_{e in topk(x)} p_e(x) * expert_e(x)  (+ shared_experts(x), times sigmoid(x . w_gate)
                                                   with moe_shared_expert_gate: `shared_experts`)

[s, b, h] -> ([s, b, h], None); [s/tp, b, h] under sequence parallelism. Route (TopKRouter),
dispatch to the ranks holding the experts (token_dispatcher), run the local experts, combine.
Under tensor parallelism without sequence parallelism the TP ranks hold the same tokens: they
route them all (the router and its losses stay replicated), then each dispatches only its 1/tp
slice and the outputs are all-gathered back, so no expert runs a token twice.
"""

from dataclasses import dataclass
from typing import Union

import torch

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                               scatter_to_sequence_parallel_region)
from teratron.tensor_parallel.utils import divide
from teratron.topology import resolve_pg_collection
from teratron.transformer.moe.router import TopKRouter
from teratron.transformer.moe.token_dispatcher import DISPATCHERS
from teratron.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class MoESubmodules:
    experts: Union[ModuleSpec, type] = None
    shared_experts: Union[ModuleSpec, type] = None


class MoELayer(torch.nn.Module):
    def __init__(self, config, submodules: MoESubmodules, layer_number=None, pg_collection=None):
        super().__init__()
        self._check_config(config)
        self.config = config
        self.pg_collection = pg = resolve_pg_collection(pg_collection)
        ep_size, ep_rank = get_pg_size(pg.ep), get_pg_rank(pg.ep)
        self.num_local_experts = divide(config.num_moe_experts, ep_size)
        first = ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.tp_group = pg.tp
        self.scatter_tokens = get_pg_size(pg.tp) > 1 and not config.sequence_parallel

        self.router = TopKRouter(config, pg_collection=pg)
        self.experts = build_module(submodules.experts, self.num_local_experts, config,
                                    pg_collection=pg, local_expert_indices=self.local_expert_indices)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = build_module(
                submodules.shared_experts, config=config,
                ffn_hidden_size=config.moe_shared_expert_intermediate_size, pg_collection=pg)
        self.token_dispatcher = DISPATCHERS[config.moe_token_dispatcher_type](
            self.num_local_experts, self.local_expert_indices, config, pg)
        self.set_layer_number(layer_number)

    @staticmethod
    def _check_config(config):
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs num_moe_experts; set it or use the dense MLP spec")
        if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
            raise ValueError("moe_apply_probs_on_input needs moe_router_topk=1 (the weighted input "
                             "would be shared by k experts)")
        if config.moe_token_dropping:
            raise ValueError("moe_token_dropping is Megatron's unsupported legacy switch; leave it False "
                             "and set moe_expert_capacity_factor to drop tokens")
        if config.moe_latent_size is not None:
            raise NotImplementedError("moe_latent_size (latent MoE projections) is not supported yet; "
                                      "leave it None")

    def set_layer_number(self, layer_number):
        """The global 1-based layer number (names this layer in metrics and router replay)."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        shared_output = None
        if self.shared_experts is not None and not self.config.moe_shared_expert_overlap:
            shared_output = self._shared(hidden_states)
        probs, routing_map = self.router(hidden_states)
        # Shared experts after routing with moe_shared_expert_overlap (Megatron's order).
        if self.shared_experts is not None and self.config.moe_shared_expert_overlap:
            shared_output = self._shared(hidden_states)
        tokens = hidden_states.reshape(-1, shape[-1])
        if self.scatter_tokens:
            tokens, probs, routing_map = self._scatter(tokens, probs, routing_map)
        output = self._routed_experts(tokens, probs, routing_map)
        if self.scatter_tokens:
            output = gather_from_sequence_parallel_region(output, False, self.tp_group)
        output = output.view(shape)
        if shared_output is not None:
            output = output + shared_output
        return output, None

    @torch.compiler.disable
    def _routed_experts(self, tokens, probs, routing_map):
        """Dispatch, the local experts, combine: [t, h] -> [t, h]. Outside torch.compile (a
        `--torch-compile` layer calls it as is): the tokens per expert are host integers that
        change every step, and traced they would recompile the layer each time."""
        expert_input, tokens_per_expert, expert_probs = self.token_dispatcher.dispatch(tokens, probs, routing_map)
        expert_output = self.experts(expert_input, tokens_per_expert, expert_probs)
        return self.token_dispatcher.combine(expert_output)

    def _shared(self, hidden_states):
        output, bias = self.shared_experts(hidden_states)
        return output if bias is None else output + bias

    def _scatter(self, tokens, probs, routing_map):
        num_tokens, tp = tokens.shape[0], get_pg_size(self.tp_group)
        if num_tokens % tp:
            raise ValueError(f"MoE under tensor parallelism splits the {num_tokens} tokens of a "
                             f"micro-batch (seq_length x micro_batch_size) over {tp} ranks; make "
                             "them divisible or enable sequence_parallel")
        chunk = num_tokens // tp
        local_map = routing_map.narrow(0, get_pg_rank(self.tp_group) * chunk, chunk)
        return (scatter_to_sequence_parallel_region(tokens, self.tp_group),
                scatter_to_sequence_parallel_region(probs, self.tp_group), local_map)
