"""Gradient statistics (norm, zero count), clipping and the parameter norm.

A statistic is a sum of per-rank partial sums, all-reduced over a list of process groups whose
product is the whole tp x dp_cp x pp grid. Each distinct element enters once: callers pass only
tensors that are not duplicates of another rank's (`param_is_counted`), and grads replicated
over data parallelism only from the replica group's rank 0 (see MegatronOptimizer).
"""

import math

import torch
import torch.distributed as dist

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.topology import resolve_pg_collection


def all_reduce_over_groups(tensor, groups, op=dist.ReduceOp.SUM):
    """All-reduce `tensor` in place over each group of `groups` in turn (groups of one skipped)."""
    for group in groups:
        if get_pg_size(group) > 1:
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def param_is_counted(param, tp_group=None, pp_group=None) -> bool:
    """False for copies counted elsewhere: TP-replicated params off TP rank 0 (norm weights,
    biases of row-parallel layers), and the output-layer copy of a tied embedding (`shared`,
    or `shared_embedding` off the first pipeline stage)."""
    if getattr(param, "shared", False):
        return False
    if getattr(param, "shared_embedding", False) and get_pg_rank(pp_group) != 0:
        return False
    return getattr(param, "tensor_model_parallel", False) or get_pg_rank(tp_group) == 0


def by_device(tensors) -> dict:
    """{device: [tensors on it]}, in order: multi-tensor (`torch._foreach_*`) kernels take one
    device per call, and CPU offload puts some main params on the host."""
    groups = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


def local_grad_stats(grads, count_zeros: bool = False) -> torch.Tensor:
    """[sum of squares, number of zero elements] of this rank's `grads`, in fp64 so that the
    count stays exact past 2**24 (the count is 0 unless `count_zeros`)."""
    # The accumulator lives on the collective's device; grads may sit elsewhere (CPU offload).
    stats = torch.zeros(2, dtype=torch.float64, device=default_device())
    # One multi-tensor norm per device instead of a few kernels per grad: hundreds of small
    # launches the GPU would wait for at the end of every step.
    for group in by_device([grad.detach() for grad in grads]).values():
        norms = torch._foreach_norm(group, 2, dtype=torch.float32)
        stats[0] += torch.stack(norms).double().square().sum().to(stats)
        if count_zeros:
            for grad in group:
                stats[1] += (grad.numel() - torch.count_nonzero(grad)).to(stats)
    return stats


def clip_grad_by_total_norm_fp32(parameters, max_norm: float, total_norm: float) -> None:
    """Scale every `param.grad` by max_norm / total_norm when that is below 1."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        grads = [param.grad.detach() for param in parameters if param.grad is not None]
        for group in by_device(grads).values():
            torch._foreach_mul_(group, clip_coeff)


def calc_params_l2_norm(model_chunks, pg_collection=None) -> float:
    """L2 norm of all model parameters, each distinct element counted once across TP, PP and
    (expert params) EP ranks; data-parallel replicas hold identical params and are not summed."""
    if not isinstance(model_chunks, (list, tuple)):
        model_chunks = [model_chunks]
    pg_collection = resolve_pg_collection(pg_collection)
    dense, expert = [], []
    for chunk in model_chunks:
        for param in chunk.parameters():
            is_expert = not getattr(param, "allreduce", True)
            tp = pg_collection.expt_tp if is_expert else pg_collection.tp
            if param_is_counted(param, tp, pg_collection.pp):
                (expert if is_expert else dense).append(param)
    dense_sq, expert_sq = _sum_of_squares(dense), _sum_of_squares(expert)
    all_reduce_over_groups(dense_sq, [pg_collection.tp, pg_collection.pp])
    all_reduce_over_groups(expert_sq, [pg_collection.expt_tp, pg_collection.ep, pg_collection.pp])
    return math.sqrt((dense_sq + expert_sq).item())


def _sum_of_squares(params) -> torch.Tensor:
    """fp32 sum of the squared elements of `params` (any devices), on the default device."""
    device = default_device()
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in by_device([param.detach() for param in params]).values():
        total += torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).square().sum().to(device)
    return total


def default_device():
    """Where statistics are reduced: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
