"""Mamba-2's mixer between its two projections, on the Triton kernels, as one custom op for
training (MambaMixer's definition, from zero states):

    projected [b, s, d | d + 2 g n | h] = z | xBC | dt_raw       (the input projection's output)
    xBC' = silu(causal_conv1d(xBC))                               causal_conv1d_triton
    y = ssd(x, softplus(dt_raw + dt_bias), -exp(A_log), B, C, D)  ssd_triton (x, B, C: views of xBC'),
                                                                  mamba_dt_triton (dt, A)
    out = gated_rmsnorm(y, z) * norm_weight                       gated_norm_triton

Composed of the three ops, autograd hands the input projection a gradient concatenated from z's,
xBC's and dt_raw's, and the convolution one concatenated from the scan's dx, dB and dC: two copies of
every channel. Here the backward writes each gradient where it belongs: the norm's dz, the
convolution's dx and dt_raw's gradient into one tensor laid out as `projected` ([s, b] in training, as
the input projection's backward reads it), the scan's dx, dB and dC into one as the convolution
reads it. Packed documents (seq_idx) as in the three ops. The kernels and their limits are those of
the three modules.
"""

from typing import Optional

import torch

from teratron.ssm import causal_conv1d_triton, gated_norm_triton, mamba_dt_triton, ssd_triton


def runs_here(projected, conv_weight, chunk_size: int) -> bool:
    """Whether the op takes this call: the convolution's kernels run here (causal_conv1d_triton), the
    scan's take the chunk size, and `projected` is laid out densely (its gradient takes its strides)."""
    return (causal_conv1d_triton.runs_here(projected, conv_weight, None) and chunk_size in ssd_triton.CHUNK_SIZES
            and projected.stride(-1) == 1 and _dense(projected))


def _dense(t) -> bool:
    """Whether t's elements fill its storage span without gaps or overlaps (a permuted contiguous tensor)."""
    expected = 1
    for dim in sorted(range(t.dim()), key=lambda dim: t.stride(dim)):
        if t.stride(dim) != expected:
            return False
        expected *= t.shape[dim]
    return True


def mamba_core(projected, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, head_dim: int, groups: int,
               d_state: int, chunk_size: int, eps: float, seq_idx=None):
    """projected [b, s, parts] (z | xBC | dt_raw), conv_weight [c, k], conv_bias [c], dt_bias, A_log and D
    [h], norm_weight [d], seq_idx [b, s] or None -> out [b, s, d] (laid out [s, b, d], as the output
    projection reads it). groups: B/C groups, which the norm's groups are."""
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32).contiguous()
    out, *_ = _mamba_core(projected, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, seq_idx, head_dim,
                          groups, d_state, chunk_size, eps)
    return out


def _split(projected, heads: int, head_dim: int, groups: int, d_state: int):
    """z [b, s, d], xBC [b, s, d + 2 g n], dt_raw [b, s, h]: views of `projected`."""
    d = heads * head_dim
    return projected.split([d, d + 2 * groups * d_state, heads], dim=-1)


def _scan_inputs(xbc, heads: int, head_dim: int, groups: int, d_state: int):
    """x [b, s, h, p], B and C [b, s, g, n]: views of the convolution's output (or of its gradient)."""
    x, B, C = xbc.split([heads * head_dim, groups * d_state, groups * d_state], dim=-1)
    return (x.unflatten(-1, (heads, head_dim)), *(t.unflatten(-1, (groups, d_state)) for t in (B, C)))


@torch.library.custom_op("teratron::mamba_core", mutates_args=())
def _mamba_core(projected: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor, dt_bias: torch.Tensor,
                A_log: torch.Tensor, D: torch.Tensor, norm_weight: torch.Tensor, seq_idx: Optional[torch.Tensor],
                head_dim: int, groups: int, d_state: int, chunk_size: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                     torch.Tensor, torch.Tensor]:
    """(out, and what the backward keeps: the convolution's output, y, and the scan's and the norm's own)."""
    heads = dt_bias.shape[0]
    z, xbc, dt_raw = _split(projected, heads, head_dim, groups, d_state)
    xbc_act = causal_conv1d_triton.causal_conv1d_silu_triton(xbc, conv_weight, conv_bias, seq_idx)
    x, B, C = _scan_inputs(xbc_act, heads, head_dim, groups, d_state)
    dt, A = mamba_dt_triton.dt_and_A(dt_raw, dt_bias, A_log)
    y, _, cum, scores, states = ssd_triton._ssd_scan(x, dt, A, B, C, D, None, chunk_size, seq_idx)
    out, rstd = gated_norm_triton._gated_rmsnorm(y.flatten(-2), z, norm_weight, groups, eps)
    return out, xbc_act, y, cum, scores, states, rstd


