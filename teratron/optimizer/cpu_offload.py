"""Optimizer CPU offload: which fp32 master params (and so their optimizer states) live on the CPU.

The chosen fraction of master params, by element count in parameter order, is created on the
CPU; torch optimizers create states like their params and step each param on its own device,
so those params and states step on the CPU. Grads are copied device-to-host before the step and
the updated values host-to-device after it (`main_grad_for`, and the optimizer's copy-back).
On a CPU-only machine the same code runs with host "devices" and must equal no offload.
"""

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


def main_grad_for(main: torch.Tensor, model_grad: torch.Tensor) -> torch.Tensor:
    """`model_grad` as the main param's fp32 grad on the main param's device (no copy when the
    grad is already fp32 on that device)."""
    return model_grad.to(device=main.device, dtype=torch.float32)
