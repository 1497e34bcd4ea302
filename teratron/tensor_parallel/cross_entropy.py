"""Cross entropy over vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits [..., V/tp] for its vocab range. Three small all-reduces over the
token dims (max, then target logit and sum of exps together) give the exact loss
log(sum_v exp(z_v)) - z_target, stably (the global max is subtracted first). It is computed in
fp32 and returns the per-token loss [...]; the gradient comes back in the logits' dtype. Only the
logits and two fp32 numbers per token are kept for backward, which recomputes the softmax; on a
GPU each pass is one compiled kernel (`teratron.fusions`), so no fp32 copy of the logits is
ever in memory.

Vocabulary padding is not part of the vocabulary: with `unpadded_vocab_size` = K, the columns
with global id >= K (the tail the vocab was padded with for TP) are excluded as if their logits
were -inf, so they take no probability mass and get exactly zero gradient, and the loss equals
F.cross_entropy over the K real columns whatever the padded size (and so the TP size) is.
Targets must be real ids (< K). `None` means no padding: every column is a class.

Label smoothing follows Megatron's convention: `label_smoothing` = alpha moves alpha of the
probability mass evenly onto the K - 1 non-target classes. That equals torch's
F.cross_entropy(label_smoothing=alpha * K / (K - 1)) over the K real logits. Megatron averages
the log-probabilities over each rank's local slice (so its smoothed loss changes with TP);
teratron averages over the whole vocabulary, so every TP layout gives the same loss.
"""

import torch
import torch.distributed as dist

from teratron import fusions
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.tensor_parallel.utils import VocabUtility, resolve_tp_group


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if get_pg_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def real_vocab_in_partition(unpadded_vocab_size: int | None, partition: int, rank: int) -> int:
    """How many of the leading columns of rank `rank`'s vocab slice [rank * partition, ...) are
    real tokens (padding is the tail of the global vocabulary, so it is a suffix of each slice)."""
    if unpadded_vocab_size is None:
        return partition
    return min(max(unpadded_vocab_size - rank * partition, 0), partition)


def _local_max(logits, real: int):
    """Max over this rank's real columns, fp32 [...] (-inf when it holds only padding)."""
    if real == 0:
        return logits.new_full(logits.shape[:-1], float("-inf"), dtype=torch.float32)
    return logits[..., :real].float().amax(dim=-1)


def _local_sums(logits, logits_max, local_target, outside, real: int, with_smoothing: bool):
    """[target logit, sum of exps (, sum of logits)] over this rank's real columns, each shifted
    by the global max, stacked: [2 or 3, ...] fp32."""
    shifted = logits.float() - logits_max.unsqueeze(-1)
    is_real = torch.arange(logits.shape[-1], device=logits.device) < real  # padding: exp -> 0
    target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    sums = [target_logit, torch.where(is_real, shifted.exp(), 0.0).sum(dim=-1)]
    if with_smoothing:
        sums.append(torch.where(is_real, shifted, 0.0).sum(dim=-1))
    return torch.stack(sums)


def _logits_grad(logits, logits_max, log_sum_exp, local_target, outside, grad_output, real: int,
                 smoothing: float, vocab_size: int):
    """d loss / d z = softmax - (1 - smoothing) * onehot(target) - smoothing / K on real columns,
    0 on padded ones; softmax recomputed as exp((z - max) - log_sum_exp) (the max subtracted first,
    exactly, as in forward), in the logits' dtype."""
    columns = torch.arange(logits.shape[-1], device=logits.device)
    is_real = columns < real
    shifted = logits.float() - logits_max.unsqueeze(-1)
    softmax = torch.where(is_real, (shifted - log_sum_exp.unsqueeze(-1)).exp(), 0.0)
    on_target = (columns == local_target.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    grad = softmax - on_target * (1.0 - smoothing)
    if smoothing > 0:
        grad = grad - is_real * (smoothing / vocab_size)
    return (grad * grad_output.unsqueeze(-1)).to(logits.dtype)


def _kernel(function, on_cuda: bool):
    # On a GPU each pass over the [tokens, V/tp] logits is one compiled kernel reading the
    # logits once, with no fp32 copies in memory; elsewhere the same function runs eagerly.
    return fusions.fused(function) if on_cuda else function


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, group, unpadded_vocab_size):
        logits, on_cuda = vocab_parallel_logits, vocab_parallel_logits.is_cuda
        partition = logits.shape[-1]
        world_size, rank = get_pg_size(group), get_pg_rank(group)
        vocab_size = unpadded_vocab_size or partition * world_size  # K, the real classes
        real = real_vocab_in_partition(unpadded_vocab_size, partition, rank)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(partition, rank, world_size)

        logits_max = _all_reduce(_kernel(_local_max, on_cuda)(logits, real), group, dist.ReduceOp.MAX)
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        sums = _kernel(_local_sums, on_cuda)(logits, logits_max, local_target, outside, real, label_smoothing > 0)
        sums = _all_reduce(sums, group)
        log_sum_exp = sums[1].log()
        loss = log_sum_exp - sums[0]

        smoothing = label_smoothing * vocab_size / (vocab_size - 1)
        if label_smoothing > 0:
            mean_log_prob = sums[2] / vocab_size - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_prob

        ctx.smoothing, ctx.vocab_size, ctx.real = smoothing, vocab_size, real
        # The logits themselves, not an fp32 softmax: backward recomputes it in one pass.
        ctx.save_for_backward(logits, logits_max, log_sum_exp, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        logits, logits_max, log_sum_exp, outside, local_target = ctx.saved_tensors
        grad = _kernel(_logits_grad, logits.is_cuda)(logits, logits_max, log_sum_exp, local_target, outside,
                                                     grad_output, ctx.real, ctx.smoothing, ctx.vocab_size)
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing: float = 0.0, group=None,
                                 unpadded_vocab_size: int | None = None):
    """Per-token loss [...] from logits [..., V/tp] split over the TP group and targets [...]
    (global vocab ids). `group=None` means the current topology's TP group. `unpadded_vocab_size`:
    the real vocabulary; columns past it are padding and excluded (None: no padding)."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal the logits' shape without "
                         f"the vocab dim {tuple(vocab_parallel_logits.shape[:-1])}")
    group = resolve_tp_group(group)
    padded = vocab_parallel_logits.shape[-1] * get_pg_size(group)
    if unpadded_vocab_size is not None and not 2 <= unpadded_vocab_size <= padded:
        raise ValueError(f"unpadded_vocab_size={unpadded_vocab_size} must be in [2, {padded}] (the padded "
                         f"vocabulary of the logits); pass the tokenizer's vocab size, or None for no padding")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, group,
                                            unpadded_vocab_size)
