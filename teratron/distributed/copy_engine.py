"""Data-parallel reduce-scatter and all-gather done by the GPUs' copy engines (one NVLink node).

NCCL moves a bucket with SM kernels that run beside the backward's GEMMs and slow them down.
Here every rank *pulls* the slices it needs straight out of its peers' buffers, which live in
PyTorch's symmetric memory, with `copy_` between the mapped addresses: a DMA over NVLink, no SM
kernel. A reduce-scatter is one pull per peer into a staging buffer and an add (then the 1/DP
multiply) on this rank's slice; an all-gather is one pull per peer straight into the param
buffer. On two power-capped H200s the GEMMs beside these copies lose about 5x less time per byte
moved than beside NCCL's kernels; with the reduce-scatter's add, about half (docs/performance.md).

Ordering. The work runs on one side stream, in the same bucket order on every rank (as NCCL
needs too), after that stream waits for the compute stream:
- a barrier before each bucket's pulls: every peer has finished writing what we read (its grads
  of the bucket; its optimizer's param slice);
- `fence()` after the last reduce-scatter of a step: no peer is still reading our grads when we
  zero them for the next step. Params need no fence: a peer pulls our slice during its forward,
  and we next write it after the next step's reduce-scatter barriers, which it reaches later.

Needs CUDA, the NCCL backend and every rank of the group on one node with peer access.
"""

import torch
import torch.distributed as dist

from teratron.process_groups import get_pg_rank, get_pg_size


def _symmetric_memory():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def check_copy_engine_group(group, device) -> None:
    """One-line error unless copy-engine collectives can run on `group` from `device`."""
    flag = "--ddp-copy-engine-collectives"
    if device.type != "cuda":
        raise ValueError(f"{flag} needs CUDA GPUs (the model is on {device.type}); drop the flag")
    if get_pg_size(group) > 1 and dist.get_backend(group) != "nccl":
        raise ValueError(f"{flag} needs the NCCL backend (got {dist.get_backend(group)}); drop the flag")
    try:
        _symmetric_memory()
    except ImportError as error:
        raise ValueError(f"{flag} needs torch.distributed._symmetric_memory, which this PyTorch lacks "
                         f"({error}); drop the flag or use a CUDA build of torch (tested with 2.11)") from error


_bytes_outside_allocator = 0


def symmetric_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed 1-D tensor in symmetric memory (peers can map it after `rendezvous`)."""
    global _bytes_outside_allocator
    before = torch.cuda.memory_allocated(device)
    tensor = _symmetric_memory().empty(numel, dtype=dtype, device=device)
    if torch.cuda.memory_allocated(device) == before:  # PyTorch allocated it past the caching allocator
        _bytes_outside_allocator += tensor.numel() * tensor.element_size()
    return tensor.zero_()


def bytes_outside_allocator() -> int:
    """Symmetric-memory bytes that `torch.cuda.max_memory_allocated()` does not count."""
    return _bytes_outside_allocator


class _StreamWork:
    """Work handle of copy-engine work: `wait()` makes the current stream wait for it, as NCCL's."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return self.event.query()


class CopyEngineCollectives:
    """Reduce-scatter of `grad_data` and all-gather of `param_data` (both symmetric) over `group`.

    Slices follow the distributed optimizer's layout: of a bucket [offset, offset + numel), rank r
    owns [offset + r * numel / W, offset + (r + 1) * numel / W).
    """

    def __init__(self, group, grad_data: torch.Tensor, param_data: torch.Tensor, max_bucket_numel: int):
        symm_mem = _symmetric_memory()
        self.world_size = get_pg_size(group)
        self.rank = get_pg_rank(group)
        self.peers = [(self.rank + step) % self.world_size for step in range(1, self.world_size)]
        self.grad_data, self.param_data = grad_data, param_data
        try:
            self.grad_handle = symm_mem.rendezvous(grad_data, group)
            self.param_handle = symm_mem.rendezvous(param_data, group)
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError("--ddp-copy-engine-collectives needs every data-parallel rank on one node with "
                             f"peer access between the GPUs (symmetric memory failed: {first_line}); "
                             "drop the flag") from error
        self.staging = torch.empty(max_bucket_numel // self.world_size, dtype=grad_data.dtype,
                                   device=grad_data.device)
        self.stream = torch.cuda.Stream(device=grad_data.device)

    def _on_side_stream(self, work, async_op: bool):
        """Run `work` on the side stream after the current stream's queued work. Like
        torch.distributed: a handle with async_op, else the current stream waits now (None)."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            work()
            event = torch.cuda.Event()
            event.record()
        handle = _StreamWork(event)
        if async_op:
            return handle
        handle.wait()
        return None

    def _peer_view(self, handle, peer, dtype, start, numel):
        return handle.get_buffer(peer, (numel,), dtype, start)

    def reduce_scatter(self, offset: int, numel: int, scale: float, async_op: bool):
        """Our slice of grad_data[offset:offset + numel] = scale x the sum of every rank's."""
        shard = numel // self.world_size
        start = offset + self.rank * shard
        mine = self.grad_data[start:start + shard]
        staged = self.staging[:shard]

        def work():
            self.grad_handle.barrier()
            for peer in self.peers:
                staged.copy_(self._peer_view(self.grad_handle, peer, self.grad_data.dtype, start, shard))
                mine.add_(staged)
            if scale != 1.0:
                mine.mul_(scale)
        return self._on_side_stream(work, async_op)

    def all_gather(self, offset: int, numel: int, async_op: bool):
        """Every peer's slice of param_data[offset:offset + numel] pulled into ours."""
        shard = numel // self.world_size

        def work():
            self.param_handle.barrier()
            for peer in self.peers:
                start = offset + peer * shard
                self.param_data[start:start + shard].copy_(
                    self._peer_view(self.param_handle, peer, self.param_data.dtype, start, shard))
        return self._on_side_stream(work, async_op)

    def fence(self) -> None:
        """The current stream continues once every rank has finished its reduce-scatter pulls."""
        self._on_side_stream(self.grad_handle.barrier, async_op=False)
