"""OptimizerConfig: Megatron Core's optimizer fields, names and defaults."""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# Field -> the values it accepts.
_CHOICES = {
    "optimizer": ("adam", "sgd", "lion", "muon"),
    "muon_tp_mode": ("blockwise", "duplicated", "distributed"),
    "muon_scale_mode": ("spectral", "shape_scaling", "unit_rms_norm"),
    "muon_coefficient_type": ("simple", "quintic", "polar_express"),
    "muon_fp32_matmul_prec": ("highest", "high", "medium"),
    "muon_scalar_optimizer": ("adam", "lion"),
}


@dataclass
class OptimizerConfig:
    # ----- general -----
    optimizer: str = "adam"
    """'adam' (AdamW with decoupled_weight_decay), 'sgd', 'lion' or 'muon'."""
    lr: Optional[float] = None
    """Peak learning rate (the scheduler sets each step's value)."""
    min_lr: Optional[float] = None
    """Floor of the decayed learning rate."""
    decoupled_lr: Optional[float] = None
    """Separate peak learning rate for the input embedding and output layer."""
    decoupled_min_lr: Optional[float] = None
    """Floor of the decoupled learning rate."""
    weight_decay: float = 0.01
    """Weight-decay coefficient (biases and 1-D params such as norm weights get none)."""
    apply_wd_to_qk_layernorm: bool = False
    """Decay the q/k layernorm weights too (an exception to the 1-D rule)."""

    # ----- precision -----
    fp16: bool = False
    """fp16 params with fp32 master weights and loss scaling."""
    bf16: bool = False
    """bf16 params with fp32 master weights."""
    params_dtype: torch.dtype = torch.float32
    """dtype the model was initialised in."""

    # ----- loss scaling (fp16) -----
    loss_scale: Optional[float] = None
    """Static loss scale; None selects dynamic loss scaling."""
    initial_loss_scale: float = 2 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    """Successful steps between two doublings of the dynamic scale."""
    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic scale is halved."""

    # ----- Adam / SGD / Lion -----
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    decoupled_weight_decay: bool = True
    """AdamW (decay applied to the weights) when True, Adam with L2 in the gradient when False."""
    sgd_momentum: float = 0.9
    lion_beta1: float = 0.95
    """Lion: interpolation between momentum and gradient used for the sign update."""
    lion_beta2: float = 0.98
    """Lion: momentum EMA coefficient."""

    # ----- Muon -----
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    """Orthogonalise the Q, K and V parts of the fused QKV weight separately."""
    muon_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    """'medium' runs Newton-Schulz in bf16, 'high'/'highest' in fp32 (tf32 allowed for 'high')."""
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    """'blockwise': each TP shard alone (Megatron's default); 'duplicated': gather the full matrix
    on every TP rank; 'distributed': the full-matrix iteration with all-reduced Gram matrices."""
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"
    """Optimizer for the params Muon does not handle (embeddings, output layer, 1-D): adam|lion."""

    # ----- distributed optimizer -----
    # Whether to use it, and whether to overlap its param all-gathers, are the DDP buffers' to
    # say (DistributedDataParallelConfig.use_distributed_optimizer / overlap_param_gather).
    overlap_param_gather_with_optimizer_step: bool = False
    """Accepted for Megatron compatibility; must stay False."""

    # ----- CPU offload -----
    optimizer_cpu_offload: bool = False
    """Keep a fraction of the fp32 master weights and optimizer states on the CPU and step them there."""
    optimizer_offload_fraction: float = 0.0
    """Fraction (by parameter count) of master weights + states offloaded with optimizer_cpu_offload."""
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True

    # ----- misc -----
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (0 disables clipping)."""
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Optional[Callable] = None

    def __post_init__(self):
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name}={value!r} is unknown; choose one of {choices}")
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are both set; choose one (--fp16 or --bf16)")
        if self.muon_num_ns_steps < 1:
            raise ValueError(f"muon_num_ns_steps={self.muon_num_ns_steps} must be at least 1")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(f"optimizer_offload_fraction={self.optimizer_offload_fraction} must be in [0, 1]")
        self._check_hyperparameters()
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad={self.clip_grad} must be >= 0 (0 disables clipping)")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale={self.loss_scale} must be positive, or None for dynamic scaling")
        if self.hysteresis < 1:
            raise ValueError(f"hysteresis={self.hysteresis} must be at least 1")

    def _check_hyperparameters(self):
        """Finite and in range: a NaN or Inf here would train to NaN (or, for clip_grad, silently
        turn clipping off)."""
        for name in ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "weight_decay", "clip_grad",
                     "adam_eps", "sgd_momentum"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value} must be a finite number >= 0")
        for name in ("adam_beta1", "adam_beta2", "lion_beta1", "lion_beta2", "muon_momentum"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 <= value < 1.0):
                raise ValueError(f"{name}={value} must be in [0, 1)")
        if self.lr is not None and self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) is larger than lr ({self.lr})")
        if self.decoupled_lr is not None and (self.decoupled_min_lr or 0.0) > self.decoupled_lr:
            raise ValueError(f"decoupled_min_lr ({self.decoupled_min_lr}) is larger than decoupled_lr "
                             f"({self.decoupled_lr})")
        if self.optimizer_cpu_offload and self.optimizer == "muon":
            raise ValueError("optimizer_cpu_offload does not work with optimizer=muon; drop one")
