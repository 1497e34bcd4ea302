"""Small helpers shared by the package (Megatron: `megatron.core.utils`)."""

import functools
import math

import torch


class _NormalInit(functools.partial):
    """`torch.nn.init.normal_` with a fixed mean and std.

    A partial, so it pickles; with value equality, so two configs built from the same numbers
    compare equal (a plain partial or a lambda compares by identity).
    """

    def __eq__(self, other):
        if not isinstance(other, _NormalInit):
            return NotImplemented
        return (self.func, self.args, self.keywords) == (other.func, other.args, other.keywords)

    def __hash__(self):
        return hash((self.func, self.args, tuple(sorted(self.keywords.items()))))


def init_method_normal(sigma: float) -> _NormalInit:
    """Init callable: fills a tensor in place from N(0, sigma^2)."""
    return _NormalInit(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0) -> _NormalInit:
    """Init callable for the projections that write into the residual stream.

    std = sigma / sqrt(multiplier * num_layers): each layer adds `multiplier` such outputs to the
    residual, so scaling keeps the residual's variance independent of depth (GPT-2's recipe).
    """
    return init_method_normal(sigma / math.sqrt(multiplier * num_layers))


class HostCopy:
    """A device tensor's values on their way to the host: the copy is queued on creation and
    waited for in `get()`, so GPU work queued in between runs while the host waits only for
    these values (a `.tolist()` after queuing that work would wait for all of it)."""

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor.detach().clone()

    def get(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def local_flat_range(param) -> tuple[int, int]:
    """Flat elements [start, end) of the whole (tensor-parallel) parameter that this rank's shard
    of an FSDP parameter (a DTensor sharded on dim 0, as torch.chunk cuts) holds; the shard dim
    of a hybrid mesh is its last."""
    rows = param.shape[0]
    mesh = param.device_mesh
    world, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    chunk = math.ceil(rows / world) if rows else 0
    first, last = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    per_row = math.prod(param.shape[1:])
    return first * per_row, last * per_row
