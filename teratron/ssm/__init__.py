"""State-space and linear-recurrence layers of hybrid models (Megatron Core: `megatron.core.ssm`):
Mamba-2's chunked state-space scan (`ssd`) and its causal depthwise convolution (`causal_conv1d`),
in plain PyTorch (the path the CPU tests run and the reference the GPU kernels are checked against)."""

from teratron.ssm.causal_conv1d import causal_conv1d
from teratron.ssm.ssd import ssd_chunked, ssd_sequential

__all__ = ["causal_conv1d", "ssd_chunked", "ssd_sequential"]
