"""Megatron optimizer wrappers: fp32, mixed precision with fp32 master weights, and chains.

A MegatronOptimizer wraps a torch optimizer that steps "main" params: the model params
themselves in fp32, or fp32 master copies of bf16/fp16 params. `step()` makes main grads from
the model's grads (`main_grad` under DDP, `.grad` otherwise), unscales them and checks for
inf/nan (with a loss scaler), clips by the global norm and steps; it returns
`(update_successful, grad_norm, num_zeros_in_grad)`, with (False, None, None) for a skipped step.
A step that updated params runs the param-update hooks (QK-clip scales rows of params there,
`scale_param_rows`), then hands them to DDP: the distributed optimizer updates only this rank's
slice of each param, and DDP all-gathers the slices (`start_param_sync`).

Collectives are the same on every rank whatever params it holds: a step makes one found-inf
reduction (with a loss scaler) and one reduction of [squared norm, zero count], each over the
whole grid, for a single optimizer and for a chain alike. Dense and expert grads reduce over
different groups (tp x pp vs expert-tp x ep x pp, times their data-parallel group under the
distributed optimizer), so both are summed over the grid instead, each rank contributing only
the grads no other rank also contributes (Megatron reduces each quantity once per chain too).
"""

import math
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.distributed as dist

from teratron.optimizer.clip_grads import (all_reduce_over_groups, clip_grad_by_total_norm_fp32, default_device,
                                           local_grad_stats, param_is_counted)
from teratron.optimizer.cpu_offload import main_grad_for, make_master, select_offloaded
from teratron.process_groups import get_pg_rank
from teratron.utils import HostCopy

# Attributes a main param inherits from its model param (norm de-duplication, Muon layout).
_INHERITED_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
                         "shared_embedding", "allreduce", "sequence_parallel", "muon_qkv_layout")


def copy_param_attributes(dst, src):
    for name in _INHERITED_ATTRIBUTES:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


def copy_tensors(pairs) -> None:
    """dst.copy_(src) for each (dst, src), one multi-tensor copy per (dst device, src device) (a
    loop of copies launches one kernel per param, which the GPU waits on after the step's syncs)."""
    groups = {}
    for dst, src in pairs:
        pair = groups.setdefault((dst.device, src.device), ([], []))
        pair[0].append(dst)
        pair[1].append(src)
    for group_dsts, group_srcs in groups.values():
        torch._foreach_copy_(group_dsts, group_srcs)


class MainParamShard(NamedTuple):
    """A param as the optimizer steps it: the torch optimizer steps `main_param` (its states,
    `optimizer.state[main_param]`, are shaped like it), which holds the flattened elements
    [start, end) = `flat_range` of `model_param` (the distributed optimizer's slice) or, with
    `flat_range` None, all of them (the model param itself, or an fp32 master copy of it)."""
    model_param: torch.Tensor
    main_param: torch.Tensor
    flat_range: tuple[int, int] | None


