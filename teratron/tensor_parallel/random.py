"""Random-number streams for tensor parallelism, and activation recompute that replays them.

Three kinds of randomness (Megatron's scheme, `model_parallel_cuda_manual_seed`):
- the default generator, seeded `seed` on every rank: dropout on activations that are
  replicated over TP (hidden dropout) draws the same mask on every TP rank;
- the tracker's "model-parallel-rng", seeded `seed + 2718 + tp_rank`: dropout on TP-sharded
  activations (attention probabilities of each rank's heads) draws independent masks;
- "expert-parallel-rng" (`seed + 1024 + 100 * ep_rank + expert_tp_rank`) for expert layers and
  "data-parallel-rng" (`seed`).

A tracker state is the CPU generator's state plus, where CUDA exists, the current CUDA
device's, so the same code draws the same streams whichever device the tensors live on.
`get_cuda_rng_tracker()` keeps Megatron's name; `get_rng_tracker()` is the same tracker.
"""

import contextlib

import torch

from teratron.process_groups import get_pg_rank
from teratron.tensor_parallel.utils import gather_split_1d_tensor, resolve_tp_group, split_tensor_into_1d_equal_chunks
from teratron.topology import resolve_pg_collection

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def _get_device_rng_state():
    """(CPU state, current CUDA device's state or None)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_device_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _seed_device_rng(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states; `fork(name)` runs a block on that stream, then advances it and
    puts the default stream back."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already exists in the tracker; use a different seed")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the tracker; call reset() first")
        self.seeds_.add(seed)
        saved = _get_device_rng_state()
        _seed_device_rng(seed)
        self.states_[name] = _get_device_rng_state()
        _set_device_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not in the tracker; call model_parallel_cuda_manual_seed first")
        saved = _get_device_rng_state()
        _set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_device_rng_state()
            _set_device_rng_state(saved)


_RNG_STATE_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                         use_cudagraphable_rng: bool = False) -> RNGStatesTracker:
    """The process-wide tracker (Megatron's name; it tracks the CPU stream too)."""
    if use_te_rng_tracker or inference_rng_tracker or use_cudagraphable_rng:
        raise ValueError("only teratron's own RNG tracker exists; leave use_te_rng_tracker, "
                         "inference_rng_tracker and use_cudagraphable_rng False")
    return _RNG_STATE_TRACKER


get_rng_tracker = get_cuda_rng_tracker


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int | None = None, ep_rank: int | None = None,
                                    etp_rank: int | None = None) -> None:
    """Seed the default generator and the tracker's streams (see the module docstring). Ranks
    default to this rank's in the current topology."""
    groups = resolve_pg_collection()
    tp_rank = get_pg_rank(groups.tp) if tp_rank is None else tp_rank
    ep_rank = get_pg_rank(groups.ep) if ep_rank is None else ep_rank
    etp_rank = get_pg_rank(groups.expt_tp) if etp_rank is None else etp_rank
    torch.manual_seed(seed)
    tracker = _RNG_STATE_TRACKER
    tracker.reset()
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)


model_parallel_manual_seed = model_parallel_cuda_manual_seed


