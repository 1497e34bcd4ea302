"""What the few kernel-dependent autograd ops keep for backward, measured rather than assumed.

Everything else the activation model counts (linear inputs, SwiGLU pieces, RoPE tables, flash
attention's q/k/v/out) is decided by teratron's own code and is the same on every device. Two
ops are not:

- RMSNorm: CUDA runs torch's fused kernel, which keeps its input (activation dtype) and an fp32
  1/rms per row; the composite fallback (CPU) keeps an fp32 upcast of the input and the fp32
  normalised value before the weight, 8 bytes per element whatever the dtype.
- dropout: CUDA's fused kernel keeps a 1-byte mask; the CPU path keeps the scaled noise in the
  activation dtype.
- LayerNorm keeps its input and a mean and 1/std per row: fp32 on CUDA, the input's dtype on
  CPU.
- the cross entropy's passes are compiled kernels on CUDA (no fp32 temporaries), eager on CPU
  (the rule of `tensor_parallel.cross_entropy._kernel`); Adam is torch's fused kernel on CUDA
  (`optimizer._torch_optimizer_factory`), foreach with a sqrt(v) temporary elsewhere.

`probe_kernels(device, dtype)` runs both ops on a tiny tensor under `saved_tensors_hooks` and
reads off which variant the device uses; `CUDA_KERNELS` is the answer for CUDA when the estimate
runs on a machine without a GPU.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from teratron.ssm.ssd_triton import INTERPRETED, triton


@dataclass(frozen=True)
class KernelProfile:
    fused_rms_norm: bool
    fused_dropout: bool
    layer_norm_stat_bytes: int
    compiled_loss: bool = False  # the cross entropy's passes run compiled (tensor_parallel.cross_entropy)
    fused_adam: bool = False  # Adam steps on-device parameters with torch's fused kernel (no temporaries)
    triton_scans: bool = False  # Mamba's and Gated DeltaNet's Triton kernels run (not their PyTorch paths)

    def dropout_bytes_per_element(self, act_bytes: int) -> int:
        return 1 if self.fused_dropout else act_bytes


CUDA_KERNELS = KernelProfile(fused_rms_norm=True, fused_dropout=True, layer_norm_stat_bytes=4, compiled_loss=True,
                            fused_adam=True, triton_scans=True)


def _saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd keeps for `fn(*inputs)`, parameters excluded."""
    storages = {}

    def pack(t):
        if t.numel() > 1 and not any(t is x for x in inputs[1:]):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def probe_kernels(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> KernelProfile:
    """Which variants `device` runs, read off the bytes each op keeps for a [64, 256] input."""
    rows, width = 64, 256
    x = torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)
    weight = torch.ones(width, device=device, dtype=dtype, requires_grad=True)
    element = x.element_size()
    norm = _saved_bytes(lambda t, w: F.rms_norm(t, (width,), w, 1e-5), x, weight)
    drop = _saved_bytes(lambda t: F.dropout(t, 0.5, True), x)
    layer_norm = _saved_bytes(lambda t, w: F.layer_norm(t, (width,), w, None, 1e-5), x, weight)
    return KernelProfile(fused_rms_norm=norm < rows * width * 8, fused_dropout=drop < rows * width * element,
                         layer_norm_stat_bytes=(layer_norm - rows * width * element) // (2 * rows),
                         compiled_loss=device.type == "cuda", fused_adam=device.type == "cuda",
                         triton_scans=triton is not None and (device.type == "cuda" or INTERPRETED))


def kernels_for(device_type: str, dtype: torch.dtype) -> KernelProfile:
    """The profile of `device_type` ('cuda' or 'cpu'): probed when that device is here."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return CUDA_KERNELS
    return probe_kernels(torch.device(device_type), dtype)
