"""The MoE metrics tracker: per-layer aux losses, z-loss and tokens per expert, summed over the
microbatches of a step and read once per logged step by the training loop.

    save_to_aux_losses_tracker(name, value, layer_number, num_layers)   # inside the router
    metrics = track_moe_metrics(loss_scale=1 / num_microbatches, config=config)  # every rank

Values are saved as this rank's part: the ranks of a sequence-partition group (TP x CP under
sequence parallelism, else CP) each hold a share of a sequence, so parts are summed over it;
losses are then averaged over data-parallel ranks, token counts summed. Every rank must call
`track_moe_metrics` (it runs collectives), with the same config.
"""

import torch

from teratron.process_groups import get_pg_size
from teratron.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from teratron.topology import resolve_pg_collection

_MOE_LAYER_WISE_LOGGING_TRACKER: dict = {}

# name -> how ranks combine: "avg" over data parallel (a per-batch loss), or "sum" (a quantity
# of the whole global batch). Both are summed over pipeline stages and sequence partitions first.
_REDUCTIONS = {
    "load_balancing_loss": "avg",
    "seq_load_balancing_loss": "avg",
    "global_load_balancing_loss": "sum",
    "z_loss": "avg",
    "tokens_per_expert": "sum",
}
_AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                   "global_aux_loss": "global_load_balancing_loss"}


def get_moe_layer_wise_logging_tracker() -> dict:
    return _MOE_LAYER_WISE_LOGGING_TRACKER


def save_to_aux_losses_tracker(name: str, value: torch.Tensor, layer_number, num_layers: int) -> None:
    """Add `value` (a scalar, or a vector such as tokens per expert) to layer `layer_number`
    (1-based, global) of tracker entry `name`. Layers without a number are not logged."""
    if layer_number is None:
        return
    tracker = _MOE_LAYER_WISE_LOGGING_TRACKER
    value = value.detach().float()
    if name not in tracker or tracker[name].shape[0] != num_layers:  # new, or another model's rows
        tracker[name] = torch.zeros((num_layers, *value.shape), device=value.device)
    tracker[name][layer_number - 1] += value


def clear_aux_losses_tracker() -> None:
    _MOE_LAYER_WISE_LOGGING_TRACKER.clear()


def moe_layer_pattern(num_layers: int, moe_layer_freq) -> list:
    """1 for MoE layers, 0 for dense ones: every moe_layer_freq-th layer from the first, or the
    0/1 list itself (Megatron's pattern)."""
    if isinstance(moe_layer_freq, int):
        return [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    return list(moe_layer_freq)


def _tracked_layers_moe(config) -> list:
    """Per tracker row, 1 for an MoE layer: the decoder layers, then the multi-token-prediction
    layers (global layer numbers past num_layers). A GPT model's MoE layers are where moe_layer_freq
    puts them, with every MTP layer MoE when the last decoder layer is (an MTP layer has its spec);
    a hybrid model's are its pattern's E layers, the MTP depths' after the decoder's (the pattern
    without its '/' lists them in that order)."""
    if config.hybrid_layer_pattern is not None:
        return [int(symbol == "E") for symbol in config.hybrid_layer_pattern.replace("/", "")]
    pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq)
    return pattern + [pattern[-1]] * (config.mtp_num_layers or 0)


def num_tracked_layers(config) -> int:
    """Rows of the tracker (see `_tracked_layers_moe`)."""
    return len(_tracked_layers_moe(config))


def moe_layer_indices(config) -> list:
    """0-based tracker rows of the MoE layers."""
    return [i for i, moe in enumerate(_tracked_layers_moe(config)) if moe]


def tracked_names(config) -> list:
    """The tracker entries a config produces, in a fixed order (every rank reduces the same)."""
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    types, coeffs = (types, coeffs) if isinstance(types, list) else ([types], [coeffs])
    names = [_AUX_LOSS_NAMES[t] for t, c in zip(types, coeffs) if t in _AUX_LOSS_NAMES and c > 0]
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names + ["tokens_per_expert"]


def _sum_over(value, group):
    if get_pg_size(group) == 1:
        return value
    return reduce_from_tensor_model_parallel_region(value, group)


def _collective_device(tracker):
    """Where a rank without entries (a dense pipeline stage) builds its zeros: NCCL needs CUDA."""
    if tracker:
        return next(iter(tracker.values())).device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def reduce_aux_losses_tracker_across_ranks(config, pg_collection=None) -> dict:
    """Every tracked entry of `config`, combined over ranks as the module docstring says."""
    pg = resolve_pg_collection(pg_collection)
    seq_group = pg.tp_cp if config.sequence_parallel else pg.cp
    tracker = _MOE_LAYER_WISE_LOGGING_TRACKER
    device = _collective_device(tracker)
    reduced = {}
    for name in tracked_names(config):
        rows = num_tracked_layers(config)
        shape = (rows, config.num_moe_experts) if name == "tokens_per_expert" else (rows,)
        values = tracker.get(name)
        values = torch.zeros(shape, device=device) if values is None else values
        values = _sum_over(_sum_over(values, pg.pp), seq_group)
        values = _sum_over(values, pg.dp)
        if _REDUCTIONS[name] == "avg":
            values = values / get_pg_size(pg.dp)
        reduced[name] = values.cpu()
    return reduced


def track_moe_metrics(loss_scale: float, config, per_layer_logging=None, pg_collection=None) -> dict:
    """The step's MoE metrics as {name: float}, then an empty tracker.

    loss_scale: 1 / num_microbatches (the tracker summed the microbatches). Losses are averaged
    over MoE layers (MTP layers included); `moe_load_imbalance` is max/mean tokens per expert, averaged over MoE
    layers. With per_layer_logging (default: config.moe_per_layer_logging) each MoE layer also
    gets `{name}_layer_{layer_number}` and `tokens_per_expert_layer_{layer_number}` (a list).
    """
    per_layer = config.moe_per_layer_logging if per_layer_logging is None else per_layer_logging
    reduced = reduce_aux_losses_tracker_across_ranks(config, pg_collection)
    clear_aux_losses_tracker()
    layers = moe_layer_indices(config)
    metrics = {}
    for name, values in reduced.items():
        if name == "tokens_per_expert":
            counts = values[layers]
            imbalance = counts.max(dim=-1).values / counts.mean(dim=-1).clamp(min=1e-9)
            metrics["moe_load_imbalance"] = imbalance.mean().item()
            if per_layer:
                for i, row, ratio in zip(layers, counts.tolist(), imbalance.tolist()):
                    metrics[f"tokens_per_expert_layer_{i + 1}"] = row
                    metrics[f"moe_load_imbalance_layer_{i + 1}"] = ratio
            continue
        scaled = values[layers] * loss_scale
        metrics[name] = scaled.mean().item()
        if per_layer:
            for i, value in zip(layers, scaled.tolist()):
                metrics[f"{name}_layer_{i + 1}"] = value
    return metrics
