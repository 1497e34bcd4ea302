"""The pipelined schedules: 1F1B and interleaved 1F1B (Megatron's entry points and contract).

Both run the per-rank plan of `schedule_plan` (order of forwards and backwards, and the step each
transfer belongs to) with `p2p_communication`; the loss handling and the per-microbatch forward
and backward are those of `microbatch_step`, so the gradients equal the unpipelined ones.

Interleaving needs one model chunk per virtual stage (`model` a list of
virtual_pipeline_model_parallel_size modules, chunk v building virtual stage v) and one data
iterator per chunk; each chunk draws its microbatches from its own iterator in order
0..num_microbatches-1.
"""

import contextlib
from typing import Callable, Iterator, List, Optional, Union

import torch

from teratron.pipeline_parallel.microbatch_step import (as_chunk_list, backward_step, deallocate_output_tensor,
                                                        finalize_grads, forward_step, get_model_config)
from teratron.pipeline_parallel.p2p_communication import P2PCommunicator, get_tensor_shape
from teratron.pipeline_parallel.schedule_plan import Action, plan_pipeline
from teratron.process_groups import get_pg_size
from teratron.topology import current_topology, resolve_pg_collection


def forward_backward_pipelining_without_interleaving(
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
    """1F1B: warm-up forwards, one forward / one backward in the steady state, cool-down backwards.

    decoder_seq_length and first_val_step are accepted for Megatron's signature (no
    encoder-decoder models, no FP8 weight caching here).
    """
    models = as_chunk_list(model, "model", 1)
    return _PipelineRun(forward_step_func, as_chunk_list(data_iterator, "data_iterator", 1), models,
                        num_microbatches, seq_length, micro_batch_size, forward_only,
                        collect_non_loss_data, pg_collection).run()


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator: List[Iterator],
    model: List[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    pg_collection=None,
) -> list:
    """Interleaved 1F1B over the model chunks of this rank (one per virtual pipeline stage)."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    config = get_model_config(models[0])
    vpp = config.virtual_pipeline_model_parallel_size or 1
    models = as_chunk_list(models, "model", vpp)
    if config.microbatch_group_size_per_vp_stage < config.pipeline_model_parallel_size:
        raise ValueError(f"microbatch_group_size_per_vp_stage ({config.microbatch_group_size_per_vp_stage}) "
                         f"must be at least pipeline_model_parallel_size ({config.pipeline_model_parallel_size})")
    iterators = as_chunk_list(data_iterator, "data_iterator", vpp)
    return _PipelineRun(forward_step_func, iterators, models, num_microbatches, seq_length,
                        micro_batch_size, forward_only, collect_non_loss_data, pg_collection).run()


def _per_chunk(funcs, chunk: int):
    return funcs[chunk] if isinstance(funcs, (list, tuple)) else funcs


class _PipelineRun:
    """One call of a pipelined schedule on this rank."""

    def __init__(self, forward_step_func, iterators, models, num_microbatches, seq_length,
                 micro_batch_size, forward_only, collect_non_loss_data, pg_collection):
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        self.config = config = get_model_config(models[0])
        self.forward_step_func, self.iterators, self.models = forward_step_func, iterators, models
        self.num_microbatches, self.forward_only = num_microbatches, forward_only
        self.collect_non_loss_data = collect_non_loss_data
        groups = resolve_pg_collection(pg_collection)
        pp_group, tp_group, self.cp_group = groups.pp, groups.tp, groups.cp
        self.cp_size = get_pg_size(self.cp_group)
        self.pp_rank = torch.distributed.get_rank(pp_group)
        self.pp_size = torch.distributed.get_world_size(pp_group)
        self.num_stages = self.pp_size * len(models)
        self.tensor_shape = get_tensor_shape(config, seq_length, micro_batch_size, get_pg_size(tp_group),
                                             self.cp_size)
        device = next(models[0].parameters()).device
        self.comm = P2PCommunicator(pp_group, config, device)
        self.received = {}       # Action the tensor feeds -> Transfer
        self.saved = {}          # (chunk, microbatch) -> (input_tensor, output_tensor)
        self.forward_data_store: list = []
        self.total_num_tokens = 0
        self.backwards_left = 0 if forward_only else len(models) * num_microbatches

    def run(self) -> list:
        plan = plan_pipeline(self.pp_size, len(self.models), self.num_microbatches,
                             self.config.microbatch_group_size_per_vp_stage, self.forward_only)[self.pp_rank]
        topology = current_topology()  # its virtual rank tells forward_step which chunk runs
        saved_vp_rank = topology.virtual_pipeline_model_parallel_rank
        with contextlib.ExitStack() as stack:
            self.grad_sync_off = self._disable_grad_sync(stack)
            for step in plan:
                self._step(step)
            self.comm.finish()
        topology.virtual_pipeline_model_parallel_rank = saved_vp_rank
        finalize_grads(self.config, self.models, self.total_num_tokens, self.forward_only)
        return self.forward_data_store

    def _disable_grad_sync(self, stack: contextlib.ExitStack) -> dict:
        """Enter no_sync (per chunk when config.no_sync_func is a list); key -> its ExitStack.

        A single no_sync_func covers all chunks and is left before the very last backward.
        """
        funcs = self.config.no_sync_func
        if funcs is None:
            return {}
        keys = range(len(self.models)) if isinstance(funcs, (list, tuple)) else ["all"]
        contexts = {}
        for key in keys:
            contexts[key] = stack.enter_context(contextlib.ExitStack())
            contexts[key].enter_context((funcs if key == "all" else funcs[key])())
        return contexts

    def _step(self, step) -> None:
        sends, input_tensor, output = [], None, None
        if step.action is not None and step.action.kind == "F":
            input_tensor, output = self._forward(step.action)
            if step.sends:
                sends.append((output.detach(), step.sends[0]))
        elif step.action is not None:
            input_grad = self._backward(step.action)
            if step.sends:
                sends.append((input_grad, step.sends[0]))
        transfers = self.comm.exchange(sends, [direction for direction, _ in step.recvs], self.tensor_shape)
        for (_, feeds), transfer in zip(step.recvs, transfers):
            self.received[feeds] = transfer
        # An empty stage passes its input through; that tensor is not this stage's to free.
        if output is not None and sends and self.config.deallocate_pipeline_outputs and output is not input_tensor:
            deallocate_output_tensor(output)

    def _set_vp_rank(self, chunk: int) -> None:
        if len(self.models) > 1:
            current_topology().virtual_pipeline_model_parallel_rank = chunk

    def _forward(self, action: Action):
        chunk, m = action.chunk, action.microbatch
        stage = chunk * self.pp_size + self.pp_rank
        input_tensor = None
        if stage > 0:
            input_tensor = self.received.pop(action).get()
            if not self.forward_only:
                input_tensor.requires_grad_()
        self._set_vp_rank(chunk)
        # Interleaved: every chunk, chunk 0 included, gets its param sync before its first forward
        # (Megatron syncs chunks 0 and 1 up front, later ones just ahead of use). With one chunk,
        # as in Megatron's 1F1B, the DDP pre-hooks or the optimizer step do the gather.
        if m == 0 and len(self.models) > 1 and self.config.param_sync_func is not None:
            _per_chunk(self.config.param_sync_func, chunk)(self.models[chunk].parameters())
        output, num_tokens = forward_step(
            self.forward_step_func, self.iterators[chunk], self.models[chunk], self.num_microbatches,
            input_tensor, self.forward_data_store, self.config, self.collect_non_loss_data,
            is_last_stage=stage == self.num_stages - 1, cp_group=self.cp_group)
        self.total_num_tokens = self.total_num_tokens + num_tokens
        if stage < self.num_stages - 1:
            self._check_output(output, stage)
        if not self.forward_only:
            self.saved[(chunk, m)] = (input_tensor, output)
        return input_tensor, output

    def _check_output(self, output: torch.Tensor, stage: int) -> None:
        expected = self.tensor_shape
        if not self.config.variable_seq_lengths and tuple(output.shape) != tuple(expected):
            raise ValueError(f"pipeline stage {stage} produced {tuple(output.shape)} but the next stage "
                             f"expects {tuple(expected)} from seq_length / micro_batch_size; pass the "
                             f"batch's shape or set variable_seq_lengths")
        if output.dtype != self.config.pipeline_dtype:
            raise ValueError(f"pipeline stage {stage} produced {output.dtype} activations but "
                             f"pipeline_dtype is {self.config.pipeline_dtype}; set pipeline_dtype to match")

    def _backward(self, action: Action):
        chunk, m = action.chunk, action.microbatch
        stage = chunk * self.pp_size + self.pp_rank
        input_tensor, output = self.saved.pop((chunk, m))
        output_grad = None if stage == self.num_stages - 1 else self.received.pop(action).get()
        self.backwards_left -= 1
        last_of_chunk = m == self.num_microbatches - 1
        if last_of_chunk and chunk in self.grad_sync_off:
            self.grad_sync_off.pop(chunk).close()
        if self.backwards_left == 0 and "all" in self.grad_sync_off:
            self.grad_sync_off.pop("all").close()
        self._set_vp_rank(chunk)
        input_grad = backward_step(input_tensor, output, output_grad, self.config)
        if last_of_chunk and self.config.grad_sync_func is not None:
            _per_chunk(self.config.grad_sync_func, chunk)(self.models[chunk].parameters())
        return input_grad
