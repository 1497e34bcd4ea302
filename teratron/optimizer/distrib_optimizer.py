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
from teratron.optimizer.optimizer import MegatronOptimizer, copy_param_attributes, copy_tensors


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

        self.shards = []   # (model param, (start, end) in the flat param, main shard, main is a view)
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
                self.shards.append((param, (start, end), main, as_view))
                mains.append(main)
                index += 1
            main_groups.append({**group, "params": mains})
        super().__init__(make_optimizer(main_groups), config, grad_scaler, **kwargs)

    def _param_sync_chunks(self) -> list:
        return self.model_chunks

    def copy_main_grads(self) -> None:
        for param, (start, end), main, _ in self.shards:
            main.grad = main_grad_for(main, param.main_grad.view(-1)[start:end])

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        copy_tensors((param.detach().view(-1)[start:end], main)
                     for param, (start, end), main, as_view in self.shards if not as_view)
        return True

    def zero_grad(self, set_to_none: bool = True):
        for param, _, main, _ in self.shards:
            param.grad = None
            main.grad = None

    def state_dict(self):
        """This rank's optimizer state (the slices it owns) and fp32 masters; loads into the same
        data-parallel layout. `param_state_shards()` exposes the pieces for resharding checkpoints."""
        state = super().state_dict()
        state["shard_main_params"] = [main for _, _, main, as_view in self.shards if not as_view]
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        masters = iter(state_dict["shard_main_params"])
        for _, _, main, as_view in self.shards:
            if not as_view:
                main.data.copy_(next(masters))

    def reload_model_params(self):
        for param, (start, end), main, as_view in self.shards:
            if not as_view:
                main.data.copy_(param.detach().view(-1)[start:end])

    def param_state_shards(self):
        """model param -> (start, end, {"param": fp32 master slice, <optimizer state>: slice}):
        this rank's piece of each param's flat elements and of its optimizer state."""
        out = {}
        for param, (start, end), main, _ in self.shards:
            tensors = {"param": main}
            tensors.update({k: v for k, v in self.optimizer.state.get(main, {}).items()
                            if isinstance(v, torch.Tensor) and v.shape == main.shape})
            out[param] = (start, end, tensors)
        return out
