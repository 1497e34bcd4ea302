"""Cross entropy over vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits [..., V/tp] for its vocab range. Three small all-reduces over the
token dims (max, then target logit and sum of exps together) give the exact loss
log(sum_v exp(z_v)) - z_target, stably (the global max is subtracted first). It is computed in
fp32 and returns the per-token loss [...]; the gradient comes back in the logits' dtype.

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

from teratron import parallel_state
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.tensor_parallel.utils import VocabUtility


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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, group, unpadded_vocab_size):
        logits = vocab_parallel_logits.float()
        partition = logits.shape[-1]
        world_size, rank = get_pg_size(group), get_pg_rank(group)
        vocab_size = unpadded_vocab_size or partition * world_size  # K, the real classes
        real = real_vocab_in_partition(unpadded_vocab_size, partition, rank)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(partition, rank, world_size)

        local_max = logits[..., :real].amax(dim=-1) if real else logits.new_full(logits.shape[:-1], float("-inf"))
        logits_max = _all_reduce(local_max, group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        if real < partition:
            shifted[..., real:] = float("-inf")  # padding columns: exp -> 0
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp_logits = shifted.exp()
        sums = [target_logit, exp_logits.sum(dim=-1)]
        if label_smoothing > 0:
            sums.append(shifted[..., :real].sum(dim=-1))
        sums = _all_reduce(torch.stack(sums), group)
        log_sum_exp = sums[1].log()
        loss = log_sum_exp - sums[0]

        smoothing = label_smoothing * vocab_size / (vocab_size - 1)
        if label_smoothing > 0:
            mean_log_prob = sums[2] / vocab_size - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_prob

        ctx.smoothing, ctx.vocab_size, ctx.real, ctx.dtype = smoothing, vocab_size, real, vocab_parallel_logits.dtype
        ctx.save_for_backward(exp_logits.div_(sums[1].unsqueeze(-1)), outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, local_target = ctx.saved_tensors
        # d loss / d z = softmax - (1 - smoothing) * onehot(target) - smoothing / K on real
        # columns; 0 on padded ones (their softmax is 0 and they are never targets).
        grad = softmax.clone()  # the saved softmax stays intact for a retained graph
        on_target = (~outside).to(grad.dtype) * (1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -on_target.unsqueeze(-1))
        if ctx.smoothing > 0:
            grad[..., :ctx.real].sub_(ctx.smoothing / ctx.vocab_size)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing: float = 0.0, group=None,
                                 unpadded_vocab_size: int | None = None):
    """Per-token loss [...] from logits [..., V/tp] split over the TP group and targets [...]
    (global vocab ids). `group=None` means parallel_state's TP group. `unpadded_vocab_size`:
    the real vocabulary; columns past it are padding and excluded (None: no padding)."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal the logits' shape without "
                         f"the vocab dim {tuple(vocab_parallel_logits.shape[:-1])}")
    group = parallel_state.get_tensor_model_parallel_group() if group is None else group
    padded = vocab_parallel_logits.shape[-1] * get_pg_size(group)
    if unpadded_vocab_size is not None and not 2 <= unpadded_vocab_size <= padded:
        raise ValueError(f"unpadded_vocab_size={unpadded_vocab_size} must be in [2, {padded}] (the padded "
                         f"vocabulary of the logits); pass the tokenizer's vocab size, or None for no padding")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, group,
                                            unpadded_vocab_size)
