"""Optimizer CPU offload: which fp32 master params (and so their optimizer states) live on the CPU.

The chosen fraction of master params, by element count in parameter order, is created on the
CPU; torch optimizers create states like their params and step each param on its own device,
so those params and states step on the CPU. Grads are copied device-to-host before the step and
the updated values host-to-device after it (`main_grad_for`, and the optimizer's copy-back).
On a CPU-only machine the same code runs with host "devices" and must equal no offload.

The host step is as fast as the cores it gets: torchrun starts each process with
OMP_NUM_THREADS=1, so under torchrun `use_host_cores` gives every local process its share of the
machine's cores when torch would otherwise step on one. Grads land in a pinned host buffer per master
(allocated once), which copies faster than pageable memory.
"""

import os

import torch


def select_offloaded(numels, fraction: float) -> set:
    """Indices of the first tensors (in order) whose element counts cover `fraction` of the total."""
    budget, taken, chosen = fraction * sum(numels), 0, set()
    for index, numel in enumerate(numels):
        if fraction == 0.0 or taken >= budget:
            break
        chosen.add(index)
        taken += numel
    return chosen


def make_master(model_tensor: torch.Tensor, offload: bool, pin: bool) -> torch.Tensor:
    """An fp32 copy of `model_tensor`, on the CPU (pinned when asked and CUDA exists) if offloaded."""
    device = torch.device("cpu") if offload else model_tensor.device
    master = model_tensor.detach().to(device=device, dtype=torch.float32, copy=True)
    if offload and pin and torch.cuda.is_available():
        master = master.pin_memory()
    return master


def use_host_cores() -> int:
    """Under torchrun (LOCAL_WORLD_SIZE set), if torch runs single-threaded (torchrun's default),
    use this process's share of the cores (cores / LOCAL_WORLD_SIZE) for the host optimizer step;
    returns the thread count. Other launchers keep the thread count they chose (a process forked
    from one that already ran threads can hang if it raises it)."""
    local_world_size = os.environ.get("LOCAL_WORLD_SIZE")
    if local_world_size is not None and torch.get_num_threads() == 1:
        share = (os.cpu_count() or 1) // max(1, int(local_world_size))
        if share > 1:
            torch.set_num_threads(share)
    return torch.get_num_threads()


def main_grad_for(main: torch.Tensor, model_grad: torch.Tensor) -> torch.Tensor:
    """`model_grad` as the main param's fp32 grad on the main param's device (no copy when the
    grad is already fp32 on that device; into a reused pinned buffer for a pinned host master)."""
    if main.device == model_grad.device or not main.is_pinned():
        return model_grad.to(device=main.device, dtype=torch.float32)
    host_grad = getattr(main, "_host_grad", None)
    if host_grad is None:
        host_grad = main._host_grad = torch.empty_like(main, pin_memory=True)
    return host_grad.copy_(model_grad)
