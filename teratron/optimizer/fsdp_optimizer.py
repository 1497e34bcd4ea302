"""FsdpOptimizer: the optimizer of model chunks sharded by FullyShardedDataParallel.

Each parameter is a DTensor whose local shard (rows [r * c, (r + 1) * c) of the tensor-parallel
parameter: a contiguous flat range of it) is fp32 and is the master weight: the torch optimizer
steps that shard in place, with its local gradient shard (`main_grad`, reduced by FSDP2) as the
gradient, and FSDP2 gathers the updated shards in `params_dtype` before the next forward. So the
optimizer's states are sharded like the parameters, and checkpoints see each shard as the
distributed optimizer's slices (`MainParamShard` with a flat range): FSDP checkpoints load under
the distributed optimizer and back.
"""

import torch

from teratron.optimizer.cpu_offload import main_grad_for
from teratron.optimizer.optimizer import MainParamShard, MegatronOptimizer, copy_param_attributes
from teratron.utils import local_flat_range


class FsdpOptimizer(MegatronOptimizer):
    """make_optimizer(param_groups) builds the torch optimizer over the local shards.

    param_groups: groups of FSDP-sharded (DTensor) parameters (each knows the group it is sharded
    over: its mesh's last dim)."""

    def __init__(self, make_optimizer, param_groups, config, grad_scaler, **kwargs):
        self._shards = []
        main_groups = []
        for group in param_groups:
            mains = []
            for param in group["params"]:
                with torch.no_grad():
                    main = param.to_local()  # the shard's own storage: stepped in place
                start, end = local_flat_range(param)
                copy_param_attributes(main, param)
                shard_group = param.device_mesh.get_group(param.device_mesh.ndim - 1)
                main.dp_shard = (tuple(param.shape), start, end, shard_group)  # Muon gathers whole matrices
                self._shards.append(MainParamShard(param, main, (start, end)))
                mains.append(main)
            main_groups.append({**group, "params": mains})
        super().__init__(make_optimizer(main_groups), config, grad_scaler, **kwargs)

    def main_param_shards(self) -> list[MainParamShard]:
        return list(self._shards)

    def copy_main_grads(self) -> None:
        for shard in self._shards:
            shard.main_param.grad = main_grad_for(shard.main_param, shard.model_param.main_grad)

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()  # the shards are the params: nothing to copy back
        return True

    def zero_grad(self, set_to_none: bool = True):
        for shard in self._shards:
            shard.model_param.grad = None
            shard.main_param.grad = None