class CheckpointFunction(torch.autograd.Function):
    """Run `run_function` without keeping activations; recompute it in backward under the
    generator states of the forward (default and tracker), so dropout masks match exactly.

    With distribute_saved_activations the first argument is kept as 1/tp of its elements per
    rank of `tp_group` and all-gathered again for the recompute.
    """

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, tp_group, *args):
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.tp_group = tp_group
        ctx.rng_states = (_get_device_rng_state(), _RNG_STATE_TRACKER.get_states())
        with torch.no_grad():
            outputs = run_function(*args)
        # Return aliases, never the function's own tensors: a returned parameter would otherwise
        # get this node as its grad_fn and backward would recurse into itself.
        if isinstance(outputs, tuple):
            outputs = tuple(o.detach() if torch.is_tensor(o) else o for o in outputs)
        elif torch.is_tensor(outputs):
            outputs = outputs.detach()
        if distribute_saved_activations:
            ctx.input_0_shape = args[0].shape
            args[0].data = split_tensor_into_1d_equal_chunks(args[0].data, new_buffer=True, group=tp_group)
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.other_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("activation checkpointing is not compatible with torch.autograd.grad(); "
                               "use .backward()")
        inputs = list(ctx.other_args)
        for i, tensor in zip(ctx.tensor_positions, ctx.saved_tensors):
            inputs[i] = tensor
        if ctx.distribute_saved_activations:
            inputs[0].data = gather_split_1d_tensor(inputs[0].data, ctx.tp_group).view(ctx.input_0_shape)
        inputs = [x.detach().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x for x in inputs]

        current = (_get_device_rng_state(), _RNG_STATE_TRACKER.get_states())
        _set_device_rng_state(ctx.rng_states[0])
        _RNG_STATE_TRACKER.set_states(ctx.rng_states[1])
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            _set_device_rng_state(current[0])
            _RNG_STATE_TRACKER.set_states(current[1])

        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None) + tuple(x.grad if torch.is_tensor(x) else None for x in inputs)


def checkpoint(function, distribute_saved_activations: bool, *args, tp_group=None):
    """Activation recompute of `function(*args)` (Megatron's tensor_parallel.checkpoint).
    `tp_group`: the group distribute_saved_activations splits over (None: the current
    topology's TP group)."""
    if distribute_saved_activations:
        tp_group = resolve_tp_group(tp_group)
    return CheckpointFunction.apply(function, distribute_saved_activations, tp_group, *args)


class CheckpointWithoutOutput:
    """Recompute whose outputs are freed once their consumer has saved what it needs (Megatron's
    CheckpointWithoutOutput): `checkpoint(fn, *args)` runs fn keeping only its inputs;
    `discard_output_and_register_recompute(hook_tensor)` then empties the outputs' storages
    (the consumer keeps references to them, not copies) and, when backward reaches
    `hook_tensor` (an output of the consumer), reruns fn and writes the results back into those
    storages before the consumer's backward reads them. fn must return contiguous tensors that
    own their storages, and the consumer must save its inputs, not copies of them."""

    def __init__(self):
        self.run_function = None
        self.ctx = None
        self.outputs = None
        self.recomputed = None

    def checkpoint(self, run_function, *args):
        self.run_function = run_function
        self.rng_states = (_get_device_rng_state(), _RNG_STATE_TRACKER.get_states())
        outputs = _CheckpointWithoutOutputFunction.apply(self, *args)
        self.outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor) -> None:
        if not (torch.is_grad_enabled() and hook_tensor.requires_grad):
            return  # no backward will come: nothing to recompute
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, grad):
        outputs, inputs = self._rerun()
        for stored, new in zip(self.outputs, outputs):
            stored.untyped_storage().resize_(new.untyped_storage().nbytes())
            stored.untyped_storage().copy_(new.untyped_storage())
        self.recomputed = (outputs, inputs)
        return grad

    def _rerun(self):
        inputs = [t.detach().requires_grad_(t.requires_grad) if t is not None else None
                  for t in self.ctx.saved_tensors]
        current = (_get_device_rng_state(), _RNG_STATE_TRACKER.get_states())
        _set_device_rng_state(self.rng_states[0])
        _RNG_STATE_TRACKER.set_states(self.rng_states[1])
        try:
            with torch.enable_grad():
                outputs = self.run_function(*inputs)
        finally:
            _set_device_rng_state(current[0])
            _RNG_STATE_TRACKER.set_states(current[1])
        return (outputs if isinstance(outputs, tuple) else (outputs,)), inputs


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, checkpoint, *args):
        with torch.no_grad():
            outputs = checkpoint.run_function(*args)
        ctx.checkpoint = checkpoint
        ctx.save_for_backward(*args)
        checkpoint.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        checkpoint = ctx.checkpoint
        # Recomputed by the hook, or now when the outputs were never discarded.
        outputs, inputs = checkpoint.recomputed or checkpoint._rerun()
        checkpoint.recomputed = checkpoint.ctx = None
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(None if x is None else x.grad for x in inputs)
