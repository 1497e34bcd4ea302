"""Router replay: record each MoE layer's routing decisions and force them in a later forward.

RL needs the rollout's routing in the training forward; debugging needs a run's routing back.
Each TopKRouter owns a `RouterReplay`. In RECORD mode every forward appends the chosen top-k
expert indices [T, k] of this rank's tokens; in REPLAY mode every forward takes the next
recorded [T, k] instead of choosing (the weights still come from the current logits, and
capacity dropping still applies on top). A forward that activation recompute reruns inside
backward neither records again nor consumes a new entry: it reuses the entry of its first run.

File format (`save_router_replay` / `load_router_replay`), one safetensors file per rank:
tensors `layers.{layer_number}.calls.{call}` int32 [T, k], layer_number the global 1-based
layer number, call the 0-based forward call since recording started (microbatch order, over
iterations); metadata {"format": "teratron.router_replay", "version": "1"}. Replay needs the
same layout (TP/CP/EP/PP), micro-batch shape and data order as the recording run.
"""

import enum
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_FORMAT = {"format": "teratron.router_replay", "version": "1"}
_KEY = re.compile(r"layers\.(\d+)\.calls\.(\d+)")


class RouterReplayAction(enum.Enum):
    RECORD = "record"
    REPLAY = "replay"


def _in_backward() -> bool:
    """True while autograd runs backward (activation recompute happens there)."""
    return torch._C._current_graph_task_id() != -1


class RouterReplay:
    """The recorded and the to-be-replayed routing of one router."""

    def __init__(self):
        self.action = None
        self.recorded = []
        self.targets = []
        self._recompute_queue = []

    def clear(self) -> None:
        self.recorded, self.targets, self._recompute_queue = [], [], []

    def next_indices(self, device, training: bool = True):
        """The replayed [T, k] for this forward, or None when not replaying. Only a training
        forward without grad can be a checkpointed first pass whose recompute reuses the entry;
        an evaluation forward keeps nothing back."""
        if self.action is not RouterReplayAction.REPLAY:
            return None
        if _in_backward():
            return self._recompute_queue.pop(0).to(device)
        if not self.targets:
            raise RuntimeError("router replay ran out of recorded routing: more forward calls than "
                               "recorded ones; record (or load) as many calls as you replay")
        indices = self.targets.pop(0)
        if training and not torch.is_grad_enabled():  # a checkpointed first pass: backward reruns it
            self._recompute_queue.append(indices)
        return indices.to(device)

    def record(self, top_indices) -> None:
        if self.action is RouterReplayAction.RECORD and not _in_backward():
            self.recorded.append(top_indices.detach().to(torch.int32).cpu())


def _routers(model_chunks) -> dict:
    """layer_number -> router, over modules that carry a RouterReplay."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    routers = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(getattr(module, "replay", None), RouterReplay):
                if module.layer_number is None:
                    raise ValueError("router replay needs each MoE layer's layer_number; build the "
                                     "MoELayer with layer_number= or call set_layer_number()")
                routers[module.layer_number] = module
    return routers


def set_router_replay_action(model_chunks, action) -> None:
    """RECORD, REPLAY or None (route normally) for every router of the model."""
    for router in _routers(model_chunks).values():
        router.replay.action = action


def get_recorded_routing(model_chunks) -> dict:
    """{layer_number: [indices [T, k] per forward call]} recorded so far."""
    return {layer: list(router.replay.recorded) for layer, router in _routers(model_chunks).items()}


def set_replay_routing(model_chunks, routing: dict) -> None:
    """Queue `routing` ({layer_number: [indices per call]}) for replay; every router must be given."""
    routers = _routers(model_chunks)
    missing = sorted(set(routers) - set(routing))
    if missing:
        raise ValueError(f"replay routing lacks MoE layers {missing}; record every layer of the model")
    for layer, router in routers.items():
        router.replay.clear()
        router.replay.targets = list(routing[layer])


def clear_router_replay(model_chunks) -> None:
    for router in _routers(model_chunks).values():
        router.replay.clear()


def save_router_replay(path, model_chunks) -> None:
    """Write the recorded routing of this rank's routers to `path` (format above)."""
    tensors = {f"layers.{layer}.calls.{call}": indices.contiguous()
               for layer, calls in get_recorded_routing(model_chunks).items()
               for call, indices in enumerate(calls)}
    save_file(tensors, str(path), metadata=_FORMAT)


def load_router_replay(path) -> dict:
    """{layer_number: [indices per call]} from a file written by save_router_replay."""
    with safe_open(str(path), framework="pt") as f:
        if f.metadata() != _FORMAT:
            raise ValueError(f"{path} is not a router replay file (metadata {f.metadata()}); "
                             "write it with save_router_replay")
        entries = {}
        for key in f.keys():
            match = _KEY.fullmatch(key)
            if match is None:
                raise ValueError(f"{path}: tensor {key!r} is not named layers.<layer>.calls.<call>; "
                                 "write the file with save_router_replay")
            entries[(int(match[1]), int(match[2]))] = f.get_tensor(key).long()
    routing = {}
    for layer, call in sorted(entries):
        routing.setdefault(layer, []).append(entries[(layer, call)])
    return routing
