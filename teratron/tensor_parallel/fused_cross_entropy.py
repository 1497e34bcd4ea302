"""Output layer + vocab-parallel cross entropy, without materialising the logits of all tokens.

The unfused path builds logits [s, b, V/tp] (and an fp32 copy, and the softmax saved for
backward): for long sequences and large vocabularies the largest activations of the model.
Here the tokens are processed in chunks of `chunk_size`: forward computes each chunk's logits,
its per-token loss (through `vocab_parallel_cross_entropy`, so padding, label smoothing and the
TP reductions are exactly the unfused path's) and drops them; backward recomputes each chunk's
logits to get d_hidden and d_weight. Only the hidden states, the weight and the targets are
saved, and no tensor with a vocab dim is larger than [chunk_size, V/tp].

The cost is one extra logits GEMM per chunk in backward (and the loss's small all-reduces
again), the same trade as activation recompute.
"""

import torch
import torch.nn.functional as F

from teratron.process_groups import get_pg_size
from teratron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from teratron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from teratron.tensor_parallel.utils import resolve_tp_group

# Budget for one chunk's fp32 logits when no chunk size is given.
DEFAULT_CHUNK_LOGITS_BYTES = 256 * 2**20


def default_chunk_size(vocab_partition: int) -> int:
    """Tokens per chunk so that a chunk's fp32 logits [chunk, V/tp] take about
    DEFAULT_CHUNK_LOGITS_BYTES."""
    return max(1, DEFAULT_CHUNK_LOGITS_BYTES // (4 * vocab_partition))


class _ChunkedOutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, label_smoothing, group, unpadded_vocab_size, chunk_size):
        # hidden [n, h], weight [V/tp, h], target [n] -> loss [n] (fp32)
        losses = [
            vocab_parallel_cross_entropy(F.linear(h, weight), t, label_smoothing, group, unpadded_vocab_size)
            for h, t in zip(hidden.split(chunk_size), target.split(chunk_size))
        ]
        ctx.args = (label_smoothing, group, unpadded_vocab_size, chunk_size)
        ctx.save_for_backward(hidden, weight, target)
        return torch.cat(losses)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, target = ctx.saved_tensors
        label_smoothing, group, unpadded_vocab_size, chunk_size = ctx.args
        grad_hidden = torch.empty_like(hidden)
        # fp32 accumulator: summing the chunks' products in a 16-bit weight dtype would round
        # each partial sum, unlike the unfused single GEMM.
        want_weight_grad = ctx.needs_input_grad[1]
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight_grad else None
        for h, t, g, gh in zip(hidden.split(chunk_size), target.split(chunk_size), grad_loss.split(chunk_size),
                               grad_hidden.split(chunk_size)):
            logits = F.linear(h, weight).requires_grad_(True)  # [chunk, V/tp]; backward runs without grad
            with torch.enable_grad():
                loss = vocab_parallel_cross_entropy(logits, t, label_smoothing, group, unpadded_vocab_size)
                (grad_logits,) = torch.autograd.grad(loss, logits, g)
            torch.mm(grad_logits, weight, out=gh)
            if not want_weight_grad:
                continue
            if grad_weight.dtype == grad_logits.dtype:
                grad_weight.addmm_(grad_logits.t(), h)
            else:
                grad_weight.add_(grad_logits.t().mm(h))
        if want_weight_grad:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def fused_vocab_parallel_cross_entropy(hidden, weight, target, label_smoothing: float = 0.0, group=None,
                                       unpadded_vocab_size: int | None = None, chunk_size: int | None = None,
                                       sequence_parallel: bool = False):
    """Per-token loss [s, b] (fp32) of the output layer `weight` [V/tp, h] (this rank's vocab
    rows, no bias) applied to `hidden` [s, b, h] ([s/tp, b, h] with sequence_parallel, gathered
    as ColumnParallelLinear does), against `target` [s, b] (global vocab ids). Equals
    vocab_parallel_cross_entropy(ColumnParallelLinear(hidden), target, ...) with the same
    arguments. `chunk_size`: tokens per chunk (None: default_chunk_size). `group`: the TP group
    (None: the current topology's)."""
    group = resolve_tp_group(group)
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (tokens per chunk), or None for the default")
    if hidden.dim() != 3 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [s, b, h] with h = the weight's "
                         f"input dim {weight.shape[-1]}")
    if get_pg_size(group) > 1:
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, True, group)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, group)
    if tuple(target.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"target shape {tuple(target.shape)} must be [s, b] = {tuple(hidden.shape[:2])}")
    s, b, h = hidden.shape
    loss = _ChunkedOutputCrossEntropy.apply(hidden.reshape(s * b, h), weight, target.reshape(s * b),
                                            label_smoothing, group, unpadded_vocab_size, chunk_size)
    return loss.view(s, b)
