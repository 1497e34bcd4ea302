"""Per-layer CUDA graphs (Megatron's `cuda_graph_impl='local'`, scope 'full'), and what local
CUDA graphs can capture soundly (`check_cuda_graph_config`).

A TransformerBlock built with cuda_graph_impl='local' holds a `LayerCudaGraphs`. It stays out of
the way (the layers run eagerly) until the training loop calls `enable_layer_cuda_graphs` after
`cuda_graph_warmup_steps` eager steps. From then on, a training forward with autograd through
the block captures, on first use of an input signature (shapes, dtypes of hidden states, mask and
RoPE angles), a forward and a backward CUDA graph for each layer, then replays them:

- capture: one eager forward and backward on a side stream (lazy initialisation stays out of the
  graphs), then the layers' forwards in order and their backwards in reverse order, all into one
  private memory pool, in the order they replay, so memory reused between captures is dead when
  it is overwritten (as `torch.cuda.make_graphed_callables` does; ours chains each layer's static
  output into the next layer's static input, so nothing is copied between layers, and captures
  with capture_error_mode='thread_local', so a data-loader thread pinning memory cannot break it);
- replay: one autograd node per layer (`_ReplayLayer`) replays the layer's forward graph, and in
  backward its backward graph, returning the parameter gradients to autograd, so they reach
  `param.grad`, fire the DDP hooks and land in `main_grad` exactly as in eager mode (DDP's hook
  moves each one out of its static buffer before the next replay overwrites it, which is why
  the model must be DDP-wrapped).

A capture is busy from its forward until its first layer's backward. Micro-batches that run
forward and backward in turn (no pipelining) reuse one capture; a micro-batch entering the block
while others wait for their backward (pipeline schedules) takes a free capture of its signature
or captures a new one, each in its own pool, so any interleaving is safe.
"""

import warnings

import torch

CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
CUDA_GRAPH_SCOPES = ("full", "attn", "full_iteration")
NEED_CUDA = "CUDA graphs need a CUDA device; drop --cuda-graph-impl"
# Eager forward-backward passes on the capture stream before a capture (cuBLAS workspaces,
# autotuning and other lazy initialisation must not happen inside a graph).
SIDE_STREAM_WARMUP_ITERS = 2


def check_cuda_graph_config(config) -> None:
    """Map Megatron's deprecated switches onto cuda_graph_impl, then refuse what local CUDA graphs
    cannot capture soundly. Called by TransformerConfig.__post_init__."""
    _map_deprecated_switches(config)
    impl, scope = config.cuda_graph_impl, config.cuda_graph_scope
    if impl not in CUDA_GRAPH_IMPLS:
        raise ValueError(f"cuda_graph_impl={impl!r} is not valid; use 'none', 'local' or 'transformer_engine'")
    if scope not in CUDA_GRAPH_SCOPES:
        raise ValueError(f"cuda_graph_scope={scope!r} is not valid; use 'full' (each transformer layer) or "
                         "'full_iteration' (the whole forward-backward of a step)")
    if config.cuda_graph_warmup_steps < 0:
        raise ValueError(f"cuda_graph_warmup_steps must be >= 0, got {config.cuda_graph_warmup_steps}")
    if impl == "transformer_engine":
        raise ValueError("cuda_graph_impl='transformer_engine' captures through Transformer Engine, which "
                         "teratron does not use; use cuda_graph_impl='local'")
    if impl == "none":
        if scope == "full_iteration":
            raise ValueError("cuda_graph_scope='full_iteration' needs cuda_graph_impl='local'")
        return
    if scope == "attn":
        raise ValueError("cuda_graph_scope='attn' is Transformer Engine's attention-only capture; "
                         "cuda_graph_impl='local' captures whole layers ('full') or the step ('full_iteration')")
    _check_local_graphs(config)


def _map_deprecated_switches(config) -> None:
    if config.external_cuda_graph:
        raise ValueError("external_cuda_graph is deprecated and means cuda_graph_impl='transformer_engine' "
                         "(Transformer Engine, which teratron does not use); use cuda_graph_impl='local'")
    if config.enable_cuda_graph:
        if config.cuda_graph_impl != "none":
            raise ValueError("enable_cuda_graph is the deprecated spelling of cuda_graph_impl='local'; "
                             "set only cuda_graph_impl")
        warnings.warn("enable_cuda_graph is deprecated; use cuda_graph_impl='local'")
        config.cuda_graph_impl = "local"
        # Migrated: cleared so dataclasses.replace (which re-runs this) does not see both.
        config.enable_cuda_graph = False


