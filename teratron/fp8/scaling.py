"""Per-tensor FP8 scaling: amax, scale, quantisation, and the two recipes' scalers.

A tensor x is stored as x_fp8 = saturate(x * scale) in an FP8 dtype; x_fp8 / scale (1 / scale
is the "scale_inv" handed to torch._scaled_mm) is its dequantised value. A scaler gives the
scale of one tensor role of one layer (`scale_for`); `quantize` applies it. The scale is
fp8_max / (amax * 2**margin), and 1 when amax is 0. Everything stays on the device: no
host synchronisation per call.

A tensor sharded over ranks (a TP weight shard, a row-parallel input, a column-parallel output
gradient; under context parallelism every activation and output gradient, each CP rank holding
part of the sequence) gets its amax all-reduced (MAX) over the groups it is sharded over first,
so all ranks use the scale the unsharded tensor has in one process and quantise their shards to
exactly the values one process would (layout invariance). This MAX all-reduce is the fp8
package's only collective; it carries no gradient, so it is not an autograd mapping.
"""

import torch
import torch.distributed as dist
from torch import nn

from teratron.process_groups import get_pg_size


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def tensor_amax(x: torch.Tensor, groups=()) -> torch.Tensor:
    """max |x| as an fp32 scalar, reduced over each of `groups` (none: this rank only; a MAX over
    TP then over CP is the MAX over both). Empty -> 0."""
    x = x.detach()  # scales carry no gradient
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    for group in groups:
        if get_pg_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def compute_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """fp8_max / (amax * 2**margin); 1 where amax is 0; finite for a tiny amax. A non-finite amax
    gives 0 or NaN, so quantising a tensor holding inf/NaN yields NaN and the overflow shows."""
    scale = fp8_max(dtype) / (amax * 2.0 ** margin)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return scale.clamp(max=torch.finfo(torch.float32).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate(x * scale) in `dtype`, scaled in fp32 (no extra rounding before the FP8 cast).
    Finite values saturate at fp8_max; inf becomes NaN (a cast would saturate it), so an
    overflow stays visible to the loss scaler and the NaN checks."""
    limit = fp8_max(dtype)
    nan = float("nan")
    return (x.float() * scale).nan_to_num(nan=nan, posinf=nan, neginf=nan).clamp(-limit, limit).to(dtype)


class CurrentScaling(nn.Module):
    """'tensorwise': each call scales by the tensor's own (reduced) amax."""

    def __init__(self, dtype: torch.dtype, margin: int, groups=()):
        super().__init__()
        self.dtype, self.margin, self.groups = dtype, margin, groups

    def scale_for(self, x: torch.Tensor, update: bool = True) -> torch.Tensor:
        """The scale to quantise x with (`update` is for the common interface: no state here)."""
        return compute_scale(tensor_amax(x, self.groups), self.dtype, self.margin)


class DelayedScaling(nn.Module):
    """'delayed': the scale comes from the amaxes of earlier uses.

    `amax_history[0]` is the most recent amax; after each use with `update` the history rolls
    by one, the new amax enters at 0 (a non-finite amax is skipped, as Transformer Engine does)
    and `scale` is recomputed from the history ('max' over it, or 'most_recent'). So the scale
    used at call n comes from the amaxes of calls < n. The first use, with no history yet,
    scales by its own amax (Transformer Engine starts from scale 1 instead, which flushes small
    gradients to zero on the first step). Eval and inference (no autograd) pass update=False
    and leave the history alone.

    The buffers are not persistent: checkpoints do not hold them, so a resumed run starts a new
    history (its first use scales by its own amax again).
    """

    def __init__(self, dtype: torch.dtype, margin: int, history_len: int, compute_algo: str,
                 groups=(), device=None):
        super().__init__()
        self.dtype, self.margin, self.compute_algo, self.groups = dtype, margin, compute_algo, groups
        self.register_buffer("amax_history", torch.zeros(history_len, device=device), persistent=False)
        self.register_buffer("scale", torch.ones((), device=device), persistent=False)
        # A device flag, not a Python bool: torch.compile would guard on (and recompile for) a bool.
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool, device=device), persistent=False)

    def history_amax(self) -> torch.Tensor:
        return self.amax_history.max() if self.compute_algo == "max" else self.amax_history[0]

    def scale_for(self, x: torch.Tensor, update: bool = True) -> torch.Tensor:
        """The scale to quantise x with, from the history; then x's amax is recorded if `update`."""
        amax = tensor_amax(x, self.groups)
        scale = torch.where(self.initialized, self.scale, compute_scale(amax, self.dtype, self.margin))
        if update:
            rolled = torch.cat([amax.view(1), self.amax_history[:-1]])
            self.amax_history.copy_(torch.where(torch.isfinite(amax), rolled, self.amax_history))
            self.scale.copy_(compute_scale(self.history_amax(), self.dtype, self.margin))
            self.initialized.fill_(True)
        return scale


def make_scaler(recipe, dtype: torch.dtype, groups=(), device=None) -> nn.Module:
    """The scaler of one tensor role (input, weight or output gradient) of one linear layer,
    its amax reduced over `groups` (the process groups that tensor is sharded over)."""
    if recipe.recipe == "tensorwise":
        return CurrentScaling(dtype, recipe.margin, tuple(groups))
    return DelayedScaling(dtype, recipe.margin, recipe.amax_history_len, recipe.amax_compute_algo,
                          tuple(groups), device)
