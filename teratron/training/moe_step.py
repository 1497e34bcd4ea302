"""The training step's Mixture-of-Experts hooks (Megatron's, in the same places).

    set_moe_aux_loss_scale(config, num_microbatches, device)  # before forward/backward
    ...forward_backward, optimizer.step()...
    metrics = finish_moe_step(model, config, num_microbatches)  # every rank, every step

Both are no-ops for a dense model (the first still sets the backward scale of a
multi-token-prediction loss, which joins the backward as the aux losses do). `finish_moe_step`
runs collectives (router updates over the data-parallel ranks, metrics over pipeline, sequence
and data-parallel ranks), so every rank calls it every step, skipped steps included.
"""

import torch

from teratron.process_groups import get_pg_size
from teratron.topology import resolve_pg_collection


def moe_aux_loss_scale(config, num_microbatches: int, device, pg_collection=None) -> torch.Tensor:
    """The factor the schedule gives the main loss's gradient, for the aux losses' gradient.

    The schedule back-propagates loss_sum / num_tokens * cp_size / num_microbatches (or loss_sum
    under calculate_per_token_loss), times the fp16 loss scale (config.grad_scale_func). The
    aux losses are per-micro-batch means (the router multiplies them by the micro-batch's tokens
    under calculate_per_token_loss), so they get the same factor without the token division:
    with gradient accumulation and pipelining they are averaged over the step's micro-batches
    like the main loss, and the DP x CP gradient average treats both alike.
    """
    one = torch.ones((), device=device)
    scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
    scale = scale * get_pg_size(resolve_pg_collection(pg_collection).cp)
    if not config.calculate_per_token_loss:
        scale = scale / num_microbatches
    return scale.detach()


def set_moe_aux_loss_scale(config, num_microbatches: int, device, pg_collection=None) -> None:
    """Set MoEAuxLossAutoScaler's backward scale for this step's micro-batches (the MoE aux
    losses' and the multi-token-prediction loss's)."""
    if config.num_moe_experts is None and not config.mtp_num_layers:
        return
    from teratron.transformer.moe import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(moe_aux_loss_scale(config, num_microbatches, device, pg_collection))


def finish_moe_step(model_chunks, config, num_microbatches: int, pg_collection=None) -> dict:
    """After the optimizer step: update the routers' balancing state (expert bias, quantile
    balancing, global-aux-loss counts) and return the step's MoE metrics (aux losses and z-loss
    per micro-batch, load imbalance; per layer with moe_per_layer_logging), emptying the tracker."""
    if config.num_moe_experts is None:
        return {}
    from teratron.transformer.moe import track_moe_metrics, update_moe_routers

    update_moe_routers(model_chunks)
    return track_moe_metrics(1.0 / num_microbatches, config, pg_collection=pg_collection)
