"""DistributedOptimizer: each data-parallel rank keeps fp32 master weights and optimizer states
only for its slice of every DDP bucket (ZeRO-1 over Megatron's grad buffers).

The layout is DDP's: the buffers say which piece of each param this rank owns
(`param_shard_range`). DDP reduce-scatters grads so rank r holds the reduced grads of its
pieces; the optimizer steps them (an fp32 master for bf16/fp16 params, or the fp32 param buffer
itself) and writes them into the param buffer; at the end of the step (`MegatronOptimizer.step`)
the model chunks all-gather them (`DistributedDataParallel.start_param_sync`). A param
crossing slice boundaries is stepped in pieces by several ranks; a rank whose slice misses a
param holds an empty piece, so all ranks walk the same param list (Muon's full-matrix gather
relies on it).
"""

import torch

from teratron.optimizer.cpu_offload import main_grad_for, make_master, select_offloaded
from teratron.optimizer.optimizer import MainParamShard, MegatronOptimizer, copy_param_attributes, copy_tensors


class DistributedOptimizer(MegatronOptimizer):
    """make_optimizer(param_groups) builds the torch optimizer over the shard params.

    model_chunks: the DistributedDataParallel chunks holding the params, whose param buffers
    this optimizer updates (they all-gather them after the step). per_model_buffers: their
    `_ParamAndGradBuffer`s holding the params of `param_groups` (dense or expert).
    """

    def __init__(self, make_optimizer, param_groups, config, grad_scaler, model_chunks, per_model_buffers,
                 data_parallel_group, **kwargs):
        self.model_chunks = list(model_chunks)
        self.data_parallel_group = data_parallel_group
        param_range = {param: buffer.param_shard_range(param)
                       for buffer in per_model_buffers for param in buffer.params}
        params = [p for group in param_groups for p in group["params"]]
        missing = [tuple(p.shape) for p in params if p not in param_range]
        if missing:
            raise ValueError(f"use_distributed_optimizer: params of shapes {missing[:3]} are not in the "
                             "DDP grad buffers; wrap every model chunk in DistributedDataParallel with "
                             "DistributedDataParallelConfig(use_distributed_optimizer=True)")
        offload = set()
        if config.optimizer_cpu_offload:
            numels = [param_range[p][1] - param_range[p][0] for p in params]
            offload = select_offloaded(numels, config.optimizer_offload_fraction)

        self._shards = []   # (MainParamShard, whether its main param is the param buffer's slice itself)
        main_groups, index = [], 0
        for group in param_groups:
            mains = []
            for param in group["params"]:
                start, end = param_range[param]
                model_shard = param.detach().view(-1)[start:end]
                # fp32 params on the device are stepped in place in the param buffer.
                as_view = param.dtype == torch.float32 and index not in offload
                main = model_shard if as_view else make_master(model_shard, index in offload,
                                                               config.pin_cpu_params)
                copy_param_attributes(main, param)
                main.dp_shard = (tuple(param.shape), start, end, data_parallel_group)
                self._shards.append((MainParamShard(param, main, (start, end)), as_view))
                mains.append(main)
                index += 1
            main_groups.append({**group, "params": mains})
        super().__init__(make_optimizer(main_groups), config, grad_scaler, **kwargs)

    def _masters(self):
        """(model slice, fp32 master) of every piece not stepped in place in the param buffer."""
        return [(shard.model_param.detach().view(-1)[slice(*shard.flat_range)], shard.main_param)
                for shard, as_view in self._shards if not as_view]

    def main_param_shards(self) -> list[MainParamShard]:
        return [shard for shard, _ in self._shards]

    def _param_sync_chunks(self) -> list:
        return self.model_chunks

    def copy_main_grads(self) -> None:
        for shard, _ in self._shards:
            model_grad = shard.model_param.main_grad.view(-1)[slice(*shard.flat_range)]
            shard.main_param.grad = main_grad_for(shard.main_param, model_grad)

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        copy_tensors(self._masters())
        return True

    def zero_grad(self, set_to_none: bool = True):
        for shard, _ in self._shards:
            shard.model_param.grad = None
            shard.main_param.grad = None

    def state_dict(self):
        """This rank's optimizer state (the slices it owns) and fp32 masters; loads into the same
        data-parallel layout (`main_param_shards()` gives checkpoints the pieces to reshard)."""
        state = super().state_dict()
        state["shard_main_params"] = [main for _, main in self._masters()]
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        masters = iter(state_dict["shard_main_params"])
        for _, main in self._masters():
            main.data.copy_(next(masters))

    def reload_model_params(self):
        for model_slice, main in self._masters():
            main.data.copy_(model_slice)
