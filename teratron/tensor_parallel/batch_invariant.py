"""Batch-invariant GEMMs (TransformerConfig.batch_invariant_mode, Megatron's --batch-invariant-mode):
a token's output of a linear layer is bit-identical whatever else is in the batch.

A GEMM library picks its kernel, blocking and split of the reduction by the problem's shape, so
the same row can be summed in another order when the batch has more or fewer rows (on CPU,
oneDNN/MKL treat a handful of rows differently from many; on GPU, cuBLAS picks split-K and tiles
by M). Here every GEMM runs in tiles of a fixed shape, [TILE_ROWS, in]: the input's rows
(all leading dims flattened) are cut into TILE_ROWS-row tiles, the last padded with zero rows, so
every call has one shape and one kernel, and a row's sums do not depend on its neighbours. Costs
a Python loop over tiles and up to TILE_ROWS - 1 padded rows per GEMM."""

import torch
import torch.nn.functional as F

TILE_ROWS = 16


def batch_invariant_linear(gemm, input_, weight, bias=None):
    """`gemm(x, weight, bias)` (F.linear's contract) over fixed-shape row tiles of `input_` [..., in]."""
    leading, width = input_.shape[:-1], input_.shape[-1]
    rows = input_.reshape(-1, width)  # [tokens, in]
    count = rows.shape[0]
    if count == 0:
        return gemm(input_, weight, bias)
    padded = F.pad(rows, (0, 0, 0, -count % TILE_ROWS))
    out = torch.cat([gemm(tile, weight, bias) for tile in padded.split(TILE_ROWS)])[:count]
    return out.reshape(*leading, out.shape[-1])