def _check_local_graphs(config) -> None:
    what = "cuda_graph_impl='local'"
    if config.recompute_granularity is not None:
        raise ValueError(f"{what} does not support activation recompute (recompute_granularity="
                         f"{config.recompute_granularity!r}): the recompute swaps generator states, which "
                         "a graph cannot replay; drop one")
    # The TP RNG tracker forks by swapping the CUDA generator's state, which a graph cannot
    # replay; dropout on the default generator is graph-safe (each replay advances its offset).
    if config.attention_dropout > 0:
        raise ValueError(f"{what} needs attention_dropout=0 (got {config.attention_dropout}): attention dropout "
                         "draws from the TP RNG tracker, whose state swaps a graph cannot replay; set it to 0")
    if config.hidden_dropout > 0 and config.sequence_parallel:
        raise ValueError(f"{what} with sequence_parallel needs hidden_dropout=0 (got {config.hidden_dropout}): "
                         "it then draws from the TP RNG tracker, whose state swaps a graph cannot replay; set "
                         "hidden_dropout=0 or drop sequence_parallel")
    if config.num_moe_experts is not None:
        raise ValueError(f"{what} does not support MoE layers (num_moe_experts={config.num_moe_experts}): token "
                         "routing has data-dependent shapes; drop one")
    if config.fp8 is not None:
        raise ValueError(f"{what} is not combined with fp8 yet (fp8={config.fp8!r}); drop one")
    if config.fine_grained_activation_offloading:
        raise ValueError(f"{what} does not support fine_grained_activation_offloading: its host copies and "
                         "backward hooks would run only while capturing; drop one")
    if config.gradient_accumulation_fusion:
        raise ValueError(f"{what} does not support gradient_accumulation_fusion: the flag telling DDP's hook "
                         "that the GEMM already added a weight's gradient is set in Python, which a replay "
                         "skips; drop one")
    pp = config.pipeline_model_parallel_size
    if config.cuda_graph_scope == "full_iteration":
        if pp > 1:
            raise ValueError(f"cuda_graph_scope='full_iteration' needs pipeline_model_parallel_size=1 (got {pp}): "
                             "pipeline transfers wait on other ranks inside the step; use cuda_graph_scope='full'")
        if config.cuda_graph_warmup_steps < 1:
            raise ValueError("cuda_graph_scope='full_iteration' needs cuda_graph_warmup_steps >= 1: the eager "
                             "steps compile kernels and set up cuBLAS/NCCL, which must not happen while capturing")
        return
    if config.enable_autocast:
        raise ValueError(f"{what} with per-layer graphs does not support enable_autocast: autocast's weight-cast "
                         "cache would outlive the graphs; train in bf16/fp16 params instead")
    if config.cuda_graph_use_single_mempool and pp > 1:
        raise ValueError("cuda_graph_use_single_mempool=True with pipeline parallelism is not supported: "
                         "teratron captures each in-flight micro-batch's layer graphs in a pool of its own; "
                         "leave it False")


def enable_layer_cuda_graphs(model_chunks) -> int:
    """Switch on the per-layer graphs of every TransformerBlock in `model_chunks`; returns how many
    blocks have them (0 unless built with cuda_graph_impl='local', scope 'full')."""
    managers = [m.cuda_graphs for chunk in model_chunks for m in chunk.modules()
                if isinstance(getattr(m, "cuda_graphs", None), LayerCudaGraphs)]
    for manager in managers:
        manager.enabled = True
    return len(managers)


class LayerCudaGraphs:
    """The CUDA graphs of one TransformerBlock's layers (see the module docstring)."""

    def __init__(self, layers, retain_backward_graph: bool = False):
        self.layers = layers
        self.retain_backward_graph = retain_backward_graph
        self.enabled = False
        self.captures = {}  # input signature -> [_LayerGraphs]

    def active(self, training: bool) -> bool:
        """Whether the block's forward goes through the graphs (evaluation stays eager)."""
        return self.enabled and training and torch.is_grad_enabled()

    def __call__(self, hidden_states, attention_mask, rotary_pos_emb):
        """[s, b, h] -> [s, b, h] through the layers' graphs, capturing them on first use."""
        if hidden_states.device.type != "cuda":
            raise ValueError(NEED_CUDA)
        key = tuple(_signature(t) for t in (hidden_states, attention_mask, rotary_pos_emb))
        captures = self.captures.setdefault(key, [])
        graphs = next((c for c in captures if not c.busy), None)
        if graphs is None:
            graphs = _LayerGraphs(self.layers, hidden_states, attention_mask, rotary_pos_emb,
                                  self.retain_backward_graph)
            captures.append(graphs)
        return graphs.run(hidden_states, attention_mask, rotary_pos_emb)


def _signature(t):
    return None if t is None else (tuple(t.shape), t.dtype, t.device, t.requires_grad)


