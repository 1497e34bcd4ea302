"""Process start-up: the parallel grid, the device, seeds (torch.distributed itself:
`parallel_state.initialize_distributed`)."""

import os
import random

import numpy as np
import torch
import torch.distributed as dist

from teratron import parallel_state


def initialize_model_parallel(config, distributed, ddp=None) -> None:
    """The process groups of `config`'s layout (a TransformerConfig; `distributed` a
    DistributedConfig; `ddp` a DistributedDataParallelConfig: its hybrid-sharding instances)."""
    if not dist.is_initialized():
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        hierarchical_context_parallel_sizes=config.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=config.expert_model_parallel_size,
        expert_tensor_parallel_size=config.expert_tensor_parallel_size,
        distributed_timeout_minutes=distributed.distributed_timeout_minutes,
        num_distributed_optimizer_instances=1 if ddp is None else ddp.num_distributed_optimizer_instances,
    )


# --deterministic-mode's environment (Megatron's values): NCCL's ring all-reduce (a fixed reduction
# order; its tree and NVLS algorithms may change the order between runs) and cuBLAS's fixed
# workspaces. Read by NCCL and cuBLAS when they start, so set before torch.distributed starts.
DETERMINISTIC_ENV = {"NCCL_ALGO": ("Ring",), "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8")}


def apply_deterministic_env(env=os.environ) -> None:
    """Refuse a non-deterministic value a launcher set; fill in the unset ones."""
    for name, accepted in DETERMINISTIC_ENV.items():
        if name in env and env[name] not in accepted:
            raise ValueError(f"--deterministic-mode with {name}={env[name]}: not a deterministic setting; unset it "
                             f"or use {' or '.join(accepted)}")
    for name, accepted in DETERMINISTIC_ENV.items():
        env.setdefault(name, accepted[0])


def set_random_seed(seed: int, deterministic: bool) -> None:
    """Python, numpy and torch generators; every rank uses the same seed (Megatron's default
    without --data-parallel-random-init). `deterministic`: deterministic kernels only (an op
    without one raises)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        apply_deterministic_env()  # again, for a Trainer built without pretrain
        torch.use_deterministic_algorithms(True)


def get_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
