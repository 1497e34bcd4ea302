"""CUDA graphs in the training loop (`--cuda-graph-impl local`), including Megatron's
full-iteration CUDA graph (`--cuda-graph-scope full_iteration`).

    forward_backward = training_forward_backward_func(model)
    log_dicts = forward_backward(forward_step_func=..., data_iterator=..., model=model, ...)

It stands in for `get_forward_backward_func()` in the training step. The first
`cuda_graph_warmup_steps` steps run eagerly (`cuda_graph_phase`); then
- scope 'full': the blocks' per-layer graphs are switched on (`transformer.cuda_graphs`), and
  captured on first use;
- scope 'full_iteration': `FullIterationCudaGraph` captures the forward and backward of all
  micro-batches of the step (no pipelining) as one graph and replays it every step. The
  optimizer step stays outside, as in Megatron.

Inside the full-iteration graph nothing may wait for the CPU and nothing may change address
between steps, hence:
- each step's micro-batches are read from the data iterator first and copied into static device
  buffers, which the captured forward steps read (a batch whose keys or shapes differ from the
  captured ones is an error);
- gradients accumulate into DDP's main_grad inside the graph (the buffers are zeroed in place
  before each step); the data-parallel reduction and the rest of `finalize_model_grads` run after
  the replay, with the token count the graph computed;
- the loss scale the schedule multiplies by is a device scalar refreshed before each replay;
- the logged losses are the captured log tensors, read after the replay.
The warm-up steps run on the side stream the graph is captured on, so the capture finds it
initialised.
"""

import torch

from teratron.pipeline_parallel.microbatch_step import as_chunk_list, get_model_config
from teratron.transformer.cuda_graphs import NEED_CUDA, enable_layer_cuda_graphs


def cuda_graph_phase(steps_done: int, warmup_steps: int) -> str:
    """'eager' for the warm-up steps, 'capture' for the step after them, then 'replay'."""
    if steps_done < warmup_steps:
        return "eager"
    return "capture" if steps_done == warmup_steps else "replay"


def training_forward_backward_func(model_chunks):
    """The forward-backward function of a training step: the schedule, wrapped as the model's
    config.cuda_graph_impl / cuda_graph_scope ask."""
    from teratron.pipeline_parallel.schedules import get_forward_backward_func

    config = get_model_config(model_chunks[0])
    schedule = get_forward_backward_func()
    if config.cuda_graph_impl != "local":
        return schedule
    if config.cuda_graph_scope == "full_iteration":
        return FullIterationCudaGraph(schedule, config.cuda_graph_warmup_steps)
    return LayerCudaGraphSteps(schedule, config.cuda_graph_warmup_steps)


class LayerCudaGraphSteps:
    """The schedule; the model's per-layer graphs are switched on after the warm-up steps."""

    def __init__(self, forward_backward_func, warmup_steps: int):
        self.forward_backward_func = forward_backward_func
        self.warmup_steps = warmup_steps
        self.steps = 0

    def __call__(self, *, model, **kwargs):
        if cuda_graph_phase(self.steps, self.warmup_steps) == "capture":
            enable_layer_cuda_graphs(model if isinstance(model, (list, tuple)) else [model])
        self.steps += 1
        return self.forward_backward_func(model=model, **kwargs)


class FullIterationCudaGraph:
    """Megatron's full-iteration CUDA graph around a no-pipelining forward-backward function."""

    def __init__(self, forward_backward_func, warmup_steps: int):
        self.forward_backward_func = forward_backward_func
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.graph = None
        self.stream = None
        self.batches = None        # static micro-batches: [{key: device tensor}]
        self.loss_scale = None     # device scalar the captured loss is multiplied by
        self.log_dicts = None      # the captured step's log dicts (graph memory)
        self.finalize_args = None  # (model_chunks, num_tokens) the schedule handed to finalize

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int, forward_only=False,
                 **kwargs):
        if forward_only:
            raise ValueError("the full-iteration CUDA graph runs training steps; evaluate with the schedule "
                             "from get_forward_backward_func()")
        chunks = as_chunk_list(model, "model", 1)
        config = get_model_config(chunks[0])
        device = next(chunks[0].parameters()).device
        if device.type != "cuda":
            raise ValueError(NEED_CUDA)
        self._load_batches([next(data_iterator) for _ in range(num_microbatches)], device)
        finalize, grad_scale = config.finalize_model_grads_func, config.grad_scale_func
        if grad_scale is not None:
            self.loss_scale.copy_(grad_scale(torch.ones((), device=device)))
        config.finalize_model_grads_func = self._record_finalize_args
        config.grad_scale_func = None if grad_scale is None else self._scale_loss
        phase = cuda_graph_phase(self.steps, self.warmup_steps)
        schedule_kwargs = dict(forward_step_func=forward_step_func, model=model,
                               num_microbatches=num_microbatches, forward_only=False, **kwargs)
        try:
            if phase == "eager":
                log_dicts = self._on_side_stream(device, lambda: self._schedule(schedule_kwargs))
            else:
                if phase == "capture":
                    self.graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local"):
                        self.log_dicts = self._schedule(schedule_kwargs)
                self.graph.replay()
                log_dicts = list(self.log_dicts)
        finally:
            config.finalize_model_grads_func, config.grad_scale_func = finalize, grad_scale
        self.steps += 1
        if finalize is not None:
            finalize(*self.finalize_args)
        return log_dicts

    def _schedule(self, kwargs):
        return self.forward_backward_func(data_iterator=iter(self.batches), **kwargs)

    def _on_side_stream(self, device, fn):
        current = torch.cuda.current_stream(device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            result = fn()
        current.wait_stream(self.stream)
        return result

    def _load_batches(self, batches, device) -> None:
        """Copy this step's micro-batches into the static buffers (allocated at the first step)."""
        batches = [{k: v for k, v in b.items() if isinstance(v, torch.Tensor)} for b in batches]
        if self.batches is None:
            self.batches = [{k: torch.empty(v.shape, dtype=v.dtype, device=device) for k, v in b.items()}
                            for b in batches]
            self.loss_scale = torch.ones((), device=device)
            self.stream = torch.cuda.Stream(device=device)
        if len(batches) != len(self.batches):
            raise ValueError(f"the full-iteration CUDA graph was captured for {len(self.batches)} micro-batches "
                             f"per step, this step has {len(batches)}; keep the global batch size fixed")
        for static, batch in zip(self.batches, batches):
            if _layout(batch) != _layout(static):
                raise ValueError(f"the full-iteration CUDA graph was captured for micro-batches "
                                 f"{_shapes(static)}, got {_shapes(batch)}; every micro-batch must keep them")
            with torch.no_grad():
                for key, value in batch.items():
                    static[key].copy_(value, non_blocking=True)

    def _scale_loss(self, loss):
        return loss * self.loss_scale

    def _record_finalize_args(self, model_chunks, num_tokens=None):
        self.finalize_args = (model_chunks, num_tokens)


def _layout(batch) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in batch.items()}


def _shapes(batch) -> str:
    return ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in batch.items())
