"""Muon: momentum SGD whose update for each 2-D weight is orthogonalised by Newton-Schulz.

    m = beta * m + (1 - beta) * g          (g includes L2 decay when not decoupled)
    u = lerp(g, m, beta) if nesterov else m
    p = p * (1 - lr * wd) - lr * scale(shape) * NS(u)

NS always sees the full matrix, whatever the layout:
- distributed optimizer: a parameter given as a flat slice (attribute `dp_shard = (shape,
  start, end, group)`) has its momentum slices summed into the full matrix over `group`;
- tensor parallelism (`tensor_model_parallel`, `partition_dim`): 'duplicated' gathers the
  shards and orthogonalises the full matrix on every rank, 'distributed' runs the same
  iteration on the shards with all-reduced Gram matrices, 'blockwise' (Megatron's default)
  orthogonalises each shard on its own (cheapest, not the full-matrix update).
Orthogonalisation commutes with row/column permutations, so gathered shards need no reordering
(strided shards such as SwiGLU's [gate; up] included). A fused QKV weight (attribute
`muon_qkv_layout = (heads of each part per group, head dim)`: parts Q, K, V, or Q, gates, K, V
with gated attention) is orthogonalised per part.
"""

import contextlib

import torch
import torch.distributed as dist

from teratron import comm
from teratron.process_groups import get_pg_rank, get_pg_size

_COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    # Quintic coefficients tuned for 5 steps (Keller Jordan's modded-nanogpt).
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    # Polar Express (Amsel et al. 2025).
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
}


