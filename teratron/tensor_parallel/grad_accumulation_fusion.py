"""Gradient-accumulation fusion (`gradient_accumulation_fusion`): the weight-gradient GEMM of a
linear layer adds straight into the parameter's fp32 `main_grad` (the DDP grad buffer view).

Without it backward writes dW in the params dtype, then DDP's hook adds it into main_grad:
an extra read of dW and a read-modify-write of main_grad per parameter and micro-batch. Here
cuBLAS computes main_grad += g^T @ x with bf16 inputs, fp32 accumulation and beta = 1 into the
fp32 buffer (`torch.addmm(..., out_dtype=float32)`), as Megatron's Apex kernel does; dW is also
never rounded to bf16. Elsewhere (CPU) the product is taken in main_grad's dtype.

The accumulation is a custom op that declares its mutation of main_grad, so Dynamo traces a
compiled layer through it without a graph break. The weight still receives a gradient, an
uninitialised placeholder, so that autograd runs the parameter's post-accumulate-grad hook
(DDP's overlap needs it); the weight carries `grad_added_to_main_grad = True`, which tells
the hook to drop the placeholder instead of adding it.
"""

import torch
import torch.nn.functional as F


@torch.library.custom_op("teratron::wgrad_accumulate_", mutates_args=("main_grad",))
def wgrad_accumulate_(main_grad: torch.Tensor, grad_output: torch.Tensor, input_: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output[t, out]^T @ input_[t, in]."""
    if main_grad.is_cuda and main_grad.dtype != grad_output.dtype:
        torch.addmm(main_grad, grad_output.t(), input_, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), input_.to(main_grad.dtype))


@wgrad_accumulate_.register_fake
def _(main_grad, grad_output, input_):
    return None


def main_grad_to_fuse(weight):
    """`weight.main_grad` when its gradient is to be accumulated there by the GEMM (the layer
    marked it, DDP gave it a main_grad, it is trained), else None."""
    if getattr(weight, "grad_added_to_main_grad", False) and hasattr(weight, "main_grad") and weight.requires_grad:
        return weight.main_grad
    return None


def weight_gradient(grad_output, input_, weight, main_grad):
    """The weight's gradient g^T x of a linear layer (grad_output [*, out], input_ [*, in]): dW in
    the weight's dtype when main_grad is None, else added into main_grad (a placeholder returned)."""
    grad_output = grad_output.reshape(-1, grad_output.shape[-1])
    input_ = input_.reshape(-1, input_.shape[-1])
    if main_grad is None:
        return grad_output.t() @ input_
    wgrad_accumulate_(main_grad, grad_output, input_)
    return torch.empty_like(weight)


class LinearWithGradAccumulation(torch.autograd.Function):
    """y [*, out] = x [*, in] @ weight^T; backward accumulates dW into `main_grad`."""

    @staticmethod
    def forward(ctx, x, weight, main_grad):
        ctx.save_for_backward(x, weight)
        # Not saved for backward: main_grad shares its version counter with the whole grad
        # buffer, which other layers' backward writes before this one runs.
        ctx.main_grad = main_grad
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_output @ weight if ctx.needs_input_grad[0] else None
        return grad_input, weight_gradient(grad_output, x, weight, ctx.main_grad), None


def linear_with_grad_accumulation(x, weight, bias=None):
    """x @ weight^T (+ bias) with weight's gradient accumulated into `weight.main_grad`."""
    output = LinearWithGradAccumulation.apply(x, weight, weight.main_grad)
    return output if bias is None else output + bias
