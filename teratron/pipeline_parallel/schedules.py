"""Forward-backward schedules behind `get_forward_backward_func()` (Megatron's contract).

    forward_backward_func = get_forward_backward_func()
    losses = forward_backward_func(forward_step_func=..., data_iterator=..., model=...,
                                   num_microbatches=..., seq_length=..., micro_batch_size=...)

`forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`; on the last stage
`loss_func(output_tensor)` returns `(loss, log_dict)` with `loss` the microbatch mean, or
`(loss_sum, num_tokens, log_dict)`. The schedule scales the loss so that the accumulated
gradients are those of the mean over all microbatches, exactly as without pipelining:
- `(loss, log)`: backward of loss * cp_size / num_microbatches (under CP, `loss` is the
  micro-batch mean over all its CP ranks' tokens, its gradient flowing from this rank's);
- `(loss_sum, num_tokens, log)`: backward of loss_sum / num_tokens * cp_size / num_microbatches,
  num_tokens summed over the micro-batch's CP ranks (each holds a part of the sequence), or, with
  `config.calculate_per_token_loss`, of loss_sum unscaled; the token total then goes to
  `config.finalize_model_grads_func(model_chunks, num_tokens)`, which divides the gradients.
The cp_size factor offsets the data-parallel gradient average over the DP x CP group: the CP
ranks' gradients together are the micro-batch's, so they must add up, not average.
Each schedule returns the list of log dicts (empty on non-last stages).
"""

import contextlib
from typing import Callable, Iterator, List, Optional, Union

import torch

from teratron.pipeline_parallel.microbatch_step import (as_chunk_list, backward_step, finalize_grads,
                                                        forward_step, get_model_config)
from teratron.pipeline_parallel.pipelined import (forward_backward_pipelining_with_interleaving,
                                                  forward_backward_pipelining_without_interleaving)
from teratron.process_groups import get_pg_size
from teratron.topology import current_topology, resolve_pg_collection


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None) -> Callable:
    """The schedule for the layout (default: the current topology's): no pipelining, 1F1B, or
    interleaved 1F1B when there are virtual stages."""
    if pp_size is None:
        pp_size = get_pg_size(resolve_pg_collection().pp)
    if vp_size is None:
        vp_size = current_topology().virtual_pipeline_model_parallel_size
    if pp_size == 1:
        return forward_backward_no_pipelining
    if vp_size is not None and vp_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    pg_collection=None,
) -> list:
    """Gradient accumulation over `num_microbatches` without pipelining.

    The data-parallel gradient sync (config.no_sync_func) is held back until the last microbatch.
    seq_length, micro_batch_size, decoder_seq_length and first_val_step are accepted for
    Megatron's signature; without p2p nothing needs the shapes.
    """
    model = as_chunk_list(model, "model", 1)[0]
    data_iterator = as_chunk_list(data_iterator, "data_iterator", 1)[0]
    config = get_model_config(model)
    cp_group = resolve_pg_collection(pg_collection).cp
    no_sync = config.no_sync_func or contextlib.nullcontext
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    forward_data_store: list = []
    total_num_tokens = 0

    def step():
        output, num_tokens = forward_step(forward_step_func, data_iterator, model, num_microbatches, None,
                                          forward_data_store, config, collect_non_loss_data, cp_group=cp_group)
        if not forward_only:
            backward_step(None, output, None, config)
        return num_tokens

    with no_sync():
        for _ in range(num_microbatches - 1):
            total_num_tokens = total_num_tokens + step()
    total_num_tokens = total_num_tokens + step()
    finalize_grads(config, [model], total_num_tokens, forward_only)
    return forward_data_store
