"""Point-to-point transfers between neighbouring pipeline stages.

Each schedule step posts all of its sends and receives (to the next and previous rank of the
pipeline group) as one `torch.distributed.batch_isend_irecv`, on gloo and NCCL alike; both
neighbours post the matching operations in the same step (see `schedule_plan`), so the batches
pair up and cannot deadlock.

With `config.overlap_p2p_comm` waiting is deferred: a received tensor is waited for only when a
computation needs it (`Transfer.get`) and sends are reaped once complete, so on GPU the transfers
run on NCCL's stream while the next microbatch computes. Otherwise every batch is waited for at
once (and, with `batch_p2p_sync` on CUDA, the device synchronised), as Megatron does by default.
A step's transfers always go in one batch; `batch_p2p_comm` (which the config sets False for
overlap) does not change that.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

NEXT, PREV = "next", "prev"

# Pipeline groups whose NCCL communicator has been created by a collective (see _warm_up).
_WARM_GROUPS: set = set()

# Steps whose sends may still be in flight before the oldest is waited for.
_MAX_PENDING_SENDS = 2


class _Batch:
    """The works of one batch_isend_irecv; waits once (gloo's recv works block if waited twice)."""

    def __init__(self, works: list, sent: list):
        self.works, self.sent = works, sent

    def done(self) -> bool:
        return not self.works or all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.sent = [], []


@dataclass
class Transfer:
    """A received tensor whose transfer may still be in flight."""

    tensor: torch.Tensor
    batch: Optional[_Batch] = None

    def get(self) -> torch.Tensor:
        if self.batch is not None:
            self.batch.wait()
        return self.tensor


class P2PCommunicator:
    """Sends and receives [s, b, h] activations and gradients between adjacent pipeline ranks.

    The ring wraps: the last rank's next is the first (interleaved schedules pass the output of
    model chunk v on the last rank to chunk v + 1 on the first).
    """

    def __init__(self, pp_group, config, device: torch.device):
        ranks = dist.get_process_group_ranks(pp_group)
        index = ranks.index(dist.get_rank())
        self.group = pp_group
        self.peers = {NEXT: ranks[(index + 1) % len(ranks)], PREV: ranks[(index - 1) % len(ranks)]}
        self.config = config
        self.device = device
        self._sends: list = []
        self._warm_up()

    def _warm_up(self) -> None:
        # NCCL creates a group's communicator on its first call, which every member must join;
        # the first p2p step involves only some ranks, so a collective goes first.
        if dist.get_backend(self.group) == "nccl" and self.group not in _WARM_GROUPS:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
            _WARM_GROUPS.add(self.group)

    def exchange(self, sends: list, recvs: list, tensor_shape: tuple) -> list:
        """Post one step: `sends` are (tensor, NEXT|PREV), `recvs` are NEXT|PREV directions.

        Returns one Transfer per receive, in order. Received tensors have `tensor_shape` (or the
        sender's shape with config.variable_seq_lengths) and dtype config.pipeline_dtype.
        """
        if not sends and not recvs:
            return []
        sends = [(tensor.contiguous(), direction) for tensor, direction in sends]
        if self.config.variable_seq_lengths:
            shapes = self._exchange_shapes(sends, recvs)
        else:
            shapes = [tensor_shape] * len(recvs)
        buffers = [torch.empty(shape, dtype=self.config.pipeline_dtype, device=self.device) for shape in shapes]
        ops = [dist.P2POp(dist.isend, tensor, self.peers[direction], self.group) for tensor, direction in sends]
        ops += [dist.P2POp(dist.irecv, buffer, self.peers[direction], self.group)
                for buffer, direction in zip(buffers, recvs)]
        batch = _Batch(dist.batch_isend_irecv(ops), [tensor for tensor, _ in sends])
        if not self.config.overlap_p2p_comm:
            batch.wait()
            if self.config.batch_p2p_sync and self.device.type == "cuda":
                torch.cuda.synchronize()
            return [Transfer(buffer) for buffer in buffers]
        if sends:
            self._sends.append(batch)
            self._reap_sends()
        return [Transfer(buffer, batch) for buffer in buffers]

    def _exchange_shapes(self, sends: list, recvs: list) -> list:
        shape_sends = [torch.tensor(t.shape, dtype=torch.int64, device=self.device) for t, _ in sends]
        shape_recvs = [torch.empty(3, dtype=torch.int64, device=self.device) for _ in recvs]
        ops = [dist.P2POp(dist.isend, shape, self.peers[direction], self.group)
               for shape, (_, direction) in zip(shape_sends, sends)]
        ops += [dist.P2POp(dist.irecv, shape, self.peers[direction], self.group)
                for shape, direction in zip(shape_recvs, recvs)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return [tuple(shape.tolist()) for shape in shape_recvs]

    def _reap_sends(self) -> None:
        """Drop finished sends so the sent tensors can be freed; wait for the oldest beyond
        _MAX_PENDING_SENDS (gloo reports a send complete only once waited for)."""
        self._sends = [batch for batch in self._sends if not batch.done()]
        while len(self._sends) > _MAX_PENDING_SENDS:
            self._sends.pop(0).wait()

    def finish(self) -> None:
        """Wait for every send still in flight (end of a schedule)."""
        for batch in self._sends:
            batch.wait()
        self._sends = []


def get_tensor_shape(config, seq_length: int, micro_batch_size: int, tp_size: int, cp_size: int) -> tuple:
    """[s, b, h] of the activations between stages: s split over CP, and over TP with SP."""
    seq = seq_length // cp_size
    if config.sequence_parallel:
        seq //= tp_size
    return (seq, micro_batch_size, config.hidden_size)
