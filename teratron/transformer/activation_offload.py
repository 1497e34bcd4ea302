"""Fine-grained activation offloading (Megatron's `--fine-grained-activation-offloading`).

What autograd saves for backward inside the forward of chosen submodules (`offload_modules`)
is copied to host memory as it is saved and copied back before backward needs it:

    attn_norm   input_layernorm      mlp_norm    pre_mlp_layernorm
    qkv_linear  linear_qkv           mlp         the dense MLP (fc1, activation, fc2)
    core_attn   core attention       expert_fc1  the experts' first linear
    attn_proj   linear_proj          moe_act     the experts' activation

The unit is the storage: views of one storage (v of the fused QKV output, the experts' token
chunks) share one host copy and come back as views with their original offsets and strides, so
backward runs on bit-identical memory. Left in place, through the enclosing saved-tensors hooks
if any: parameters and their views, storages under `min_offloaded_tensor_size` elements, tensors
not on the layer's device (already on the host).

Forward: a storage's copy is queued on a side stream when it is first saved (CUDA: pinned host
memory, `record_stream` keeps the allocator from reusing the device memory before the copy
ends). The layer holds the saved device tensors until its forward ends, so within a layer the
memory is that of a run without offloading and no freed address can be mistaken for a saved
storage; after it, autograd holds only the host copies.

Backward: a hook on the layer's output fires when backward reaches the layer; it starts the
copy back of this layer's storages (unless already prefetched) and of the layer that produced
this layer's input, so that copy runs during this layer's backward. Unpacking waits for its copy
and hands autograd a view of the reloaded storage; once every saved view of a storage is back
in autograd's hands the offloader drops its reference.

State is per layer forward (one micro-batch through one layer): the saved handles and the output
hook hold it, so the micro-batches a pipeline schedule keeps in flight never share state, and
prefetch follows the data (never across model chunks or micro-batches). Modules under selective
recompute save nothing and are not offloaded; layers recomputed in backward (full recompute) are
not offloaded either. On CPU the same path runs with synchronous copies into ordinary memory.
"""

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp", "expert_fc1",
                   "moe_act")


@dataclass
class OffloadStats:
    """Bytes copied to the host per module (a storage counts for the module that saved it
    first) and bytes copied back, since the last reset."""

    offloaded: dict = field(default_factory=lambda: defaultdict(int))
    reloaded: int = 0

    def reset(self) -> None:
        self.offloaded.clear()
        self.reloaded = 0


stats = OffloadStats()
_current = None  # the _LayerGroup of the layer whose forward is running


class _Copier:
    """Copies uint8 buffers between a device and the host: on CUDA on two side streams, one per
    direction (so offloads of one micro-batch and reloads of another overlap), elsewhere
    synchronously."""

    def __init__(self, device: torch.device):
        self.device = device
        self.streams = None
        if device.type == "cuda":
            self.streams = {"cpu": torch.cuda.Stream(device), "cuda": torch.cuda.Stream(device)}

    def copy(self, src, to: torch.device, after=None):
        """A new copy of `src` on `to`, started after event `after`, and the event that marks
        it done (None: already done)."""
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=to,
                          pin_memory=self.streams is not None and to.type == "cpu")
        if self.streams is None:
            dst.copy_(src)
            return dst, None
        stream = self.streams[to.type]
        # The source is written and the destination's memory is free in the compute stream's order.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        for t in (src, dst):
            if t.is_cuda:  # the allocator must not hand its memory out before the copy ends
                t.record_stream(stream)
        return dst, stream.record_event()

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


_copiers = {}


def _copier(device: torch.device) -> _Copier:
    if device not in _copiers:
        _copiers[device] = _Copier(device)
    return _copiers[device]


class _HostCopy:
    """One offloaded storage: its host copy, and its device copy while backward needs it."""

    def __init__(self, storage_bytes, copier: _Copier):
        self.copier = copier
        self.host, self.offloaded = copier.copy(storage_bytes, torch.device("cpu"))
        self.on_device = self.reloaded = None
        self.views = self.unpacked = 0

    def reload(self) -> None:
        if self.on_device is None:
            self.on_device, self.reloaded = self.copier.copy(self.host, self.copier.device, after=self.offloaded)
            stats.reloaded += self.host.numel()

    def view(self, dtype, offset, size, stride):
        self.reload()
        self.copier.wait(self.reloaded)
        tensor = torch.empty(0, dtype=dtype, device=self.copier.device)
        tensor.set_(self.on_device.untyped_storage(), offset, size, stride)
        self.unpacked += 1
        if self.unpacked == self.views:  # a second backward (retain_graph) reloads again
            self.on_device, self.unpacked = None, 0
        return tensor


