"""LayerNorm and RMSNorm over the last dimension, through torch's functional kernels.

`Norm(config, hidden_size, eps)` builds whichever `config.normalization` names (Megatron's
TENorm idiom), so a spec can leave the choice to the config. With
`layernorm_zero_centered_gamma` the weight is stored as gamma - 1 (starts at 0, so weight decay
pulls gamma towards 1). Under sequence parallelism each TP rank sees only its slice of the
sequence, so the parameters carry `sequence_parallel=True` and `finalize_model_grads` sums their
gradients over TP.
"""

import torch
import torch.nn.functional as F

from teratron.tensor_parallel.layers import param_device

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class _Norm(torch.nn.Module):
    has_bias = True

    def __init__(self, config, hidden_size: int, eps: float | None = None):
        super().__init__()
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.normalized_shape = (hidden_size,)
        factory = dict(dtype=config.params_dtype, device=param_device(config))
        fill = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(fill(hidden_size, **factory))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, **factory)) if self.has_bias else None
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def _gamma(self, dtype):
        weight = self.weight.to(dtype)
        return weight + 1 if self.zero_centered_gamma else weight

    def forward(self, x):
        # Computed in the input's dtype (fp32 under fp32_residual_connection), returned in the
        # parameters' dtype, which is what the next linear layer expects.
        return self._normalize(x).to(self.weight.dtype)


class LayerNorm(_Norm):
    def _normalize(self, x):
        return F.layer_norm(x, self.normalized_shape, self._gamma(x.dtype), self.bias.to(x.dtype), self.eps)


class RMSNorm(_Norm):
    has_bias = False

    def _normalize(self, x):
        return F.rms_norm(x, self.normalized_shape, self._gamma(x.dtype), self.eps)


class Norm:
    """Builds LayerNorm or RMSNorm, as `config.normalization` says."""

    def __new__(cls, config, hidden_size: int, eps: float | None = None):
        if config.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported; use one of {NORMALIZATIONS}"
            )
        norm_cls = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
        return norm_cls(config, hidden_size, eps)
