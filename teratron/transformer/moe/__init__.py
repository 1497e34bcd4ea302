"""Mixture of Experts: router, token dispatchers, experts, the MoE layer and its spec."""

from teratron.transformer.moe.experts import GroupedMLP, SequentialMLP
from teratron.transformer.moe.moe_layer import MoELayer, MoESubmodules
from teratron.transformer.moe.moe_logging import (clear_aux_losses_tracker, moe_layer_pattern,
                                                  save_to_aux_losses_tracker, track_moe_metrics)
from teratron.transformer.moe.moe_spec import get_moe_module_spec
from teratron.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from teratron.transformer.moe.router import TopKRouter, update_moe_routers
from teratron.transformer.moe.shared_experts import SharedExpertMLP
from teratron.transformer.moe.router_replay import (RouterReplayAction, clear_router_replay,
                                                    load_router_replay, save_router_replay,
                                                    set_replay_routing, set_router_replay_action)
from teratron.transformer.moe.token_dispatcher import (MoEAllGatherTokenDispatcher,
                                                       MoEAlltoAllTokenDispatcher)

__all__ = [
    "GroupedMLP", "SequentialMLP", "MoELayer", "MoESubmodules", "clear_aux_losses_tracker",
    "moe_layer_pattern", "save_to_aux_losses_tracker", "track_moe_metrics", "get_moe_module_spec",
    "MoEAuxLossAutoScaler", "SharedExpertMLP", "TopKRouter", "update_moe_routers", "RouterReplayAction",
    "clear_router_replay", "load_router_replay", "save_router_replay", "set_replay_routing", "set_router_replay_action",
    "MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher",
]