def _coefficients(coefficient_type, steps):
    coeffs = _COEFFICIENTS[coefficient_type]
    if coefficient_type == "simple":
        return coeffs * steps
    if coefficient_type == "polar_express":
        if steps < len(coeffs):
            raise ValueError(f"muon_num_ns_steps={steps} must be >= {len(coeffs)} for polar_express")
        return coeffs + coeffs[-1:] * (steps - len(coeffs))
    if steps % len(coeffs):
        raise ValueError(f"muon_num_ns_steps={steps} must be a multiple of {len(coeffs)} for {coefficient_type}")
    return coeffs * (steps // len(coeffs))


def get_muon_scale_factor(size_out: int, size_in: int, mode: str = "spectral") -> float:
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, size_out / size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    raise ValueError(f"muon_scale_mode={mode!r} is unknown; choose spectral, shape_scaling or unit_rms_norm")


@contextlib.contextmanager
def _matmul_precision(precision):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def newton_schulz(x, steps=5, coefficient_type="quintic", eps=1e-7, transpose=None, group=None,
                  matmul_precision="highest"):
    """Approximate U V^T of x = U S V^T (x: fp32 [m, n]).

    group: x is this rank's slice of the full matrix along its longer side (after `transpose`);
    the squared norm and the Gram matrices are all-reduced over `group`.
    """
    if transpose is None:
        transpose = x.size(0) > x.size(1)
    X = x.mT if transpose else x
    sq = (X * X).sum()
    if get_pg_size(group) > 1:
        dist.all_reduce(sq, group=group)
    X = X / sq.sqrt().clamp_min(eps)
    if matmul_precision == "medium":
        X = X.to(torch.bfloat16)
    with _matmul_precision("high" if matmul_precision == "high" else "highest"):
        for a, b, c in _coefficients(coefficient_type, steps):
            gram = X @ X.mT
            if get_pg_size(group) > 1:
                gram = gram.float()
                dist.all_reduce(gram, group=group)
                gram = gram.to(X.dtype)
            X = a * X + (b * gram + c * gram @ gram) @ X
    X = X.float()
    return X.mT if transpose else X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=3e-4, momentum=0.95, nesterov=False, weight_decay=0.01,
                 decoupled_weight_decay=True, num_ns_steps=5, coefficient_type="quintic",
                 scale_mode="spectral", extra_scale_factor=1.0, fp32_matmul_prec="medium",
                 tp_mode="blockwise", tp_group=None, expert_tp_group=None):
        _coefficients(coefficient_type, num_ns_steps)  # validate early
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))
        self.decoupled_weight_decay = decoupled_weight_decay
        self.num_ns_steps = num_ns_steps
        self.coefficient_type = coefficient_type
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra_scale_factor
        self.fp32_matmul_prec = fp32_matmul_prec
        self.tp_mode = tp_mode
        self.tp_group = tp_group
        self.expert_tp_group = expert_tp_group

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                momentum = state["momentum_buffer"]
                if wd > 0.0:
                    if self.decoupled_weight_decay:
                        p.mul_(1 - lr * wd)
                    else:
                        grad = grad + wd * p
                momentum.lerp_(grad, 1 - beta)
                update = grad.lerp(momentum, beta) if group["nesterov"] else momentum
                p.add_(self._orthogonalize(p, update), alpha=-lr)
        return loss

    # ----- full-matrix orthogonalisation -------------------------------------------------------

    def _orthogonalize(self, p, update):
        dp_shard = getattr(p, "dp_shard", None)
        if dp_shard is None:
            return self._orthogonalize_matrix(p, update)
        shape, start, end, dp_group = dp_shard
        flat = torch.zeros(torch.Size(shape).numel(), dtype=torch.float32, device=update.device)
        flat[start:end] = update.reshape(-1)
        if get_pg_size(dp_group) > 1:
            dist.all_reduce(flat, group=dp_group)
        return self._orthogonalize_matrix(p, flat.view(shape)).reshape(-1)[start:end].view_as(update)

    def _orthogonalize_matrix(self, p, matrix):
        """matrix: this TP rank's [out, in] block of the weight."""
        if matrix.dim() != 2:
            raise ValueError(f"Muon handles 2-D weights only, got shape {tuple(matrix.shape)}; "
                             "give 1-D params to the scalar optimizer")
        tp_group = self.expert_tp_group if not getattr(p, "allreduce", True) else self.tp_group
        partition_dim = None
        if self.tp_mode != "blockwise" and getattr(p, "tensor_model_parallel", False) and get_pg_size(tp_group) > 1:
            partition_dim = p.partition_dim
        layout = getattr(p, "muon_qkv_layout", None)
        if layout is None:
            return self._orthogonalize_block(matrix, partition_dim, tp_group)
        part_heads, head_dim = layout
        parts = matrix.view(-1, sum(part_heads), head_dim, matrix.shape[-1]).split(part_heads, dim=1)
        out = [self._orthogonalize_block(part.reshape(-1, matrix.shape[-1]), partition_dim, tp_group)
               .view(part.shape) for part in parts]
        return torch.cat(out, dim=1).view_as(matrix)

    def _orthogonalize_block(self, block, partition_dim, tp_group):
        full_shape = list(block.shape)
        if partition_dim is not None:
            full_shape[partition_dim] *= get_pg_size(tp_group)
        scale = get_muon_scale_factor(*full_shape, mode=self.scale_mode) * self.extra_scale_factor
        ns = dict(steps=self.num_ns_steps, coefficient_type=self.coefficient_type,
                  matmul_precision=self.fp32_matmul_prec)
        block = block.float()
        if partition_dim is None:
            return newton_schulz(block, **ns) * scale
        # Work with the shards stacked along dim 0 (transpose when split along dim 1).
        rows = block if partition_dim == 0 else block.mT
        if self.tp_mode == "distributed":
            out = newton_schulz(rows, transpose=True, group=tp_group, **ns)
        else:
            full = torch.empty(rows.shape[0] * get_pg_size(tp_group), rows.shape[1],
                               dtype=rows.dtype, device=rows.device)
            comm.all_gather_into_tensor(full, rows.contiguous(), tp_group)
            out = newton_schulz(full, **ns).chunk(get_pg_size(tp_group))[get_pg_rank(tp_group)]
        out = out * scale
        return out if partition_dim == 0 else out.mT
