"""Mamba-2's selective state-space model (SSD), per head h of a sequence:

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T        S_t [p, n], x_t [p], B_t [n]
    y_t = S_t C_t + D_h * x_t                                  C_t [n]

with B and C shared by the heads of a group (g groups of h / g heads). `ssd_sequential` runs the
recurrence step by step (the definition; tests and decoding). `ssd_chunked` computes the same in
chunks of L tokens with matrix products, as Mamba-2's SSD algorithm does: with a_t = dt_t A_h and
its running sum inside a chunk, cum_i,

    within a chunk      y_i += sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j
    a chunk's state     S   = sum_j exp(cum_last - cum_j) dt_j x_j B_j^T
    between chunks      H_c = exp(cum_last of c-1) H_{c-1} + S_{c-1}   (H_0: the initial state)
    from earlier chunks y_i += exp(cum_i) H_c C_i

Shapes: x [b, s, h, p], dt [b, s, h] (positive: after softplus), A [h] (negative), B and C
[b, s, g, n], D [h] or None, initial_state [b, h, p, n] or None, seq_idx [b, s] int or None ->
(y [b, s, h, p], final state [b, h, p, n]). Computed in fp32 (or the inputs' wider dtype), returned
in x's dtype. With seq_idx (packed documents, teratron.ssm.recurrence) each document starts from a
zero state: the state is dropped where a row's seq_idx changes (the initial state, if any, goes to
the row's first document); the chunked forms add DOCUMENT_START_LOG_DECAY to a there.

`ssd` is what layers call: the same computation by Triton kernels (`ssd_triton`, teratron.ssm.ssd_triton)
on CUDA tensors, by `ssd_chunked` elsewhere.
"""

import torch
import torch.nn.functional as F

from teratron.ssm.recurrence import document_starts, start_log_decay
from teratron.ssm.ssd_triton import INTERPRETED, SUPPORTED_DTYPES, ssd_triton, triton


def _compute_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


def _heads(t, h: int):
    """[b, s, g, n] -> [b, s, h, n]: each group's B or C for each of its heads."""
    return t.repeat_interleave(h // t.shape[2], dim=2)


def ssd_sequential(x, dt, A, B, C, D=None, initial_state=None, seq_idx=None):
    """The recurrence, one token at a time (see the module docstring); a document's first token
    (seq_idx) keeps none of the state before it."""
    b, s, h, p = x.shape
    dtype = _compute_dtype(x)
    x, dt, A = x.to(dtype), dt.to(dtype), A.to(dtype)
    B, C = _heads(B, h).to(dtype), _heads(C, h).to(dtype)
    state = x.new_zeros(b, h, p, B.shape[-1]) if initial_state is None else initial_state.to(dtype)
    starts = torch.zeros(b, s, dtype=torch.bool, device=x.device) if seq_idx is None else document_starts(seq_idx)
    ys = []
    for t in range(s):
        decay = torch.exp(dt[:, t] * A).masked_fill(starts[:, t, None], 0.0)  # [b, h]
        state = decay[..., None, None] * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + D.to(dtype)[:, None] * x
    return y, state


def _segment_sums(a):
    """a [..., L] -> [..., L, L]: entry (i, j) = a_{j+1} + ... + a_i for j <= i, -inf above the
    diagonal (so exp gives the decay from token j to token i, and 0 where j > i)."""
    L = a.shape[-1]
    cum = torch.cumsum(a, dim=-1)
    sums = cum[..., :, None] - cum[..., None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~causal, float("-inf"))


def ssd_chunked(x, dt, A, B, C, D=None, initial_state=None, chunk_size: int = 64, seq_idx=None):
    """The same as `ssd_sequential`, in chunks of `chunk_size` tokens (the end padded with dt = 0,
    which neither decays nor adds to the state)."""
    b, s, h, p = x.shape
    dtype = _compute_dtype(x)
    pad = -s % chunk_size
    xs, dts = F.pad(x.to(dtype), (0, 0, 0, 0, 0, pad)), F.pad(dt.to(dtype), (0, 0, 0, pad))
    Bs, Cs = (F.pad(_heads(t, h).to(dtype), (0, 0, 0, 0, 0, pad)) for t in (B, C))
    m = (s + pad) // chunk_size
    # [b, m, L, h, ...]: chunks of L tokens
    xs, dts, Bs, Cs = (t.reshape(b, m, chunk_size, *t.shape[2:]) for t in (xs, dts, Bs, Cs))
    a = dts * A.to(dtype)  # [b, m, L, h]
    if seq_idx is not None:
        a = a + F.pad(start_log_decay(seq_idx).to(dtype), (0, pad)).reshape(b, m, chunk_size, 1)
    a = a.permute(0, 1, 3, 2)  # [b, m, h, L]
    cum = torch.cumsum(a, dim=-1)
    weighted_x = xs * dts[..., None]  # dt_j x_j [b, m, L, h, p]

    # Within each chunk: (C_i . B_j) exp(cum_i - cum_j) for j <= i.
    decay = torch.exp(_segment_sums(a))  # [b, m, h, L, L]
    scores = torch.einsum("bmihn,bmjhn->bmhij", Cs, Bs) * decay
    y = torch.einsum("bmhij,bmjhp->bmihp", scores, weighted_x)

    # Each chunk's own end state, then the states entering each chunk.
    to_end = torch.exp(cum[..., -1:] - cum)  # [b, m, h, L]
    chunk_states = torch.einsum("bmhj,bmjhp,bmjhn->bmhpn", to_end, weighted_x, Bs)
    state = x.new_zeros(b, h, p, Bs.shape[-1], dtype=dtype) if initial_state is None else initial_state.to(dtype)
    entering = []
    for c in range(m):
        entering.append(state)
        state = torch.exp(cum[:, c, :, -1])[..., None, None] * state + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)  # [b, m, h, p, n]

    # From earlier chunks: exp(cum_i) H_c C_i.
    y = y + torch.einsum("bmhpn,bmihn,bmhi->bmihp", entering, Cs, torch.exp(cum))
    y = y.reshape(b, m * chunk_size, h, p)[:, :s]
    if D is not None:
        y = y + D.to(dtype)[:, None] * x.to(dtype)
    return y.to(x.dtype), state.to(x.dtype)


def ssd(x, dt, A, B, C, D=None, initial_state=None, chunk_size: int = 64, seq_idx=None):
    """`ssd_triton` for float32, bfloat16 and float16 CUDA tensors when Triton is installed (and for
    CPU tensors under TRITON_INTERPRET=1), else `ssd_chunked`: the same results and gradients."""
    args = (x, dt, A, B, C, D, initial_state)
    if triton is not None and (x.is_cuda or INTERPRETED) and x.dtype in SUPPORTED_DTYPES:
        return ssd_triton(*args, chunk_size=chunk_size, seq_idx=seq_idx)
    return ssd_chunked(*args, chunk_size=chunk_size, seq_idx=seq_idx)
