"""Global gradient norm, clipping, zero counting and the parameter norm.

Every statistic is a sum over this rank's tensors, all-reduced over a list of process groups
whose product covers each distinct element once (e.g. [tp, pp] for replicated data-parallel
grads, [tp, pp, dp_cp] when the distributed optimizer shards them over data parallelism).
Callers pass only tensors that are not duplicates of another rank's (see `param_is_counted`).
"""

import math

import torch
import torch.distributed as dist

from teratron.process_groups import ProcessGroupCollection, get_pg_rank, get_pg_size


def _all_reduce(tensor, groups, op=dist.ReduceOp.SUM):
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


def get_grad_norm_fp32(grads_for_norm, norm_type=2.0, grad_stats_groups=()) -> float:
    """The global `norm_type` norm (2 or inf) of `grads_for_norm` over `grad_stats_groups`."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    norm_type = float(norm_type)
    # The accumulator lives on the collective's device; grads may sit elsewhere (CPU offload).
    total = torch.zeros((), dtype=torch.float32, device=default_device())
    if norm_type == math.inf:
        for grad in grads_for_norm:
            if grad.numel():
                total = torch.maximum(total, grad.detach().abs().max().float().to(total.device))
        return _all_reduce(total, grad_stats_groups, dist.ReduceOp.MAX).item()
    for grad in grads_for_norm:
        total += (grad.detach().float().norm(norm_type) ** norm_type).to(total.device)
    return _all_reduce(total, grad_stats_groups).item() ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(parameters, max_norm: float, total_norm: float) -> None:
    """Scale every `param.grad` by max_norm / total_norm when that is below 1."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for param in parameters:
            if param.grad is not None:
                param.grad.detach().mul_(clip_coeff)


def count_zeros_fp32(parameters, grad_stats_groups=(), tp_group=None, pp_group=None) -> int:
    """Number of exactly-zero gradient elements over the counted params of all ranks."""
    total = torch.zeros((), dtype=torch.float32, device=default_device())
    for param in parameters:
        if param.grad is not None and param_is_counted(param, tp_group, pp_group):
            grad = param.grad.detach()
            total += (grad.numel() - torch.count_nonzero(grad)).to(total.device)
    return int(_all_reduce(total, grad_stats_groups).item())


def calc_params_l2_norm(model_chunks, pg_collection=None) -> float:
    """L2 norm of all model parameters, each distinct element counted once across TP, PP and
    (expert params) EP ranks; data-parallel replicas hold identical params and are not summed."""
    if not isinstance(model_chunks, (list, tuple)):
        model_chunks = [model_chunks]
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    dense, expert = [], []
    for chunk in model_chunks:
        for param in chunk.parameters():
            is_expert = not getattr(param, "allreduce", True)
            tp = pg_collection.expt_tp if is_expert else pg_collection.tp
            if param_is_counted(param, tp, pg_collection.pp):
                (expert if is_expert else dense).append(param)
    device = default_device()
    dense_sq = torch.zeros((), dtype=torch.float32, device=device)
    for param in dense:
        dense_sq += (param.detach().float().norm() ** 2).to(device)
    expert_sq = torch.zeros((), dtype=torch.float32, device=device)
    for param in expert:
        expert_sq += (param.detach().float().norm() ** 2).to(device)
    _all_reduce(dense_sq, [pg_collection.tp, pg_collection.pp])
    _all_reduce(expert_sq, [pg_collection.expt_tp, pg_collection.ep, pg_collection.pp])
    return math.sqrt((dense_sq + expert_sq).item())


def default_device():
    """Where statistics are reduced: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
