"""Gradient-accumulation fusion (`gradient_accumulation_fusion`): the weight-gradient GEMM of a
linear layer adds straight into the parameter's fp32 `main_grad` (the DDP grad buffer view).

Without it backward writes dW in the params dtype, then DDP's hook adds it into main_grad:
an extra read of dW and a read-modify-write of main_grad per parameter and micro-batch. Here
cuBLAS computes main_grad += g^T @ x with bf16 inputs, fp32 accumulation and beta = 1 into the
fp32 buffer (`torch.addmm(..., out_dtype=float32)`), as Megatron's Apex kernel does; dW is also
never rounded to bf16. Elsewhere (CPU) the product is taken in main_grad's dtype.

The accumulation is a custom op, `teratron::wgrad_into_main_grad(grad_output, input, weight)`,
so a compiled layer traces through it without a graph break. It finds main_grad on the weight
when it runs: main_grad never enters a compiled graph (main_grads are views of one buffer, and
aliased graph inputs make the compiler copy that buffer). The op returns an uninitialised
placeholder that becomes the weight's .grad, so autograd still runs the parameter's
post-accumulate-grad hook (DDP's overlap needs it), and sets `weight.grad_added_to_main_grad`
(Megatron's name), which tells that hook to drop the placeholder and clear the flag. The flag is
set when the op runs, not when the layer is built: a weight whose gradient comes from elsewhere
(the fused cross entropy's output-layer weight) still has it added by the hook.

A layer marks its own weight with `fuse_wgrad_accumulation = True`; the fused GEMM runs for a
marked weight once DDP has given it a main_grad.
"""

import torch
import torch.nn.functional as F


@torch.library.custom_op("teratron::wgrad_into_main_grad", mutates_args=())
def wgrad_into_main_grad(grad_output: torch.Tensor, input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight.main_grad [out, in] += grad_output[t, out]^T @ input_[t, in]; returns a placeholder
    [out, in] for weight's .grad."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError("gradient_accumulation_fusion: the weight reached its weight-gradient GEMM without "
                           "a main_grad; wrap the model in DistributedDataParallel or set "
                           "gradient_accumulation_fusion=False")
    if main_grad.is_cuda and main_grad.dtype != grad_output.dtype:
        torch.addmm(main_grad, grad_output.t(), input_, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), input_.to(main_grad.dtype))
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


@wgrad_into_main_grad.register_fake
def _(grad_output, input_, weight):
    return torch.empty_like(weight)


def fuses_grad_accumulation(weight) -> bool:
    """Whether the GEMM adds `weight`'s gradient into its main_grad: the layer marked it, DDP gave
    it a main_grad, it is trained."""
    return (getattr(weight, "fuse_wgrad_accumulation", False) and hasattr(weight, "main_grad")
            and weight.requires_grad)


class LinearWithGradAccumulation(torch.autograd.Function):
    """y [*, out] = x [*, in] @ weight^T; backward accumulates dW into `weight.main_grad`."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_output @ weight if ctx.needs_input_grad[0] else None
        grad_weight = wgrad_into_main_grad(grad_output.reshape(-1, grad_output.shape[-1]),
                                           x.reshape(-1, x.shape[-1]), weight)
        return grad_input, grad_weight


def linear_with_grad_accumulation(x, weight, bias=None):
    """x @ weight^T (+ bias) with weight's gradient accumulated into `weight.main_grad`."""
    output = LinearWithGradAccumulation.apply(x, weight)
    return output if bias is None else output + bias
