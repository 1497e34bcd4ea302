"""Mamba-2's step sizes and decay rates from the input projection, for the mixer core op
(teratron.ssm.mamba_core), as two Triton kernels where PyTorch launches a dozen small ones:

    forward    dt = softplus(dt_raw + dt_bias) [b, s, h] fp32,  A = -exp(A_log) [h] fp32
    backward   d(dt_raw) = ddt sigmoid(dt_raw + dt_bias)   (written into the projection's gradient),
               d(dt_bias) = sum over tokens of d(dt_raw),  d(A_log) = dA A

dt_raw [b, s, h] is read, and its gradient written, by its batch and token strides (a slice of the
projection laid out [s, b]). Sums run in fp32: each program's rows of d(dt_bias), then over the
programs in a fixed order (deterministic). softplus is max(x, 0) + log1p(exp(-|x|)), torch's value within
a few fp32 roundings (log1p by Goldberg's correction of log(1 + e), Triton's interpreter lacking libdevice).
"""

import torch

from teratron.ssm.ssd_triton import triton

if triton is not None:
    import triton.language as tl

ROWS = 64  # tokens a program


def dt_and_A(dt_raw, dt_bias, A_log):
    """dt_raw [b, s, h] (channels contiguous), dt_bias and A_log [h] -> (dt [b, s, h], A [h]), fp32."""
    b, s, h = dt_raw.shape
    dt = torch.empty(b, s, h, device=dt_raw.device, dtype=torch.float32)
    A = torch.empty(h, device=dt_raw.device, dtype=torch.float32)
    _dt_kernel[(triton.cdiv(b * s, ROWS),)](dt_raw, dt_bias, A_log, dt, A, b * s, s, h, *dt_raw.stride()[:2],
                                            ROWS=ROWS, BLOCK_H=triton.next_power_of_2(h))
    return dt, A


def dt_backward_into(ddt_raw, ddt, dA, dt_raw, dt_bias, A_log):
    """Writes dt_raw's gradient into ddt_raw (laid out as dt_raw may be) from dt's, ddt [b, s, h] fp32
    contiguous; returns the gradients of dt_bias and A_log (from A's, dA [h]) in their dtypes."""
    b, s, h = dt_raw.shape
    assert ddt_raw.stride(-1) == 1 and ddt.is_contiguous(), "ddt_raw's channels and ddt must be contiguous"
    programs = triton.cdiv(b * s, ROWS)
    dbias_parts = torch.empty(programs, h, device=ddt.device, dtype=torch.float32)
    dA_log = torch.empty(h, device=ddt.device, dtype=A_log.dtype)
    _dt_backward_kernel[(programs,)](ddt_raw, ddt, dA, dt_raw, dt_bias, A_log, dbias_parts, dA_log, b * s, s, h,
                                     *ddt_raw.stride()[:2], *dt_raw.stride()[:2], ROWS=ROWS,
                                     BLOCK_H=triton.next_power_of_2(h))
    return dbias_parts.sum(0).to(dt_bias.dtype), dA_log


if triton is not None:
    @triton.jit
    def _rows(s, h, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        """This program's tokens (flat over b * s) [ROWS], their batch and position, and the heads [BLOCK_H]."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        return rows, rows // s, rows % s, tl.arange(0, BLOCK_H)

    @triton.jit
    def _preactivation(dt_raw, dt_bias, rows, bi, si, heads, ok, h, raw_sb, raw_ss):
        """dt_raw + dt_bias [ROWS, BLOCK_H] in fp32."""
        raw = tl.load(dt_raw + bi[:, None] * raw_sb + si[:, None] * raw_ss + heads[None, :], mask=ok, other=0.0)
        return raw.to(tl.float32) + tl.load(dt_bias + heads, mask=heads < h, other=0.0).to(tl.float32)[None, :]

    @triton.jit
    def _dt_kernel(dt_raw, dt_bias, A_log, dt, A, rows_total, s, h, raw_sb, raw_ss, ROWS: tl.constexpr,
                   BLOCK_H: tl.constexpr):
        rows, bi, si, heads = _rows(s, h, ROWS, BLOCK_H)
        ok = (rows < rows_total)[:, None] & (heads < h)[None, :]
        x = _preactivation(dt_raw, dt_bias, rows, bi, si, heads, ok, h, raw_sb, raw_ss)
        # softplus(x) = max(x, 0) + log1p(exp(-|x|)); log1p(e) = log(u) e / (u - 1), u = 1 + e rounded
        e = tl.exp(-tl.abs(x))
        u = 1.0 + e
        log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        tl.store(dt + rows[:, None] * h + heads[None, :], tl.maximum(x, 0.0) + log1p, mask=ok)
        if tl.program_id(0) == 0:
            tl.store(A + heads, -tl.exp(tl.load(A_log + heads, mask=heads < h, other=0.0).to(tl.float32)),
                     mask=heads < h)

    @triton.jit
    def _dt_backward_kernel(ddt_raw, ddt, dA, dt_raw, dt_bias, A_log, dbias_parts, dA_log, rows_total, s, h,
                            draw_sb, draw_ss, raw_sb, raw_ss, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        rows, bi, si, heads = _rows(s, h, ROWS, BLOCK_H)
        ok = (rows < rows_total)[:, None] & (heads < h)[None, :]
        x = _preactivation(dt_raw, dt_bias, rows, bi, si, heads, ok, h, raw_sb, raw_ss)
        g = tl.load(ddt + rows[:, None] * h + heads[None, :], mask=ok, other=0.0) * tl.sigmoid(x)
        tl.store(ddt_raw + bi[:, None] * draw_sb + si[:, None] * draw_ss + heads[None, :],
                 g.to(ddt_raw.dtype.element_ty), mask=ok)
        tl.store(dbias_parts + tl.program_id(0) * h + heads, tl.sum(g, 0), mask=heads < h)
        if tl.program_id(0) == 0:
            A = -tl.exp(tl.load(A_log + heads, mask=heads < h, other=0.0).to(tl.float32))
            tl.store(dA_log + heads, (tl.load(dA + heads, mask=heads < h, other=0.0) * A).to(dA_log.dtype.element_ty),
                     mask=heads < h)