def _scale_rows_of_flat(flat, start: int, per_row: int, factors) -> None:
    """Multiply each element of `flat`, elements [start, start + flat.numel()) of a row-major
    [rows, per_row] tensor, by its row's factor (factors [rows]), without building a factor per
    element: a partial first row, whole rows, a partial last row."""
    if flat.numel() == 0:
        return
    first_row, end = start // per_row, start + flat.numel()
    first_whole, last_whole = -(-start // per_row), end // per_row
    if first_whole > last_whole:  # inside one row
        flat.mul_(factors[first_row])
        return
    head = first_whole * per_row - start
    flat[:head].mul_(factors[first_row])
    whole = flat[head:head + (last_whole - first_whole) * per_row]
    whole.view(-1, per_row).mul_(factors[first_whole:last_whole, None])
    tail = flat[head + whole.numel():]
    if tail.numel():
        tail.mul_(factors[last_whole])


def _model_grad(param):
    return param.main_grad if hasattr(param, "main_grad") else param.grad


class MegatronOptimizer(ABC):
    """Common logic.

    grad_stats_groups: groups whose product is the whole grid (e.g. [tp, dp_cp, pp]); the inf
    flag, grad norm and zero count are reduced over them. grad_replica_group: the group over
    which this optimizer's main grads are identical copies (data parallel without the
    distributed optimizer, which shards them instead); only its rank 0 counts them.
    tp_group/pp_group decide which params are duplicates (`param_is_counted`).
    """

    def __init__(self, optimizer, config, grad_scaler=None, grad_stats_groups=(), grad_replica_group=None,
                 tp_group=None, pp_group=None):
        self.optimizer = optimizer
        self.config = config
        self.grad_scaler = grad_scaler
        self.grad_stats_groups = list(grad_stats_groups)
        self.grad_replica_group = grad_replica_group
        self.tp_group = tp_group
        self.pp_group = pp_group
        self._param_update_hooks = []

    # ----- torch-optimizer surface ---------------------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def chained_optimizers(self):
        return [self]

    def get_parameters(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def main_param_shards(self) -> list[MainParamShard]:
        """Every param this optimizer steps on this rank, with the piece of it its main param
        holds: the one view of the optimizer's per-param state that checkpoints use."""
        return [MainParamShard(p, p, None) for p in self.get_parameters()]

    def _param_sync_chunks(self) -> list:
        """The DDP model chunks that all-gather the params after a step (distributed optimizer)."""
        return []

    # ----- loss scale ----------------------------------------------------------------------------

    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else torch.tensor(1.0)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # By a Python float: moving the host scale tensor to the GPU would be a blocking copy,
        # making the host wait for every micro-batch's forward before launching its backward.
        return loss * self.get_loss_scale().item()

    # ----- grad statistics -----------------------------------------------------------------------

    def get_main_grads_for_grad_norm(self):
        """This rank's share of the distinct main grads (none off the replica group's rank 0)."""
        if get_pg_rank(self.grad_replica_group) != 0:
            return []
        return [p.grad for p in self.get_parameters()
                if p.grad is not None and param_is_counted(p, self.tp_group, self.pp_group)]

    def _grad_stats_tensor(self, count_zeros: bool) -> torch.Tensor:
        """[global sum of squared grads, global zero count] on the device: one reduction over the grid."""
        stats = local_grad_stats(self.get_main_grads_for_grad_norm(), count_zeros)
        return all_reduce_over_groups(stats, self.grad_stats_groups)

    @staticmethod
    def _norm_and_zeros(stats: list, count_zeros: bool):
        return math.sqrt(stats[0]), int(stats[1]) if count_zeros else None

    def _grad_stats(self, count_zeros: bool):
        """(global grad norm, global zero count or None)."""
        return self._norm_and_zeros(self._grad_stats_tensor(count_zeros).tolist(), count_zeros)

    def get_grad_norm(self) -> float:
        return self._grad_stats(count_zeros=False)[0]

    def count_zeros(self) -> int:
        return self._grad_stats(count_zeros=True)[1]

    def clip_grad_norm(self, clip_grad: float) -> float:
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(self.get_parameters(), clip_grad, grad_norm)
        return grad_norm

    # ----- the step ------------------------------------------------------------------------------

    @abstractmethod
    def copy_main_grads(self) -> None:
        """Fill the main grads from the model grads (no communication)."""

    @abstractmethod
    def step_with_ready_grads(self) -> bool:
        """Step the main params and copy them back to the model params."""

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Fill the main grads; with a grad scaler, unscale them in place and return whether any
        rank's grads hold inf/nan."""
        self.copy_main_grads()
        if self.grad_scaler is None:
            return False
        inv_scale = self.grad_scaler.inv_scale.item()
        found = torch.zeros((), dtype=torch.float32, device=default_device())
        for p in self.get_parameters():
            if p.grad is not None:
                p.grad.mul_(inv_scale)
                found = torch.maximum(found, (~torch.isfinite(p.grad)).any().float().to(found.device))
        all_reduce_over_groups(found, self.grad_stats_groups, dist.ReduceOp.MAX)
        return bool(found.item())

    @torch.no_grad()
    def step(self):
        """Update the params, run the param-update hooks, then have DDP all-gather the params where
        this rank updated a slice only; returns (update_successful, grad_norm, num_zeros_in_grad)."""
        update_successful, grad_norm, num_zeros = self._update_params()
        if update_successful:
            for hook in self._param_update_hooks:
                hook(self)
            # overlap_param_gather: the gathers are only launched, and run while the host
            # finishes this step and starts the next; the next forward's pre-hooks wait.
            for chunk in self._param_sync_chunks():
                chunk.start_param_sync()
        return update_successful, grad_norm, num_zeros

    def register_param_update_hook(self, hook) -> None:
        """hook(optimizer) runs after each step that updated the params, before DDP all-gathers
        them: the place to change the updated params further (QK-clip, `scale_param_rows`)."""
        self._param_update_hooks.append(hook)

    @torch.no_grad()
    def scale_param_rows(self, row_factors: dict) -> None:
        """Multiply row i (along dim 0) of each param in `row_factors` ({model param: factors
        [rows]}) by factors[i]: in its main param (the whole param or this rank's slice), from
        which the model param's copy of that piece is refreshed (in its dtype, as after a step);
        the slices other ranks step arrive with DDP's all-gather. Params this optimizer does not
        step (frozen) are left alone. Every rank must pass the same factors."""
        factors_of = {id(param): factors for param, factors in row_factors.items()}
        for shard in self.main_param_shards():
            factors = factors_of.get(id(shard.model_param))
            if factors is None:
                continue
            model, main = shard.model_param.detach(), shard.main_param
            start, end = shard.flat_range or (0, model.numel())
            factors = factors.to(device=main.device, dtype=main.dtype)
            _scale_rows_of_flat(main.view(-1), start, model.numel() // model.shape[0], factors)
            model_piece = model.view(-1)[start:end]
            stepped_in_place = (model_piece.device, model_piece.data_ptr()) == (main.device, main.data_ptr())
            if model_piece.numel() and not stepped_in_place:
                model_piece.copy_(main.view(-1))

    def _update_params(self):
        """Unscale, check, clip and step: (update_successful, grad_norm, num_zeros_in_grad)."""
        found_inf = self.prepare_grads()
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        if found_inf:
            return False, None, None
        count_zeros, clip = self.config.log_num_zeros_in_grad, self.config.clip_grad
        stats = self._grad_stats_tensor(count_zeros)
        if clip > 0.0 and not self._clips_in_kernel():
            grad_norm, num_zeros = self._norm_and_zeros(stats.tolist(), count_zeros)
            clip_grad_by_total_norm_fp32(self.get_parameters(), clip, grad_norm)
            return self.step_with_ready_grads(), grad_norm, num_zeros
        # The update is queued before the host waits for the norm, so the GPU does not idle
        # while the host reads it and launches the update. Clipping, if any, happens inside
        # the fused Adam kernel, which divides each grad by `grad_scale` as it reads it:
        # max(1, (norm + 1e-6) / clip), the inverse of clip_grad_by_total_norm_fp32's factor.
        if clip > 0.0:
            self._set_grad_scale(((stats[0].sqrt() + 1.0e-6) / clip).clamp(min=1.0).float())
        norm_on_host = HostCopy(stats)
        try:
            success = self.step_with_ready_grads()
        finally:
            self._set_grad_scale(None)
        return (success, *self._norm_and_zeros(norm_on_host.get(), count_zeros))

    def _torch_optimizers(self):
        return [opt.optimizer for opt in self.chained_optimizers if opt.optimizer.param_groups]

    def _clips_in_kernel(self) -> bool:
        """Whether every part steps with torch's fused Adam/AdamW (which can clip by a device scale)."""
        return all(isinstance(opt, torch.optim.Adam) and all(g["fused"] for g in opt.param_groups)
                   for opt in self._torch_optimizers())

    def _set_grad_scale(self, scale):
        for opt in self._torch_optimizers():
            opt.grad_scale = scale

    def zero_grad(self, set_to_none: bool = True):
        for p in self.get_parameters():
            p.grad = None

    # ----- checkpoints ---------------------------------------------------------------------------

    def state_dict(self):
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def reload_model_params(self):
        """Refresh main params from the model params (after loading a model checkpoint)."""

    @torch.no_grad()
    def init_state(self):
        """Create the optimizer states that do not exist yet (before the first step), so a
        checkpoint can be loaded into them in place: one step with zero grads at lr 0, which
        leaves every param unchanged. Collective for Muon (call it on every rank)."""
        fresh = {id(p) for p in self.get_parameters() if not self.optimizer.state.get(p)}
        if not fresh:
            return
        saved_lr = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        saved_grads = {p: p.grad for p in self.get_parameters()}
        for p in self.get_parameters():
            p.grad = torch.zeros_like(p) if id(p) in fresh else None
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, saved_lr):
            group["lr"] = lr
        for p, grad in saved_grads.items():
            p.grad = grad


class FP32Optimizer(MegatronOptimizer):
    """Model params are fp32 and are the main params."""

    def copy_main_grads(self) -> None:
        for p in self.get_parameters():
            if hasattr(p, "main_grad"):
                p.grad = p.main_grad

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """bf16/fp16 model params stepped through fp32 master copies; fp32 params are stepped in
    place, unless CPU offload gives them a master on the host.

    make_optimizer(param_groups) builds the torch optimizer over the main params.
    """

    def __init__(self, make_optimizer, param_groups, config, grad_scaler=None, **kwargs):
        params = [p for group in param_groups for p in group["params"]]
        offload = set()
        if config.optimizer_cpu_offload:
            offload = select_offloaded([p.numel() for p in params], config.optimizer_offload_fraction)
        self.model_to_main = []   # (model param, main param); the same tensor when stepped in place
        main_groups, index = [], 0
        for group in param_groups:
            main_params = []
            for param in group["params"]:
                if param.dtype == torch.float32 and index not in offload:
                    main = param
                else:
                    main = make_master(param, index in offload, config.pin_cpu_params)
                    copy_param_attributes(main, param)
                self.model_to_main.append((param, main))
                main_params.append(main)
                index += 1
            main_groups.append({**group, "params": main_params})
        super().__init__(make_optimizer(main_groups), config, grad_scaler, **kwargs)

    def main_param_shards(self) -> list[MainParamShard]:
        return [MainParamShard(model_param, main, None) for model_param, main in self.model_to_main]

    def copy_main_grads(self) -> None:
        for model_param, main in self.model_to_main:
            grad = _model_grad(model_param)
            main.grad = None if grad is None else main_grad_for(main, grad)

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        copy_tensors((model_param.data, main) for model_param, main in self.model_to_main
                     if main is not model_param)
        return True

    def zero_grad(self, set_to_none: bool = True):
        for model_param, main in self.model_to_main:
            model_param.grad = None
            main.grad = None

    def state_dict(self):
        state = super().state_dict()
        state["fp32_from_fp16_params"] = [main for model_param, main in self.model_to_main
                                          if main is not model_param]
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        masters = iter(state_dict["fp32_from_fp16_params"])
        for model_param, main in self.model_to_main:
            if main is not model_param:
                main.data.copy_(next(masters))

    def reload_model_params(self):
        for model_param, main in self.model_to_main:
            if main is not model_param:
                main.data.copy_(model_param.data)


class ChainedOptimizer(MegatronOptimizer):
    """Several optimizers stepped as one (dense + expert params, or Muon + its scalar optimizer):
    one loss scale, one skip decision, one global grad norm, each from one reduction over the
    grid that all of them share. A part may be empty on a rank (no such params on this pipeline
    stage): it contributes nothing, and every rank chains the same parts."""

    def __init__(self, chained_optimizers):
        if not chained_optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        self._chained = list(chained_optimizers)
        first = self._chained[0]
        if any(opt.grad_stats_groups != first.grad_stats_groups or opt.grad_scaler is not first.grad_scaler
               for opt in self._chained):
            raise ValueError("ChainedOptimizer: the chained optimizers must share one grad scaler and one "
                             "grad_stats_groups (the whole grid); build them with get_megatron_optimizer")
        super().__init__(None, first.config, first.grad_scaler, grad_stats_groups=first.grad_stats_groups)

    @property
    def chained_optimizers(self):
        return self._chained

    @property
    def param_groups(self):
        return [g for opt in self._chained for g in opt.param_groups]

    @property
    def state(self):
        return {p: s for opt in self._chained for p, s in opt.state.items()}

    def get_parameters(self):
        return [p for opt in self._chained for p in opt.get_parameters()]

    def main_param_shards(self) -> list[MainParamShard]:
        return [shard for opt in self._chained for shard in opt.main_param_shards()]

    def _param_sync_chunks(self) -> list:
        """Each chunk once, after every part has stepped: parts may share a chunk's buckets
        (Muon and its scalar optimizer) or its forward order (dense and expert buckets)."""
        chunks = {id(chunk): chunk for opt in self._chained for chunk in opt._param_sync_chunks()}
        return list(chunks.values())

    def get_main_grads_for_grad_norm(self):
        return [g for opt in self._chained for g in opt.get_main_grads_for_grad_norm()]

    def copy_main_grads(self) -> None:
        for opt in self._chained:
            opt.copy_main_grads()

    def step_with_ready_grads(self) -> bool:
        success = True
        for opt in self._chained:
            success &= opt.step_with_ready_grads()
        return success

    def zero_grad(self, set_to_none: bool = True):
        for opt in self._chained:
            opt.zero_grad(set_to_none)

    def state_dict(self):
        return [opt.state_dict() for opt in self._chained]

    def load_state_dict(self, state_dict):
        if len(state_dict) != len(self._chained):
            raise ValueError(f"optimizer checkpoint holds {len(state_dict)} optimizers, this run builds "
                             f"{len(self._chained)}; load with the same optimizer layout (dense/expert/muon split)")
        for opt, sd in zip(self._chained, state_dict):
            opt.load_state_dict(sd)

    def reload_model_params(self):
        for opt in self._chained:
            opt.reload_model_params()

    def init_state(self):
        for opt in self._chained:
            opt.init_state()
