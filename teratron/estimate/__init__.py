"""`teratron estimate`: peak memory per GPU (model states, activations under TP/SP/CP/PP/EP and
recompute, the loss) and FLOPs of a training configuration."""

from teratron.estimate.kernels import CUDA_KERNELS, KernelProfile, probe_kernels
from teratron.estimate.report import Estimate, estimate_from_args, format_table

__all__ = ["CUDA_KERNELS", "Estimate", "KernelProfile", "estimate_from_args", "format_table", "probe_kernels"]
