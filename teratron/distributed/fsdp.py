"""FullyShardedDataParallel: parameters, gradients and optimizer states sharded over data parallelism,
on PyTorch's FSDP2 (`fully_shard`, DTensor) as the engine.

Megatron-FSDP's sharding strategies, and what runs each here:

    no_shard            plain DDP (DistributedDataParallel): nothing sharded
    optim               DDP + the distributed optimizer (ZeRO-1)
    optim_grads         FSDP2, parameters kept gathered from forward to backward (ZeRO-2-like:
                        reshard_after_forward=False)
    optim_grads_params  FSDP2, parameters gathered per layer in forward and again in backward
                        (ZeRO-3: reshard_after_forward=True)

`--use-torch-fsdp2` is `optim_grads_params` (`--torch-fsdp2-no-reshard-after-forward`: `optim_grads`).
With `num_distributed_optimizer_instances` N > 1 (hybrid sharding, HSDP) the dense units shard over
the 1/N of the DP x CP ranks of their instance and replicate across instances (a 2-D mesh; FSDP2
reduce-scatters inside an instance, then all-reduces across them); experts still shard over expert DP.

Under FSDP2 each transformer layer (and each MTP layer) is one unit, gathered before it runs and
freed after; the chunk's root unit holds the rest (embedding, final norm, output layer). A
parameter is a DTensor sharded on dim 0 over the data-parallel (x context-parallel) group: rank r
holds rows [r * c, (r + 1) * c) of it, c = ceil(rows / DP) (FSDP2 pads the last shard), which is
one contiguous flat range of the (tensor-parallel) parameter. MoE experts are units of their own,
sharded over the expert-data-parallel group.

Precision: the sharded parameters are fp32 and are the optimizer's master weights (the model is
built in `params_dtype` and upcast before sharding, so the masters start as the values a
distributed optimizer's fp32 copies of the bf16 model would). FSDP2's mixed-precision policy
gathers them in `params_dtype`, so layers compute in bf16 as without FSDP; gradients are reduced
(and accumulated over micro-batches) in fp32 with `grad_reduce_in_fp32`, else in `params_dtype`,
and land as fp32 shards. Gradients are averaged over DP (summed with calculate_per_token_loss,
as DDP does); experts' over all data-parallel ranks' tokens too (FSDP2 averages over each
mesh; `finish_grad_sync` rescales where that differs).

The wrapper has DDP's interface (no_sync, finish_grad_sync, zero_grad_buffer, scale_gradients):
after backward each sharded parameter gets `main_grad`, its local gradient shard, so
`finalize_model_grads` and the optimizer (`FsdpOptimizer`) work on shards exactly as on DDP's
buffers.
"""

from contextlib import contextmanager

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from teratron.process_groups import ProcessGroupCollection, get_pg_size
from teratron.topology import resolve_pg_collection
from teratron.transformer.init_rng import built_components, rebuild
from teratron.transformer.multi_token_prediction import MultiTokenPredictionLayer
from teratron.transformer.transformer_layer import TransformerLayer
from teratron.utils import local_flat_range


def _device_type(group) -> str:
    return "cuda" if torch.cuda.is_available() and torch.distributed.get_backend(group) == "nccl" else "cpu"


def _mesh(group) -> DeviceMesh:
    return DeviceMesh.from_group(group, _device_type(group))


def _hybrid_mesh(pg) -> DeviceMesh:
    """[instances, ranks per instance] over DP x CP: replicate along dim 0, shard along dim 1."""
    ranks = torch.distributed.get_process_group_ranks(pg.dp_cp)
    shard = torch.distributed.get_world_size(pg.intra_dp_cp)
    mesh = torch.tensor(ranks).view(-1, shard)
    return DeviceMesh.from_group([pg.inter_dist_opt, pg.intra_dp_cp], _device_type(pg.dp_cp), mesh=mesh,
                                 mesh_dim_names=("replicate", "shard"))


def _is_expert_param(param) -> bool:
    return not getattr(param, "allreduce", True)


def _default_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@torch.no_grad()
def _materialize(module: torch.nn.Module, device) -> None:
    """Shards of a model built on the meta device (`init_model_with_meta_device`): allocate them on
    `device`, then build each component again (`init_rng.rebuild`: the values a non-meta build
    gives), one at a time, and copy the rows of this rank's shard (and the component's buffers).
    Buffers built outside components (RoPE frequencies) were real and keep their values."""
    outside = {name: b.detach().clone() for name, b in module.named_buffers() if not b.is_meta}
    module.to_empty(device=device)
    for name, value in outside.items():
        module.get_buffer(name).copy_(value)
    filled = set()
    for component in built_components(module):
        full = rebuild(component, device)
        full_params = dict(full.named_parameters())
        for name, param in component.named_parameters():
            local = param.to_local()
            start, end = local_flat_range(param)
            local.copy_(full_params[name].detach().reshape(-1)[start:end].view_as(local))
            filled.add(param)
        for name, buffer in component.named_buffers():
            buffer.copy_(full.get_buffer(name))
        del full
    missing = [name for name, p in module.named_parameters() if p not in filled]
    if missing:
        raise RuntimeError(f"init_model_with_meta_device: {missing[:3]} were built outside a component "
                           "(init_rng.build_component), so their values cannot be made again")


