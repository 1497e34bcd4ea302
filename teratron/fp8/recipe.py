"""FP8 settings from a TransformerConfig: validation, the recipe a linear layer uses, and which
layers run in FP8.

Megatron's fields: `fp8` ('e4m3': every FP8 tensor e4m3; 'hybrid': inputs and weights e4m3,
output gradients e5m2), `fp8_recipe` ('tensorwise': per-tensor current scaling; 'delayed': scale
from an amax history of `fp8_amax_history_len` uses, reduced by `fp8_amax_compute_algo`),
`fp8_margin`, `fp8_wgrad` (False: the weight gradient in the params dtype) and
`first_last_layers_bf16` with `num_layers_at_start_in_bf16` / `num_layers_at_end_in_bf16`.
`fp8_interval` is deprecated in Megatron (ignored, so a warning here); `tp_only_amax_red` is
what teratron always does (amaxes are reduced over TP only, see docs/performance.md "FP8").
"""

import warnings
from dataclasses import dataclass

import torch

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# Recompute modules that rerun linear layers: delayed scaling would quantise them again with a
# scale its history has moved on from (see check_fp8_config).
_RECOMPUTED_LINEARS = ("mlp", "moe", "mla_up_proj")


@dataclass(frozen=True)
class Fp8Recipe:
    """What one FP8 linear layer needs to know."""

    format: str = "hybrid"
    recipe: str = "tensorwise"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True

    @property
    def forward_dtype(self) -> torch.dtype:
        """Inputs and weights."""
        return torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        """Output gradients."""
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

    @classmethod
    def from_config(cls, config) -> "Fp8Recipe":
        return cls(format=config.fp8, recipe=config.fp8_recipe, margin=config.fp8_margin,
                   amax_history_len=config.fp8_amax_history_len,
                   amax_compute_algo=config.fp8_amax_compute_algo, wgrad=config.fp8_wgrad)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_fp8_config(config) -> None:
    """Raise ValueError for an FP8 setting teratron cannot run (called by TransformerConfig)."""
    if config.fp8_recipe not in RECIPES and (config.fp8 is not None or config.fp8_recipe is not None):
        raise ValueError(f"fp8_recipe={config.fp8_recipe!r} is not supported; use 'tensorwise' or 'delayed' "
                         "(--fp8-recipe)")
    if config.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"fp8_amax_compute_algo={config.fp8_amax_compute_algo!r} is not valid; use 'max' "
                         "or 'most_recent'")
    if not _is_int(config.fp8_amax_history_len) or config.fp8_amax_history_len < 1:
        raise ValueError(f"fp8_amax_history_len must be a positive integer, got {config.fp8_amax_history_len!r}")
    if not _is_int(config.fp8_margin):
        raise ValueError(f"fp8_margin must be an integer, got {config.fp8_margin!r}")
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        if not _is_int(getattr(config, name)) or getattr(config, name) < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {getattr(config, name)!r}")
    if config.fp8_interval != 1:
        warnings.warn("fp8_interval is deprecated (as in Megatron) and ignored")
    if config.fp8 is None:
        return
    if config.fp8 not in FORMATS:
        raise ValueError(f"fp8={config.fp8!r} is not an FP8 format; use 'e4m3' or 'hybrid' (--fp8-format)")
    if config.params_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8={config.fp8!r} needs bf16 or fp16 parameters, got params_dtype="
                         f"{config.params_dtype}; set bf16=True and params_dtype=torch.bfloat16 (--bf16)")
    recomputed = config.recompute_granularity == "full" or (
        config.recompute_granularity == "selective"
        and any(m in _RECOMPUTED_LINEARS for m in config.recompute_modules))
    if config.fp8_recipe == "delayed" and recomputed:
        raise ValueError("fp8_recipe='delayed' cannot recompute linear layers (recompute_granularity='full' "
                         "or recompute_modules 'mlp'/'moe'/'mla_up_proj'): the recompute would quantise with a "
                         "newer scale; use fp8_recipe='tensorwise' or recompute only 'core_attn'/'layernorm'")


def layer_uses_fp8(config, layer_number: int) -> bool:
    """Whether transformer layer `layer_number` (1-based, global) runs its linears in FP8."""
    if config.fp8 is None:
        return False
    if not config.first_last_layers_bf16:
        return True
    index = layer_number - 1
    return config.num_layers_at_start_in_bf16 <= index < config.num_layers - config.num_layers_at_end_in_bf16