class _LayerGraphs:
    """One capture of a block's layers: a forward and a backward graph per layer, one pool."""

    def __init__(self, layers, hidden_states, attention_mask, rotary_pos_emb, retain_backward_graph):
        for t in (attention_mask, rotary_pos_emb):
            if t is not None and t.requires_grad:
                raise ValueError("CUDA-graphed layers take attention_mask and rotary_pos_emb as constants; "
                                 "pass them without requires_grad")
        self.params = [tuple(p for p in layer.parameters() if p.requires_grad) for layer in layers]
        if not all(hasattr(p, "main_grad") for params in self.params for p in params):
            raise ValueError("CUDA-graphed layers hand out parameter gradients in static buffers: wrap the "
                             "model in teratron.distributed.DistributedDataParallel, whose hook moves them "
                             "into main_grad")
        self.busy = False
        self.mask = None if attention_mask is None else attention_mask.detach().clone()
        self.rope = None if rotary_pos_emb is None else rotary_pos_emb.detach().clone()
        # The first layer's static input; layer i > 0 reads layer i-1's static output.
        self.input = hidden_states.detach().clone().requires_grad_(True)
        current = torch.cuda.current_stream(hidden_states.device)
        self.stream = torch.cuda.Stream(device=hidden_states.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(SIDE_STREAM_WARMUP_ITERS):
                self._eager_forward_backward(layers)
        self._capture(layers, retain_backward_graph)
        current.wait_stream(self.stream)

    def _run_layer(self, layer, x):
        return layer(x, attention_mask=self.mask, rotary_pos_emb=self.rope)[0]

    def _eager_forward_backward(self, layers):
        out = self.input
        for layer in layers:
            out = self._run_layer(layer, out)
        params = tuple(p for ps in self.params for p in ps)
        torch.autograd.grad((out,), (self.input,) + params, grad_outputs=(torch.ones_like(out),),
                            allow_unused=True)

    def _capture(self, layers, retain_backward_graph):
        pool = torch.cuda.graph_pool_handle()

        def graph_context(graph):
            return torch.cuda.graph(graph, pool=pool, stream=self.stream, capture_error_mode="thread_local")

        self.forward_graphs = [torch.cuda.CUDAGraph() for _ in layers]
        self.backward_graphs = [torch.cuda.CUDAGraph() for _ in layers]
        self.inputs, self.outputs = [], []
        x = self.input
        for layer, graph in zip(layers, self.forward_graphs):
            with graph_context(graph):
                out = self._run_layer(layer, x)
            self.inputs.append(x)
            self.outputs.append(out)
            x = out.detach().requires_grad_(True)  # same storage: no copy between layers
        # Backward graphs in reverse order; layer i's output gradient is layer i+1's input gradient.
        self.grad_outputs = [None] * len(layers)
        self.grads = [None] * len(layers)  # per layer: (input grad, *parameter grads)
        grad = torch.zeros_like(self.outputs[-1])
        for i in reversed(range(len(layers))):
            self.grad_outputs[i] = grad
            with graph_context(self.backward_graphs[i]):
                self.grads[i] = torch.autograd.grad(
                    (self.outputs[i],), (self.inputs[i],) + self.params[i], grad_outputs=(grad,),
                    allow_unused=True, retain_graph=retain_backward_graph)
            grad = self.grads[i][0]

    def run(self, hidden_states, attention_mask, rotary_pos_emb):
        self.busy = True
        with torch.no_grad():
            if self.mask is not None:
                self.mask.copy_(attention_mask)
            if self.rope is not None:
                self.rope.copy_(rotary_pos_emb)
        for i, params in enumerate(self.params):
            hidden_states = _ReplayLayer.apply(self, i, hidden_states, *params)
        return hidden_states

    def replay_forward(self, i, hidden_states):
        if self.inputs[i].data_ptr() != hidden_states.data_ptr():
            self.inputs[i].copy_(hidden_states)
        self.forward_graphs[i].replay()
        out = self.outputs[i]
        # The block's output leaves the graphs' memory: a later replay must not change it.
        return out.clone() if i == len(self.outputs) - 1 else out.detach()

    def replay_backward(self, i, grad_output):
        if self.grad_outputs[i].data_ptr() != grad_output.data_ptr():
            self.grad_outputs[i].copy_(grad_output)
        self.backward_graphs[i].replay()
        input_grad, *param_grads = self.grads[i]
        if i == 0:
            input_grad = input_grad.clone()  # leaves the graphs' memory (may be sent to another stage)
            self.busy = False
        else:
            input_grad = input_grad.detach()
        return input_grad, [None if g is None else g.detach() for g in param_grads]


class _ReplayLayer(torch.autograd.Function):
    """Layer i of a capture as one autograd node: forward and backward replay its graphs."""

    @staticmethod
    def forward(ctx, graphs, i, hidden_states, *params):
        ctx.graphs, ctx.index = graphs, i
        return graphs.replay_forward(i, hidden_states)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        input_grad, param_grads = ctx.graphs.replay_backward(ctx.index, grad_output)
        return (None, None, input_grad if ctx.needs_input_grad[2] else None, *param_grads)
