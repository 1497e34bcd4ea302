"""Causal sliding-window attention on cuDNN's fused attention, the band native to the kernel.

A causal window (W, 0) (Megatron's meaning) lets query i see keys i - W .. i: exactly W keys back
and itself. cuDNN's SDPA masks a diagonal band natively, forward and backward, skipping the key
tiles outside it, so the kernels do about the visible keys' work. Through the cuDNN frontend's
Python package (`nvidia-cudnn-frontend`, import name `cudnn`; `pip install teratron[cudnn]`):
the band is top-left aligned, `diagonal_band_right_bound` 0 (causal) and
`diagonal_band_left_bound` L, which masks the keys at or before column i - L; so L = W + 1 keeps
keys i - W .. i. A window reaching the first key from every query (W >= s - 1) is plain causal:
no left bound then.

One forward graph (with the softmax statistics, L = log-sum-exp per query row in fp32) and one
backward graph are built per (kind, shapes, strides, dtype, left bound, scale, device,
determinism) and cached, each with the fastest of cuDNN's execution plans, timed on its first
inputs (the heuristic's plan under deterministic algorithms, whose runs must not depend on a
timing, and during CUDA graph capture); they run on the current torch CUDA stream with a workspace
from torch's allocator. q [b, n, s, h], k and v [b, g, s, h] (GQA: g divides n) are passed by
their strides, so the layer's [s, b, n, h] views go in without a copy (a tensor cuDNN cannot address, e.g. an
expanded gradient, is copied first). The output and the gradients are allocated [s, b, *, h] in
memory, as the layer lays them out.

The kernels are two custom ops (`teratron::cudnn_window_forward` / `_backward`), so a layer
compiled whole traces through them without a graph break; in eager mode the autograd function calls
their bodies directly, and the handle's stream is set only when it changes (the host path of a step:
1.19 -> 0.89 ms at 16,384 tokens, bench/RESULTS.md session 24); `cudnn` is imported when an op first
runs, never on the CPU. `available` says whether a layer's inputs can run here. The frontend
1.16.0 has no attention-sink input: layers with a sink stay on FlexAttention.
"""

import contextlib
import functools
import importlib.util
import warnings

import torch

# Whether the frontend is installed, found without importing it (cheap, and constant inside a compiled layer).
PACKAGE_FOUND = importlib.util.find_spec("cudnn") is not None


def _head_dims_fit(hq: int, hv: int, capability) -> bool:
    """cuDNN's fused attention support for head sizes (query/key hq, value hv), forward and
    backward: multiples of 8; equal and at most 128 everywhere, up to 256 on Hopper (sm 9.x), where
    MLA's 192 / 128 also runs."""
    if hq % 8 or hv % 8:
        return False
    if capability[0] == 9:
        return (hq == hv and hq <= 256) or (hq, hv) == (192, 128)
    return hq == hv and hq <= 128


def fits(q, k, v, window, causal: bool, dropout_p: float, sink, capability) -> bool:
    """`available` without the device and package checks (capability: the GPU's (major, minor))."""
    return (window is not None and causal and dropout_p == 0 and sink is None
            and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0 and capability >= (8, 0)
            and _head_dims_fit(q.shape[-1], v.shape[-1], capability))


def available(q, k, v, window, causal: bool, dropout_p: float, sink) -> bool:
    """Whether a layer's attention (q [b, n, s, hq], k [b, g, s, hq], v [b, g, s, hv]) can run
    here: CUDA, the frontend installed, a window on a causal self-attention layer (sq = sk, no
    explicit mask), no attention dropout, no sink, 16-bit, head sizes cuDNN supports."""
    if not (q.is_cuda and PACKAGE_FOUND):
        return False
    return fits(q, k, v, window, causal, dropout_p, sink, _capability(q.device))


def _capability(device):
    """The GPU's (major, minor): cached in eager mode (a layer asks every step); asked directly while
    torch.compile traces (once per graph), which does not trace through a cache."""
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(device)
    return _cached_capability(_device_index(device))


_cached_capability = functools.cache(torch.cuda.get_device_capability)


def left_bound(window_left: int, s: int):
    """cuDNN's `diagonal_band_left_bound` for Megatron's left window over s tokens: W + 1 (it masks
    keys at or before i - bound), None (no bound, plain causal) when the window is unbounded (-1)
    or already reaches the first key from every query."""
    if window_left < 0 or window_left >= s - 1:
        return None
    return window_left + 1


def cudnn_window_attention(q, k, v, window_left: int, scale: float):
    """q [b, n, s, hq], k [b, g, s, hq], v [b, g, s, hv] (16-bit, CUDA) -> [b, n, s, hv]: each query
    sees itself and the `window_left` keys before it (-1: every key before it)."""
    return _CudnnWindowAttention.apply(q, k, v, window_left, scale)


