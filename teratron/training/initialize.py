"""Process start-up: torch.distributed (under torchrun), the parallel grid, the device, seeds."""

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from teratron import parallel_state


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def initialize_distributed(args) -> int:
    """Start torch.distributed when torchrun launched us; returns the world size.

    A plain `teratron train` runs as one process without torch.distributed: every group is a
    group of one (parallel_state's contract), so nothing needs a rendezvous.
    """
    if not launched_by_torchrun():
        return 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=args.distributed_timeout_minutes))
    return dist.get_world_size()


def initialize_model_parallel(args) -> None:
    if not dist.is_initialized():
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )


def set_random_seed(seed: int, deterministic: bool) -> None:
    """Python, numpy and torch generators; every rank uses the same seed (Megatron's default
    without --data-parallel-random-init)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def get_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
