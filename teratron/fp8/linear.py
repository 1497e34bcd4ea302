"""The FP8 GEMMs of a linear layer, through torch._scaled_mm (no Transformer Engine).

torch._scaled_mm(a, b, scale_a, scale_b, out_dtype) computes (a * scale_a) @ (b * scale_b) with
fp32 accumulation: the scales are DEquantisation scales (our scale_inv). It wants `a` row-major
and `b` column-major, and (on CUDA) the reduced and the output dimension divisible by 16; e5m2
may meet e4m3 but not e5m2. With x [t, in], W [out, in], g = dL/dy [t, out]:

  forward  y  [t, out] = x @ W^T    a = x_fp8,                     b = W_fp8.t() (a view)
  dgrad    dx [t, in]  = g @ W      a = g_fp8,                     b = W_fp8 column-major: W
                                                                   quantised again, one transposed
                                                                   copy (1 B/elem)
  wgrad    dW [out, in] = g^T @ x   a = g_fp8^T row-major,         b = x_fp8 column-major: two
                                                                   transposed copies (1 B/elem),
                                                                   t padded with zeros to a
                                                                   multiple of 16 (t is reduced)

Backward keeps the FP8 copy of x (1 byte per element instead of 2; with fp8_wgrad=False the
params-dtype x, from which dW = g^T @ x is computed in that dtype) and the weight itself, a
parameter that is alive anyway, with its scale: it is quantised again in backward (bit-identical
values) instead of keeping an FP8 copy per micro-batch in flight.
"""

import torch
from torch import nn

from teratron.fp8.scaling import make_scaler, quantize

GEMM_ALIGNMENT = 16


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _transposed(t_fp8: torch.Tensor) -> torch.Tensor:
    """[t, n] -> [n, t'] row-major, t' = t rounded up to a multiple of 16, the tail zero."""
    t, n = t_fp8.shape
    padded = _round_up(t, GEMM_ALIGNMENT)
    if padded == t:
        return t_fp8.t().contiguous()
    out = torch.zeros(n, padded, dtype=t_fp8.dtype, device=t_fp8.device)
    out[:, :t] = t_fp8.t()
    return out


class _Fp8Matmul(torch.autograd.Function):
    """y = x @ W^T with x [t, in] and W [out, in] quantised by `gemm`'s scalers."""

    @staticmethod
    def forward(ctx, x, weight, x_scale, w_scale, gemm):
        fwd = gemm.recipe.forward_dtype
        x_fp8 = quantize(x, x_scale, fwd).contiguous()  # _scaled_mm's first operand is row-major
        out = torch._scaled_mm(x_fp8, quantize(weight, w_scale, fwd).t(), scale_a=x_scale.reciprocal(),
                               scale_b=w_scale.reciprocal(), out_dtype=x.dtype)
        ctx.save_for_backward(x_fp8 if gemm.recipe.wgrad else x, x_scale, weight, w_scale)
        ctx.gemm = gemm
        return out

    @staticmethod
    def backward(ctx, grad):
        x_saved, x_scale, weight, w_scale = ctx.saved_tensors
        gemm = ctx.gemm
        grad = grad.contiguous()
        g_scale = gemm.grad_output_scaler.scale_for(grad, True)
        g_fp8 = quantize(grad, g_scale, gemm.recipe.backward_dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_fp8 = quantize(weight, w_scale, gemm.recipe.forward_dtype)
            dx = torch._scaled_mm(g_fp8, w_fp8.t().contiguous().t(), scale_a=g_scale.reciprocal(),
                                  scale_b=w_scale.reciprocal(), out_dtype=grad.dtype)
        if ctx.needs_input_grad[1]:
            if gemm.recipe.wgrad:
                dw = torch._scaled_mm(_transposed(g_fp8), _transposed(x_saved).t(), scale_a=g_scale.reciprocal(),
                                      scale_b=x_scale.reciprocal(), out_dtype=weight.dtype)
            else:
                dw = (grad.t() @ x_saved).to(weight.dtype)
        return dx, dw, None, None, None


class Fp8Gemm(nn.Module):
    """The FP8 matmul of one linear layer and the scaling state of its three tensors.

    `input_groups` / `weight_groups` / `grad_output_groups`: the process groups that tensor is
    sharded over (TP, CP), its amax all-reduced over each (scaling.py); empty when it is whole.
    `name` names the layer in errors.
    """

    def __init__(self, recipe, in_features: int, out_features: int, *, name: str, input_groups=(),
                 weight_groups=(), grad_output_groups=(), device=None):
        super().__init__()
        for size in (in_features, out_features):
            if size % GEMM_ALIGNMENT:
                raise ValueError(
                    f"fp8: {name} multiplies [{out_features} x {in_features}] per TP rank; FP8 GEMMs need "
                    f"both sizes divisible by {GEMM_ALIGNMENT}; choose hidden, FFN and head sizes whose "
                    "per-rank shards are multiples of 16, or keep this layer in bf16 "
                    "(first_last_layers_bf16) or set fp8=None")
        self.recipe, self.name = recipe, name
        fwd, bwd = recipe.forward_dtype, recipe.backward_dtype
        self.input_scaler = make_scaler(recipe, fwd, input_groups, device)
        self.weight_scaler = make_scaler(recipe, fwd, weight_groups, device)
        self.grad_output_scaler = make_scaler(recipe, bwd, grad_output_groups, device)

    def forward(self, x, weight, bias=None):
        """x [*, in], weight [out, in] -> [*, out] in x's dtype (bias added after the GEMM)."""
        shape = x.shape
        x = x.reshape(-1, x.shape[-1])
        update = torch.is_grad_enabled()
        x_scale, w_scale = self.input_scaler.scale_for(x, update), self.weight_scaler.scale_for(weight, update)
        out = _Fp8Matmul.apply(x, weight, x_scale, w_scale, self)
        out = out.view(*shape[:-1], out.shape[-1])
        return out if bias is None else out + bias