class _CudnnWindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window_left, scale):
        # the ops themselves in eager mode (the custom ops' dispatch only serves tracing)
        forward = cudnn_window_forward if torch.compiler.is_compiling() else _forward
        out, stats = forward(q, k, v, window_left, scale)
        ctx.window_left, ctx.scale = window_left, scale
        ctx.save_for_backward(q, k, v, out, stats)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, stats = ctx.saved_tensors
        backward = cudnn_window_backward if torch.compiler.is_compiling() else _backward
        dq, dk, dv = backward(dout, q, k, v, out, stats, ctx.window_left, ctx.scale)
        return dq, dk, dv, None, None


def _like_layer(t, b: int, heads: int, s: int, h: int, dtype=None):
    """An empty [b, heads, s, h] laid out [s, b, heads, h] in memory, on t's device."""
    return torch.empty(s, b, heads, h, dtype=dtype or t.dtype, device=t.device).permute(1, 2, 0, 3)


def _stats_like(q):
    """The softmax statistics [b, n, s, 1] fp32, contiguous."""
    b, n, s, _ = q.shape
    return torch.empty(b, n, s, 1, dtype=torch.float32, device=q.device)


@torch.library.custom_op("teratron::cudnn_window_forward", mutates_args=())
def cudnn_window_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, n, s, hv] laid out [s, b, n, hv], stats [b, n, s, 1] fp32: log-sum-exp of the
    scaled scores each query sees)."""
    return _forward(q, k, v, window_left, scale)


def _forward(q, k, v, window_left: int, scale: float):
    q, k, v = (_addressable(t) for t in (q, k, v))
    b, n, s, _ = q.shape
    out, stats = _like_layer(q, b, n, s, v.shape[-1]), _stats_like(q)
    tensors = dict(q=q, k=k, v=v, o=out, stats=stats)
    graph = _graph("forward", left_bound(window_left, s), scale, torch.are_deterministic_algorithms_enabled(),
                   tensors)
    _execute(graph, tensors, q.device)
    return out, stats


@cudnn_window_forward.register_fake
def _(q, k, v, window_left, scale):
    b, n, s, _ = q.shape
    return _like_layer(q, b, n, s, v.shape[-1]), _stats_like(q)


@torch.library.custom_op("teratron::cudnn_window_backward", mutates_args=())
def cudnn_window_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          stats: torch.Tensor, window_left: int,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v (laid out [s, b, *, h]) given the forward's output and statistics."""
    return _backward(dout, q, k, v, out, stats, window_left, scale)


def _backward(dout, q, k, v, out, stats, window_left: int, scale: float):
    dout, q, k, v, out = (_addressable(t) for t in (dout, q, k, v, out))
    dq, dk, dv = _gradients_like(q, k, v)
    tensors = dict(q=q, k=k, v=v, o=out, dO=dout, stats=stats, dQ=dq, dK=dk, dV=dv)
    graph = _graph("backward", left_bound(window_left, q.shape[2]), scale,
                   torch.are_deterministic_algorithms_enabled(), tensors)
    _execute(graph, tensors, q.device)
    return dq, dk, dv


@cudnn_window_backward.register_fake
def _(dout, q, k, v, out, stats, window_left, scale):
    return _gradients_like(q, k, v)


def _gradients_like(q, k, v):
    return tuple(_like_layer(t, t.shape[0], t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v))


def _addressable(t):
    """t as cuDNN can address it: unit stride in the head dim, the other strides positive
    multiples of 8 elements (16 bytes), a 16-byte aligned start; else a contiguous copy."""
    if t.stride(-1) == 1 and all(st > 0 and st % 8 == 0 for st in t.stride()[:-1]) and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@functools.cache
def _cudnn():
    """The frontend, imported on first use. Asking torch for cuDNN's version first loads torch's
    libcudnn, which the frontend then finds by its soname if it finds none of its own."""
    torch.backends.cudnn.version()
    import cudnn
    return cudnn


_HANDLES = {}  # device index -> cuDNN handle (one per device, for the process)
_HANDLE_STREAMS = {}  # device index -> the stream its handle was last set to


def _handle(device):
    index = _device_index(device)
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = _cudnn().create_handle()
    return _HANDLES[index]


_GRAPHS = {}  # (kind, left bound, scale, deterministic, device, dtype, shapes and strides) -> `_build`'s


def _graph(kind: str, bound, scale: float, deterministic: bool, tensors: dict):
    """`_build`'s graph of `kind` ('forward' / 'backward') for these tensors' shapes and strides;
    cached."""
    q = tensors["q"]
    key = (kind, bound, scale, deterministic, str(q.device), q.dtype,
           tuple((name, tuple(t.shape), t.stride()) for name, t in tensors.items()))
    if key not in _GRAPHS:
        _GRAPHS[key] = _build(kind, bound, scale, deterministic, tensors)
    return _GRAPHS[key]