@_mamba_core.register_fake
def _(projected, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, seq_idx, head_dim, groups, d_state,
      chunk_size, eps):
    heads = dt_bias.shape[0]
    z, xbc, _ = _split(projected, heads, head_dim, groups, d_state)
    x, B, _ = _scan_inputs(xbc, heads, head_dim, groups, d_state)
    y = x.new_empty(x.shape)
    _, _, cum, scores, states = ssd_triton._ssd_scan(x, y.new_empty(y.shape[:3], dtype=torch.float32), A_log, B, B,
                                                     D, None, chunk_size, None)
    out, rstd = gated_norm_triton._gated_rmsnorm(z, z, norm_weight, groups, eps)
    return out, xbc.new_empty(xbc.shape), y, cum, scores, states, rstd


def _setup(ctx, inputs, output):
    projected, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, seq_idx, *sizes, eps = inputs
    _, xbc_act, y, cum, scores, states, rstd = output
    ctx.save_for_backward(projected, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, seq_idx, xbc_act, y, cum,
                          scores, states, rstd)
    ctx.sizes = sizes  # head_dim, groups, d_state, chunk_size


def _autograd(ctx, dout, *unused):
    grads = _mamba_core_backward(dout, *ctx.saved_tensors, *ctx.sizes)
    return (*grads, None, None, None, None, None, None)


@torch.library.custom_op("teratron::mamba_core_backward", mutates_args=())
def _mamba_core_backward(dout: torch.Tensor, projected: torch.Tensor, conv_weight: torch.Tensor,
                         conv_bias: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                         norm_weight: torch.Tensor, seq_idx: Optional[torch.Tensor], xbc_act: torch.Tensor,
                         y: torch.Tensor, cum: torch.Tensor, scores: torch.Tensor, states: torch.Tensor,
                         rstd: torch.Tensor, head_dim: int, groups: int, d_state: int,
                         chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of projected (laid out as projected), the convolution's weight and bias, dt_bias,
    A_log, D and the norm's weight."""
    heads = dt_bias.shape[0]
    sizes = heads, head_dim, groups, d_state
    z, xbc, dt_raw = _split(projected, *sizes)
    dprojected = torch.empty_strided(projected.shape, projected.stride(), device=projected.device,
                                     dtype=projected.dtype)
    dz, dxbc, ddt_raw = _split(dprojected, *sizes)
    dy = torch.empty(y.shape, device=y.device, dtype=y.dtype)
    dnorm_weight = gated_norm_triton.gated_rmsnorm_backward_into(dy.flatten(-2), dz, dout, y.flatten(-2), z,
                                                                 norm_weight, rstd, groups)
    dxbc_act = torch.empty(xbc_act.shape, device=xbc_act.device, dtype=xbc_act.dtype)
    dt, A = mamba_dt_triton.dt_and_A(dt_raw, dt_bias, A_log)
    x, B, C = _scan_inputs(xbc_act, *sizes)
    ddt, dA, dD, _ = ssd_triton.scan_backward_into(*_scan_inputs(dxbc_act, *sizes), dy, None, x, dt, A, B, C, D,
                                                   None, cum, scores, states, chunk_size)
    dconv_weight, dconv_bias = causal_conv1d_triton.conv_silu_backward_into(dxbc, dxbc_act, xbc, conv_weight,
                                                                           conv_bias, seq_idx)
    ddt_bias, dA_log = mamba_dt_triton.dt_backward_into(ddt_raw, ddt, dA, dt_raw, dt_bias, A_log)
    return dprojected, dconv_weight, dconv_bias, ddt_bias, dA_log, dD, dnorm_weight


@_mamba_core_backward.register_fake
def _(dout, projected, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, seq_idx, xbc_act, y, cum, scores,
      states, rstd, head_dim, groups, d_state, chunk_size):
    return (projected.new_empty_strided(projected.shape, projected.stride()),
            *(t.new_empty(t.shape) for t in (conv_weight, conv_bias, dt_bias, A_log, D, norm_weight)))


_mamba_core.register_autograd(_autograd, setup_context=_setup)
