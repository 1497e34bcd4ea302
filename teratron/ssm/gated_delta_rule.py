"""The gated delta rule (Gated DeltaNet), per head of a sequence:

    S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T      S_t [dv, dk]
    o_t = S_t q_t

with alpha_t = exp(g_t) in (0, 1] (g the log gate) and beta_t in (0, 1). `gated_delta_rule_sequential`
runs it token by token (the definition; tests and decoding). `gated_delta_rule_chunked` computes the
same in chunks of L tokens. Writing u_t = beta_t (v_t - alpha_t S_{t-1} k_t), the update is
S_t = alpha_t S_{t-1} + u_t k_t^T; with gamma_t the product of the gates inside the chunk and S_0
the state entering it,

    S_t = gamma_t S_0 + sum_{j <= t} (gamma_t / gamma_j) u_j k_j^T
    u_t = beta_t (v_t - gamma_t S_0 k_t - sum_{j < t} (gamma_t / gamma_j)(k_t . k_j) u_j)

so the chunk's U solves one unit lower-triangular system, (I + diag(beta) M) U = diag(beta)
(V - diag(gamma) K S_0^T) with M_tj = (gamma_t / gamma_j)(k_t . k_j) for j < t, and

    o_t = gamma_t S_0 q_t + sum_{j <= t} (gamma_t / gamma_j)(q_t . k_j) u_j
    S_L = gamma_L S_0 + sum_j (gamma_L / gamma_j) u_j k_j^T

Shapes: q, k [b, s, h, dk], v [b, s, h, dv], g and beta [b, s, h], initial_state [b, h, dv, dk] or
None, seq_idx [b, s] int or None -> (o [b, s, h, dv], final state [b, h, dv, dk]). Computed in fp32
(or wider), returned in v's dtype. Layers normalise q and k (as Gated DeltaNet does) before calling
this. With seq_idx (packed documents, teratron.ssm.recurrence) each document starts from a zero
state: alpha = 0 where a row's seq_idx changes (the initial state, if any, goes to the row's first
document); the chunked forms add DOCUMENT_START_LOG_DECAY to g there.

`gated_delta_rule` is what layers call: the same computation by Triton kernels
(`gated_delta_rule_triton`, teratron.ssm.gated_delta_rule_triton) on CUDA tensors, by
`gated_delta_rule_chunked` elsewhere.
"""

import torch
import torch.nn.functional as F

from teratron.ssm.gated_delta_rule_triton import (INTERPRETED, MAX_KEY_DIM, SUPPORTED_DTYPES,
                                                  gated_delta_rule_triton, triton)
from teratron.ssm.recurrence import document_starts, start_log_decay


def _compute_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def gated_delta_rule_sequential(q, k, v, g, beta, initial_state=None, seq_idx=None):
    """The recurrence, one token at a time (see the module docstring); a document's first token
    (seq_idx) keeps none of the state before it."""
    b, s, h, dk = k.shape
    dtype, out_dtype = _compute_dtype(v), v.dtype
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    state = v.new_zeros(b, h, v.shape[-1], dk) if initial_state is None else initial_state.to(dtype)
    starts = torch.zeros(b, s, dtype=torch.bool, device=v.device) if seq_idx is None else document_starts(seq_idx)
    outputs = []
    for t in range(s):
        alpha = torch.exp(g[:, t]).masked_fill(starts[:, t, None], 0.0)[..., None, None]  # [b, h, 1, 1]
        kt, vt = k[:, t], v[:, t]
        predicted = torch.einsum("bhvk,bhk->bhv", state, kt)  # S_{t-1} k_t
        state = alpha * state + (beta[:, t, :, None] * (vt - alpha[..., 0] * predicted))[..., None] * kt[:, :, None]
        outputs.append(torch.einsum("bhvk,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1).to(out_dtype), state.to(out_dtype)


def gated_delta_rule_chunked(q, k, v, g, beta, initial_state=None, chunk_size: int = 64, seq_idx=None):
    """The same as `gated_delta_rule_sequential`, in chunks of `chunk_size` tokens (the end padded
    with beta = 0 and g = 0: those tokens neither change the state nor are returned)."""
    b, s, h, dk = k.shape
    if seq_idx is not None:
        g = g.to(_compute_dtype(g)) + start_log_decay(seq_idx).to(_compute_dtype(g))[..., None]
    dv = v.shape[-1]
    dtype, out_dtype = _compute_dtype(v), v.dtype
    pad = -s % chunk_size
    m = (s + pad) // chunk_size

    def chunks(t):  # [b, s, h, ...] -> [b, m, h, L, ...]
        t = F.pad(t.to(dtype), (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, m, chunk_size, *t.shape[2:]).transpose(2, 3)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]  # [b, m, h, L]
    log_gamma = torch.cumsum(g, dim=-1)
    L = chunk_size
    lower = torch.ones(L, L, dtype=torch.bool, device=v.device).tril()
    # gamma_t / gamma_j for j <= t (0 above the diagonal)
    ratio = torch.exp((log_gamma[..., :, None] - log_gamma[..., None, :]).masked_fill(~lower, float("-inf")))
    strictly = ratio * (~torch.eye(L, dtype=torch.bool, device=v.device))
    system = torch.eye(L, dtype=dtype, device=v.device) + beta[..., None] * strictly * (k @ k.transpose(-1, -2))
    gamma = torch.exp(log_gamma)[..., None]  # [b, m, h, L, 1]
    qk = ratio * (q @ k.transpose(-1, -2))  # (gamma_t / gamma_j)(q_t . k_j), j <= t

    state = v.new_zeros(b, h, dv, dk, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for c in range(m):
        kc, vc, qc = k[:, c], v[:, c], q[:, c]
        rhs = beta[:, c, ..., None] * (vc - gamma[:, c] * (kc @ state.transpose(-1, -2)))
        u = torch.linalg.solve_triangular(system[:, c], rhs, upper=False, unitriangular=True)  # [b, h, L, dv]
        outputs.append(gamma[:, c] * (qc @ state.transpose(-1, -2)) + qk[:, c] @ u)
        to_end = torch.exp(log_gamma[:, c, :, -1:] - log_gamma[:, c])[..., None]  # gamma_L / gamma_j
        state = torch.exp(log_gamma[:, c, :, -1])[..., None, None] * state + (to_end * u).transpose(-1, -2) @ kc
    o = torch.stack(outputs, dim=1).transpose(2, 3).reshape(b, m * L, h, dv)[:, :s]
    return o.to(out_dtype), state.to(out_dtype)


def gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64, seq_idx=None):
    """`gated_delta_rule_triton` for float32, bfloat16 and float16 v on CUDA when Triton is installed
    (and on CPU tensors under TRITON_INTERPRET=1) with dk up to 128, else `gated_delta_rule_chunked`:
    the same results and gradients."""
    args = (q, k, v, g, beta, initial_state)
    if (triton is not None and (v.is_cuda or INTERPRETED) and v.dtype in SUPPORTED_DTYPES
            and k.shape[-1] <= MAX_KEY_DIM):
        return gated_delta_rule_triton(*args, chunk_size=chunk_size, seq_idx=seq_idx)
    return gated_delta_rule_chunked(*args, chunk_size=chunk_size, seq_idx=seq_idx)