def _build(kind: str, bound, scale: float, deterministic: bool, tensors: dict):
    """(graph, its cuDNN tensors by name, the plan to run: an index, or None for the heuristic's).
    Every plan cuDNN offers is built and the fastest on these tensors kept (session 11 measured the
    band's fastest plan 4 % ahead of heuristic A's first at window 1,024 of 16,384), except where a
    timed choice must not vary between runs (deterministic algorithms) or cannot run (CUDA graph
    capture): there the heuristic's."""
    cudnn = _cudnn()
    graph, described = _operation_graph(kind, bound, scale, deterministic, tensors)
    if not (deterministic or torch.cuda.is_current_stream_capturing()):
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans(cudnn.build_plan_policy.ALL)
            pack = {described[name]: t for name, t in tensors.items()}
            plan = fastest_plan(graph.get_execution_plan_count(),
                                lambda index: _time_plan(graph, pack, index, tensors["q"].device))
            if plan is not None:
                return graph, described, plan
        except Exception as error:  # noqa: BLE001 - a choice of speed only: the heuristic's plan serves
            _warn_once(f"cuDNN sliding-window attention: timing its plans failed ({type(error).__name__}: "
                       f"{str(error).splitlines()[0][:200]}); running the heuristic's plan")
        graph, described = _operation_graph(kind, bound, scale, deterministic, tensors)
    graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return graph, described, None


def fastest_plan(count: int, time_plan):
    """The index in range(count) whose `time_plan(index)` (ms) is least, plans that raise skipped;
    None when none runs."""
    times = {}
    for index in range(count):
        try:
            times[index] = time_plan(index)
        except Exception:  # noqa: BLE001 - a plan that cannot run these tensors
            continue
    return min(times, key=times.get) if times else None


def _time_plan(graph, pack: dict, index: int, device, repeats: int = 5) -> float:
    """ms per run of plan `index` on the current stream (after one untimed run)."""
    handle = _handle(device)
    with torch.cuda.device(device):
        workspace = torch.empty(graph.get_workspace_size_plan_at_index(index), dtype=torch.uint8, device=device)
        _set_stream(handle, _device_index(device))
        graph.execute_plan_at_index(pack, workspace, index, handle=handle)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.execute_plan_at_index(pack, workspace, index, handle=handle)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / repeats


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message)


def _operation_graph(kind: str, bound, scale: float, deterministic: bool, tensors: dict):
    """The unbuilt cuDNN graph of `kind` over these tensors and its cuDNN tensors by name."""
    cudnn = _cudnn()
    io_type = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[tensors["q"].dtype]
    graph = cudnn.pygraph(io_data_type=io_type, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=_handle(tensors["q"].device))

    def described(name):
        t = tensors[name]
        data_type = cudnn.data_type.FLOAT if t.dtype == torch.float32 else io_type
        return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=data_type)

    band = dict(attn_scale=scale, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                diagonal_band_left_bound=bound, diagonal_band_right_bound=0)
    if kind == "forward":
        inputs = {name: described(name) for name in ("q", "k", "v")}
        outputs = dict(zip(("o", "stats"), graph.sdpa(name="sdpa", **inputs, generate_stats=True, **band)))
    else:
        inputs = {name: described(name) for name in ("q", "k", "v", "o", "dO", "stats")}
        outputs = dict(zip(("dQ", "dK", "dV"), graph.sdpa_backward(
            name="sdpa_backward", **inputs, use_deterministic_algorithm=deterministic, **band)))
    for name, output in outputs.items():
        t = tensors[name]
        output.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride()))
        if t.dtype == torch.float32:
            output.set_data_type(cudnn.data_type.FLOAT)
    return graph, {**inputs, **outputs}


def _device_index(device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _set_stream(handle, index):
    """Points device `index`'s handle at the current stream (a call to cuDNN only when it changed)."""
    stream = torch.cuda.current_stream().cuda_stream
    if _HANDLE_STREAMS.get(index) != stream:
        _cudnn().set_stream(handle=handle, stream=stream)
        _HANDLE_STREAMS[index] = stream


def _execute(built, tensors: dict, device):
    graph, described, plan = built
    index = _device_index(device)
    handle = _handle(device)
    pack = {described[name]: t for name, t in tensors.items()}
    with contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index):
        _set_stream(handle, index)
        if plan is None:
            workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
            graph.execute(pack, workspace, handle=handle)
        else:
            workspace = torch.empty(graph.get_workspace_size_plan_at_index(plan), dtype=torch.uint8, device=device)
            graph.execute_plan_at_index(pack, workspace, plan, handle=handle)