class FullyShardedDataParallel(torch.nn.Module):
    """Shard `module` (one model chunk) over data parallelism with FSDP2.

    config: the model's TransformerConfig (params_dtype, calculate_per_token_loss).
    ddp_config: its DistributedDataParallelConfig (the strategy, grad_reduce_in_fp32).
    device: where a module built on the meta device (init_model_with_meta_device) gets its shards.
    """

    def __init__(self, config, ddp_config, module: torch.nn.Module,
                 pg_collection: ProcessGroupCollection | None = None, device=None):
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.pg_collection = pg_collection = resolve_pg_collection(pg_collection)
        self.dp_cp_group, self.expt_dp_group = pg_collection.dp_cp, pg_collection.expt_dp
        reduce_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else config.params_dtype
        # Inputs keep their dtypes (RoPE frequencies stay fp32), as without FSDP.
        policy = MixedPrecisionPolicy(param_dtype=config.params_dtype, reduce_dtype=reduce_dtype,
                                      cast_forward_inputs=False)
        reshard = ddp_config.fsdp_strategy() == "optim_grads_params"
        module.float()  # the fp32 masters (see the module docstring)
        # fully_shard replaces every parameter by a new DTensor one: carry teratron's attributes
        # (tensor-parallel layout, expert, sequence-parallel, tied-embedding flags) over.
        attributes = {name: {k: v for k, v in vars(p).items() if not k.startswith("_")}
                      for name, p in module.named_parameters()}
        hybrid = ddp_config.num_distributed_optimizer_instances > 1
        dense_mesh = _hybrid_mesh(pg_collection) if hybrid else _mesh(self.dp_cp_group)
        units = [m for m in module.modules() if isinstance(m, (TransformerLayer, MultiTokenPredictionLayer))]
        sharded = set()
        for unit in reversed(units):  # inner units first (an MTP layer holds a transformer layer)
            for experts in self._expert_modules(unit):
                if experts not in sharded:
                    fully_shard(experts, mesh=_mesh(self.expt_dp_group), mp_policy=policy,
                                reshard_after_forward=reshard)
                    sharded.add(experts)
            fully_shard(unit, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(module, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=reshard)
        for name, param in module.named_parameters():
            vars(param).update(attributes[name])
            param.compute_dtype = config.params_dtype  # the dtype checkpoints save the model weights in
        if any(p.is_meta for p in module.parameters()):
            _materialize(module, device or _default_device())
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.grad_corrections = self._grad_corrections()

    def _grad_corrections(self) -> dict:
        """{param: factor} for the grads FSDP2's average over their mesh does not leave as DDP
        would: expert grads (averaged over expert DP, but an average over all DP x CP ranks'
        tokens) and, with calculate_per_token_loss, every grad (a sum: finalize_model_grads
        divides by the global token count). FSDP2 could divide by another factor itself, but
        only through PREMUL_SUM, which gloo lacks."""
        dp_cp = get_pg_size(self.dp_cp_group)
        wanted = 1 if getattr(self.config, "calculate_per_token_loss", False) else dp_cp
        factors = {}
        for param in self.params:
            averaged_over = get_pg_size(self.expt_dp_group) if _is_expert_param(param) else dp_cp
            if averaged_over != wanted:
                factors[param] = averaged_over / wanted
        return factors

    @staticmethod
    def _expert_modules(unit):
        """The expert MLPs inside a layer (their params are expert-parallel: sharded over expert DP)."""
        return [m.experts for m in unit.modules()
                if isinstance(getattr(m, "experts", None), torch.nn.Module)
                and any(_is_expert_param(p) for p in m.experts.parameters())]

    # ----- DDP's interface ------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Gradients stay sharded: every micro-batch's are reduce-scattered in its backward and
        summed into the fp32 shards. (Holding them back would keep every layer's unsharded
        gradients until the last micro-batch, the memory FSDP exists to save.)"""
        yield

    def start_grad_sync(self):
        """FSDP2 launches each unit's reduce-scatter from its backward: nothing left to start."""

    def finish_grad_sync(self):
        """Give each sharded parameter `main_grad`: its local shard of the reduced gradient (zeros
        for a parameter without one, so every rank steps the same params)."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.distributed.tensor.zeros(*param.shape, dtype=param.dtype,
                                                            device_mesh=param.device_mesh,
                                                            placements=param.placements)
            param.main_grad = param.grad.to_local()
            factor = self.grad_corrections.get(param)
            if factor is not None:
                param.main_grad.mul_(factor)

    def zero_grad_buffer(self):
        for param in self.params:
            param.grad = None
            if hasattr(param, "main_grad"):
                del param.main_grad

    def scale_gradients(self, scaling_factor: float):
        for param in self.params:
            if hasattr(param, "main_grad"):
                param.main_grad.mul_(scaling_factor)

    def start_param_sync(self, *unused, force_sync: bool = False):
        """FSDP2 gathers parameters before each unit runs: nothing to do after a step."""

    def finish_param_sync(self):
        """The sharded parameters are always current."""

    def broadcast_params(self):
        """Every rank built the same full model (seeded) before sharding: nothing to copy."""

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