class _Saved:
    """What autograd holds for an offloaded tensor: its storage's host copy and its view."""

    __slots__ = ("copy", "dtype", "offset", "size", "stride")

    def __init__(self, copy: _HostCopy, t):
        self.copy, self.dtype = copy, t.dtype
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()


class _Outer:
    """A tensor left in place, packed by the saved-tensors hooks around the offloaded module."""

    __slots__ = ("unpack", "packed")

    def __init__(self, hooks, t):
        pack, self.unpack = hooks
        self.packed = pack(t)


def _unpack(saved):
    if isinstance(saved, _Saved):
        return saved.copy.view(saved.dtype, saved.offset, saved.size, saved.stride)
    if isinstance(saved, _Outer):
        return saved.unpack(saved.packed)
    return saved


class _LayerGroup:
    """What one layer's forward saves for one micro-batch."""

    def __init__(self, layer, hidden_states):
        config = layer.config
        self.device = hidden_states.device
        self.modules = frozenset(config.offload_modules)
        self.min_numel = config.min_offloaded_tensor_size
        self.parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        self.copier = _copier(self.device)
        self.copies = []       # every offloaded storage, for the copy back
        self.by_storage = {}   # data pointer -> _HostCopy, while the forward runs
        self.held = []         # the saved device tensors, until the forward ends
        self.previous = getattr(hidden_states, "_offload_group", None)  # weakref to the producer

    def pack(self, module, outer, t):
        storage = t.untyped_storage()
        if (t.device != self.device or storage.data_ptr() in self.parameters
                or storage.nbytes() < self.min_numel * t.element_size()):
            return t if outer is None else _Outer(outer, t)
        copy = self.by_storage.get(storage.data_ptr())
        if copy is None:
            flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            copy = self.by_storage[storage.data_ptr()] = _HostCopy(flat, self.copier)
            self.copies.append(copy)
            self.held.append(t)
            stats.offloaded[module] += storage.nbytes()
        copy.views += 1
        return _Saved(copy, t)

    def finish(self, output):
        """Called on the layer's output: reload when backward reaches it; link the next layer."""
        if output.requires_grad:
            output.register_hook(self._backward_reached)
        output._offload_group = weakref.ref(self)
        return output

    def _backward_reached(self, grad):
        for copy in self.copies:
            copy.reload()
        previous = self.previous() if self.previous is not None else None
        if previous is not None:  # prefetch: its copy runs while this layer's backward computes
            for copy in previous.copies:
                copy.reload()


def _in_backward() -> bool:
    # A layer recomputed by full recompute runs its forward inside backward's graph task.
    return torch._C._current_graph_task_id() != -1


@torch.compiler.disable  # a clean graph break under --torch-compile (Dynamo cannot trace it)
def _enclosing_hooks():
    """The (pack, unpack) pair active outside our hooks, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _identity(output):
    return output


@contextlib.contextmanager
def layer_forward(layer, hidden_states):
    """Around a TransformerLayer's forward: offload what its chosen submodules save. Yields the
    function to call on the layer's output."""
    global _current
    config = layer.config
    if not (config.fine_grained_activation_offloading and torch.is_grad_enabled() and not _in_backward()):
        yield _identity
        return
    group, enclosing = _LayerGroup(layer, hidden_states), _current
    _current = group
    try:
        yield group.finish
    finally:
        _current = enclosing
        group.by_storage = group.held = None  # the copies are queued and the allocator knows


@contextlib.contextmanager
def offload(module: str | None):
    """Around a submodule's forward: what it saves goes to the host when `module` is offloaded."""
    group = _current
    if group is None or module not in group.modules:
        yield
        return
    outer = _enclosing_hooks()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: group.pack(module, outer, t), _unpack):
        yield
