"""Serving under tensor parallelism: rank 0's engine calls replayed on the other TP ranks.

    channel = EngineCallChannel(ranks)                 # every rank, in the same order
    # rank 0:                                          # the other ranks:
    leader = BroadcastingEngine(engine, channel)       run_follower(engine, channel)  # until shutdown
    AsyncInferenceEngine(leader) ...; leader.shutdown()

Each TP rank holds a slice of the model, so every rank runs every forward. The engine is
deterministic given the same sequence of add_request / abort / step calls: its logits are
gathered over TP, so each rank samples the same tokens from identically seeded generators, and
request ids are handed out in call order. Rank 0 alone serves HTTP; its `BroadcastingEngine`
records the calls made since the last step and broadcasts them at the start of the next one
(new requests with their token ids and SamplingParams, aborts); the followers replay them and
step with it. `shutdown()` broadcasts the end; a follower also stops when rank 0 is gone (the
broadcast raises).

The calls travel on a gloo group of their own (`EngineCallChannel`), on CPU and GPU alike: they
are a few pickled objects, which gloo moves without device copies or syncs on the model's NCCL
stream; and a follower waits in the broadcast for as long as the server is idle, so the group
gets a timeout of its own (the default group's, or NCCL's watchdog, would end an idle server).
"""

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence, Union

import torch.distributed as dist

from teratron.inference.sampling_params import SamplingParams

IDLE_TIMEOUT = timedelta(days=365)  # a follower waits for rank 0's next call while the server is idle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    prompt: Union[str, list]
    params: SamplingParams
    request_id: int
    """The id rank 0's engine gave it; every follower's must give the same."""


@dataclass(frozen=True)
class Abort:
    request_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


class EngineCallChannel:
    """Rank `ranks[0]` broadcasts lists of engine calls to the other ranks (a gloo group of `ranks`,
    created here: every rank of the default group must construct it, in the same order)."""

    def __init__(self, ranks: Sequence[int]):
        self.src = ranks[0]
        self.group = dist.new_group(list(ranks), timeout=IDLE_TIMEOUT, backend="gloo")

    def send(self, calls: list) -> None:
        dist.broadcast_object_list([calls], src=self.src, group=self.group)

    def receive(self) -> list:
        box = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


class BroadcastingEngine:
    """Rank 0's engine for AsyncInferenceEngine: each step first sends the followers the calls
    made since the previous one. Thread-safe, so `shutdown()` may come from another thread."""

    def __init__(self, engine, channel: EngineCallChannel):
        self.engine = engine
        self.channel = channel
        self._calls = []
        self._lock = threading.Lock()
        self._shut_down = False

    def add_request(self, prompt, sampling_params: SamplingParams) -> int:
        with self._lock:
            if self._shut_down:
                raise RuntimeError("the tensor-parallel engine has shut down")
            request_id = self.engine.add_request(prompt, sampling_params)  # a refused one is not replayed
            prompt = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
            self._calls.append(AddRequest(prompt, sampling_params, request_id))
            return request_id

    def abort(self, request_id: int) -> None:
        with self._lock:
            self.engine.abort(request_id)
            if not self._shut_down:
                self._calls.append(Abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return not self._shut_down and self.engine.has_unfinished_requests()

    def step(self) -> list:
        with self._lock:
            if self._shut_down:
                return []
            self.channel.send(self._calls)
            self._calls = []
            return self.engine.step()

    def shutdown(self) -> None:
        """Tell the followers to stop (once; later steps do nothing)."""
        with self._lock:
            if not self._shut_down:
                self._shut_down = True
                self.channel.send(self._calls + [Shutdown()])


def run_follower(engine, channel: EngineCallChannel) -> None:
    """Replay rank 0's engine calls and step with it until it sends Shutdown."""
    while True:
        for call in channel.receive():
            if isinstance(call, Shutdown):
                return
            _replay(engine, call)
        try:
            engine.step()
        except Exception:  # noqa: BLE001 - as on rank 0: its step failed too, and its aborts follow
            logger.exception("an inference engine step failed")


def _replay(engine, call) -> None:
    if isinstance(call, Abort):
        engine.abort(call.request_id)
        return
    request_id = engine.add_request(call.prompt, call.params)
    if request_id != call.request_id:
        raise RuntimeError(f"rank 0's request {call.request_id} is request {request_id} on this rank: the "
                           "tensor-parallel engines have diverged")
