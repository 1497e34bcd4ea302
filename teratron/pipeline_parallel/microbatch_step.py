"""One microbatch through one model chunk: the forward with the loss scaling, and the backward.

Shared by every schedule. `forward_step` applies Megatron's loss contract (see `schedules`);
`backward_step` runs autograd from a stage output, which may have been freed to a placeholder
after it was sent (`deallocate_output_tensor`), so it calls the autograd engine directly.
"""

import contextlib
from typing import Optional

import torch
from torch.autograd.variable import Variable

from teratron.comm import sum_over_ranks
from teratron.process_groups import get_pg_size


def get_model_config(model: torch.nn.Module):
    """The TransformerConfig of a model chunk, looking through wrappers (DDP, Float16Module)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "config"):
        raise ValueError(f"model {type(model).__name__} has no .config; pass a GPTModel or a wrapper of one")
    return model.config


def set_input_tensor(model: torch.nn.Module, input_tensor: Optional[torch.Tensor]) -> None:
    """Hand a non-first stage the activations received from the previous stage."""
    while not hasattr(model, "set_input_tensor") and hasattr(model, "module"):
        model = model.module
    if hasattr(model, "set_input_tensor"):
        model.set_input_tensor(input_tensor)


def as_chunk_list(value, name: str, num_chunks: int) -> list:
    """`value` as a list of `num_chunks` items (a bare value counts as a list of one)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if len(values) != num_chunks:
        raise ValueError(f"{name} has {len(values)} entries but the schedule runs {num_chunks} model "
                         f"chunk(s); pass one per chunk")
    return list(values)


def forward_step(forward_step_func, data_iterator, model, num_microbatches: int, input_tensor,
                 forward_data_store: list, config, collect_non_loss_data: bool = False,
                 is_last_stage: bool = True, cp_group=None):
    """Run one microbatch forward; on the last stage apply the loss and scale it.

    Returns (output_tensor, num_tokens): the stage output (the scaled loss on the last stage) and
    the microbatch's token count on this rank (0 unless loss_func reports one).
    """
    set_input_tensor(model, input_tensor)
    autocast = (torch.autocast(_device_type(model), dtype=config.autocast_dtype)
                if config.enable_autocast else contextlib.nullcontext())
    with autocast:
        output_tensor, loss_func = forward_step_func(data_iterator, model)
    num_tokens = 0
    if not is_last_stage:
        return output_tensor, num_tokens
    if collect_non_loss_data:
        forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        return output_tensor, num_tokens
    outputs = loss_func(output_tensor)
    cp_size = get_pg_size(cp_group)
    if len(outputs) == 3:
        output_tensor, num_tokens, log_dict = outputs
        if not config.calculate_per_token_loss:
            output_tensor = output_tensor / sum_over_ranks(num_tokens, cp_group) * cp_size / num_microbatches
    elif len(outputs) == 2:
        output_tensor, log_dict = outputs
        output_tensor = output_tensor * cp_size / num_microbatches
    else:
        raise ValueError(f"loss_func returned {len(outputs)} values; return (loss, log_dict) or "
                         f"(loss_sum, num_tokens, log_dict)")
    forward_data_store.append(log_dict)
    return output_tensor, num_tokens


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """Backpropagate one microbatch; returns the gradient of the stage input (None on the first).

    On the last stage output_tensor is the scaled loss and output_tensor_grad is None.
    """
    if output_tensor_grad is None:
        if config.grad_scale_func is not None:
            output_tensor = config.grad_scale_func(output_tensor)
        output_tensor_grad = torch.ones_like(output_tensor)
    # The engine is called directly: a sent output may have been freed to a 1-element
    # placeholder (deallocate_output_tensor), which torch.autograd.backward's shape check rejects.
    Variable._execution_engine.run_backward(
        (output_tensor,), (output_tensor_grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True,
    )
    return None if input_tensor is None else input_tensor.grad


def deallocate_output_tensor(output_tensor: torch.Tensor) -> None:
    """Free a sent stage output's data; its autograd graph (all backward needs) stays.

    A view is left alone: its base holds the memory anyway and may be needed by backward.
    """
    if output_tensor is None or output_tensor._base is not None:
        return
    output_tensor.data = torch.empty((1,), device=output_tensor.device, dtype=output_tensor.dtype)


def _device_type(model: torch.nn.Module) -> str:
    param = next(model.parameters(), None)
    return "cpu" if param is None else param.device.type


def finalize_grads(config, model_chunks: list, total_num_tokens, forward_only: bool) -> None:
    """Hand the grads to config.finalize_model_grads_func, with the token count under
    calculate_per_token_loss: an int32 tensor (Megatron's dtype, so every stage's matches for the
    broadcast from the last stage) on the model's device, 0 on stages without the loss."""
    if config.finalize_model_grads_func is None or forward_only:
        return
    num_tokens = None
    if config.calculate_per_token_loss:
        device = next(model_chunks[0].parameters()).device
        num_tokens = torch.as_tensor(total_num_tokens, device=device).to(torch.int)
    config.finalize_model_grads_func(model_chunks, num_tokens)
