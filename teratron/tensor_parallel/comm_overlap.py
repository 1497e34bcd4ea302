"""Tensor-parallel communication overlapped with the GEMMs (`tp_comm_overlap`, `--tp-comm-overlap`).

Under sequence parallelism a column-parallel layer all-gathers its input along the sequence
before its GEMM, and a row-parallel layer reduce-scatters its GEMM's output; backward does the
dual (reduce-scatter after the column layer's dgrad GEMM, all-gather before the row layer's).
Run one after the other, the collectives leave the GPU's math units idle. Here each collective
and its GEMM form one op that splits the GEMM into per-rank chunks along the sequence, so the
chunk from (or for) one rank moves while another's computes:

  column  forward  y [s, b, out/tp]   = all_gather(x [s/tp, b, in]) @ W^T      all_gather_matmul
          backward dx [s/tp, b, in]   = reduce_scatter(dy @ W)                  matmul_reduce_scatter
  row     forward  y [s/tp, b, out]   = reduce_scatter(x [s, b, in/tp] @ W^T)   matmul_reduce_scatter
          backward dx [s, b, in/tp]   = all_gather(dy) @ W                      all_gather_matmul

On CUDA these are PyTorch's symmetric-memory ops (`torch.ops.symm_mem.fused_all_gather_matmul`
and `fused_matmul_reduce_scatter`: chunks copied peer to peer over NVLink on side streams;
Transformer Engine's userbuffers play this part in Megatron). Elsewhere (CPU, gloo) the same
functions run the collective and then the GEMM, so these autograd functions are tested on CPU
against the plain layers. Weight gradients come from the gathered tensors saved in forward
(or gathered in backward), and go into main_grad with gradient-accumulation fusion.
"""

import warnings

import torch

from teratron.tensor_parallel.grad_accumulation_fusion import weight_gradient
from teratron.tensor_parallel.mappings import _gather_along_first_dim, _reduce_scatter_along_first_dim


def enable_for_group(group, device: torch.device) -> None:
    """Set up symmetric memory for the TP group (once per group; needed on CUDA only)."""
    if device.type == "cuda":
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        with warnings.catch_warnings():  # needed before torch 2.10, a deprecated no-op since
            warnings.simplefilter("ignore", FutureWarning)
            enable_symm_mem_for_group(group.group_name)


def all_gather_matmul(x_shard, matrix, group):
    """(all_gather(x_shard) along dim 0, that @ matrix): [n/tp, *, k] -> [n, *, k], [n, *, m]."""
    if x_shard.is_cuda:
        x_full, (product,) = torch.ops.symm_mem.fused_all_gather_matmul(x_shard, [matrix], 0, group.group_name)
        return x_full, product
    x_full = _gather_along_first_dim(x_shard, group)
    return x_full, x_full @ matrix


def matmul_reduce_scatter(x, matrix, group):
    """reduce_scatter(x @ matrix) along dim 0, summed: [n, *, k] -> [n/tp, *, m]."""
    if x.is_cuda:
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, matrix, "sum", 0, group.group_name)
    return _reduce_scatter_along_first_dim(x @ matrix, group)


class AllGatherLinear(torch.autograd.Function):
    """Column-parallel GEMM under SP: y [s, b, out/tp] = all_gather(x [s/tp, b, in]) @ weight^T.
    `fuse_wgrad`: add the weight gradient into weight.main_grad (gradient-accumulation fusion)."""

    @staticmethod
    def forward(ctx, x_shard, weight, fuse_wgrad, group):
        x_full, output = all_gather_matmul(x_shard, weight.t(), group)
        ctx.save_for_backward(x_full, weight)
        ctx.fuse_wgrad, ctx.group = fuse_wgrad, group
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x_full, weight = ctx.saved_tensors
        grad_input = matmul_reduce_scatter(grad_output, weight, ctx.group)
        return grad_input, weight_gradient(grad_output, x_full, weight, ctx.fuse_wgrad), None, None


class LinearReduceScatter(torch.autograd.Function):
    """Row-parallel GEMM under SP: y [s/tp, b, out] = reduce_scatter(x [s, b, in/tp] @ weight^T)."""

    @staticmethod
    def forward(ctx, x, weight, fuse_wgrad, group):
        ctx.save_for_backward(x, weight)
        ctx.fuse_wgrad, ctx.group = fuse_wgrad, group
        return matmul_reduce_scatter(x, weight.t(), group)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_output_full, grad_input = all_gather_matmul(grad_output, weight, ctx.group)
        return grad_input, weight_gradient(grad_output_full, x, weight, ctx.fuse_wgrad), None, None
