"""MoE layouts over NCCL, one process per GPU (run by test_moe_gpu.py under torchrun): the same
checks as test_moe_parallel.py's gloo run, on CUDA tensors."""

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..")]  # test_moe_parallel and tests/dist.py
from test_moe_parallel import Case, check_case  # noqa: E402

CASES = {
    2: [Case(1, 2, 1, False, "alltoall", grouped=True, swiglu=True),
        Case(1, 2, 1, False, "allgather", bias=True, shared=True),
        Case(2, 1, 2, True, "alltoall"),
        Case(1, 1, 2, False, "alltoall", swiglu=True)],
    4: [Case(2, 2, 2, True, "alltoall", shared=True, qb=True),
        Case(2, 2, 1, False, "alltoall", grouped=True),
        Case(1, 4, 1, False, "allgather", swiglu=True)],
}

if __name__ == "__main__":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    failures = []
    for case in CASES[2] + (CASES[4] if world >= 4 else []):
        try:
            check_case(case, device="cuda")
        except AssertionError as error:
            failures.append(f"{case}: {error}")
    dist.destroy_process_group()
    if failures:
        raise SystemExit("\n".join(failures))
