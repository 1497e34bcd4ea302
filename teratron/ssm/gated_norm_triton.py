"""Mamba-2's output norm, RMSNorm of y * silu(z) over each group's channels times a weight
(`GroupGatedRMSNorm` in teratron.ssm.mamba_mixer has the definition), as Triton kernels forward and
backward:

    forward    g = y silu(z),  r = rsqrt(mean over the group's channels of g^2 + eps),  out = g r w
    backward   n = g r,  dn = dout w,  dg = r (dn - n mean(dn n)),
               dy = dg silu(z),  dz = dg y silu'(z),  dw = sum over tokens of dout n

in fp32, each tile ROWS tokens of one group; out, dy and dz in y's dtype, dw in the weight's, summed per
program (TILES tiles) and then over programs in a fixed order. y, z and dout are read by their strides ([b, s, d]
views whose channels are contiguous: z a slice of the input projection, dout laid out [s, b] as the
output projection's gradient comes); out is written laid out [s, b, d] (what the output projection
reads after the mixer's transpose back), dy and dz by their strides (contiguous from the custom op;
`gated_rmsnorm_backward_into` takes any). A pair of custom ops with autograd between them, so a
compiled layer traces through them without a graph break.
"""

import torch

from teratron.ssm.ssd_triton import INTERPRETED, SUPPORTED_DTYPES, triton

if triton is not None:
    import triton.language as tl

ROWS = 4     # tokens a tile (each a row of the group's channels)
TILES = 16   # tiles a program of the backward takes in turn (its share of dw summed in registers)
WARPS = 4


def runs_here(y, z) -> bool:
    """Whether the kernels take this call: CUDA tensors (CPU ones under TRITON_INTERPRET=1) of a
    supported dtype, channels contiguous."""
    return (triton is not None and (y.is_cuda or INTERPRETED) and y.dtype in SUPPORTED_DTYPES
            and z.dtype == y.dtype and y.stride(-1) == 1 and z.stride(-1) == 1)


def gated_rmsnorm_triton(y, z, weight, groups: int, eps: float):
    """y, z [b, s, d], weight [d] -> [b, s, d] in y's dtype (laid out [s, b, d] in memory); groups
    must divide d."""
    if y.shape[-1] % groups:
        raise ValueError(f"gated_rmsnorm_triton: {y.shape[-1]} channels do not split into {groups} groups; "
                         "choose groups dividing the channels")
    out, _ = _gated_rmsnorm(y, z, weight, groups, eps)
    return out


def _laid_out_sb(b: int, s: int, d: int, like):
    return torch.empty(s, b, d, device=like.device, dtype=like.dtype).transpose(0, 1)


@torch.library.custom_op("teratron::gated_rmsnorm", mutates_args=())
def _gated_rmsnorm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, s, d] laid out [s, b, d], each token's and group's r [b, s, groups] fp32)."""
    b, s, d = y.shape
    out = _laid_out_sb(b, s, d, y)
    rstd = torch.empty(b, s, groups, device=y.device, dtype=torch.float32)
    _forward_kernel[(triton.cdiv(b * s, ROWS), groups)](
        y, z, weight, out, rstd, b, s, d, *y.stride()[:2], *z.stride()[:2], *out.stride()[:2], eps, GROUP=d // groups,
        BLOCK=triton.next_power_of_2(d // groups), ROWS=ROWS, num_warps=WARPS)
    return out, rstd


@_gated_rmsnorm.register_fake
def _(y, z, weight, groups, eps):
    b, s, d = y.shape
    return _laid_out_sb(b, s, d, y), y.new_empty(b, s, groups, dtype=torch.float32)


def _setup(ctx, inputs, output):
    y, z, weight, groups, eps = inputs
    ctx.save_for_backward(y, z, weight, output[1])
    ctx.groups = groups


def _autograd(ctx, dout, _):
    y, z, weight, rstd = ctx.saved_tensors
    dy, dz, dweight = _gated_rmsnorm_backward(dout, y, z, weight, rstd, ctx.groups)
    return dy, dz, dweight, None, None


@torch.library.custom_op("teratron::gated_rmsnorm_backward", mutates_args=())
def _gated_rmsnorm_backward(dout: torch.Tensor, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                            rstd: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of y, z (contiguous [b, s, d]) and the weight."""
    dy, dz = (torch.empty(y.shape, device=y.device, dtype=y.dtype) for _ in range(2))
    return dy, dz, gated_rmsnorm_backward_into(dy, dz, dout, y, z, weight, rstd, groups)


def gated_rmsnorm_backward_into(dy, dz, dout, y, z, weight, rstd, groups: int):
    """Writes the gradients of y and z into dy and dz (any [b, s, d] views whose channels are
    contiguous: dz a slice of the input projection's gradient, in teratron.ssm.mamba_core); returns
    the weight's gradient."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    assert dy.stride(-1) == dz.stride(-1) == 1, "dy's and dz's channels must be contiguous"
    b, s, d = y.shape
    programs = triton.cdiv(b * s, ROWS * TILES)
    dweight_parts = torch.empty(programs, d, device=y.device, dtype=torch.float32)
    _backward_kernel[(programs, groups)](
        dout, y, z, weight, rstd, dy, dz, dweight_parts, b, s, d, *dout.stride()[:2], *y.stride()[:2],
        *z.stride()[:2], *dy.stride()[:2], *dz.stride()[:2], GROUP=d // groups,
        BLOCK=triton.next_power_of_2(d // groups), ROWS=ROWS, TILES=TILES, num_warps=WARPS)
    return dweight_parts.sum(0).to(weight.dtype)


@_gated_rmsnorm_backward.register_fake
def _(dout, y, z, weight, rstd, groups):
    b, s, d = y.shape
    return y.new_empty(b, s, d), y.new_empty(b, s, d), weight.new_empty(weight.shape)


_gated_rmsnorm.register_autograd(_autograd, setup_context=_setup)


if triton is not None:
    @triton.jit
    def _rows(token, b, s, stride_b, stride_s, channels, channel_ok, ROWS: tl.constexpr):
        """Offsets [ROWS, BLOCK] of tokens token .. token + ROWS - 1 (flattened b * s) at `channels`
        of a [b, s, d] view with those strides, and their mask."""
        flat = token + tl.arange(0, ROWS)
        bi, si = (flat // s).to(tl.int64), (flat % s).to(tl.int64)
        offsets = (bi * stride_b + si * stride_s)[:, None] + channels[None, :]
        return offsets, (flat < b * s)[:, None] & channel_ok[None, :]

    @triton.jit
    def _gated(y, z, y_offsets, z_offsets, mask):
        """(y, silu(z), sigmoid(z), z) in fp32 at the offsets."""
        y_tile = tl.load(y + y_offsets, mask=mask, other=0.0).to(tl.float32)
        z_tile = tl.load(z + z_offsets, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(z_tile)
        return y_tile, z_tile * sig, sig, z_tile

    @triton.jit
    def _forward_kernel(y, z, weight, out, rstd, b, s, d, y_sb, y_ss, z_sb, z_ss, out_sb, out_ss, eps,
                        GROUP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        token = tl.program_id(0) * ROWS
        group = tl.program_id(1)
        lanes = tl.arange(0, BLOCK)
        channel_ok = lanes < GROUP
        channels = group * GROUP + lanes
        y_offsets, mask = _rows(token, b, s, y_sb, y_ss, channels, channel_ok, ROWS)
        z_offsets, _ = _rows(token, b, s, z_sb, z_ss, channels, channel_ok, ROWS)
        y_tile, silu_z, _, _ = _gated(y, z, y_offsets, z_offsets, mask)
        gated = y_tile * silu_z
        r = 1.0 / tl.sqrt(tl.sum(gated * gated, 1) / GROUP + eps)  # [ROWS]
        w = tl.load(weight + channels, mask=channel_ok, other=0.0).to(tl.float32)
        out_offsets, _ = _rows(token, b, s, out_sb, out_ss, channels, channel_ok, ROWS)
        tl.store(out + out_offsets, (gated * r[:, None] * w[None, :]).to(out.dtype.element_ty), mask=mask)
        flat = token + tl.arange(0, ROWS)
        tl.store(rstd + flat.to(tl.int64) * (d // GROUP) + group, r, mask=flat < b * s)

    @triton.jit
    def _backward_kernel(dout, y, z, weight, rstd, dy, dz, dweight_parts, b, s, d, dout_sb, dout_ss, y_sb, y_ss,
                         z_sb, z_ss, dy_sb, dy_ss, dz_sb, dz_ss, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                         ROWS: tl.constexpr, TILES: tl.constexpr):
        """Program (TILES tiles of ROWS tokens, group): dy and dz of those tokens, their share of dw."""
        group = tl.program_id(1)
        lanes = tl.arange(0, BLOCK)
        channel_ok = lanes < GROUP
        channels = group * GROUP + lanes
        w = tl.load(weight + channels, mask=channel_ok, other=0.0).to(tl.float32)
        dweight = tl.zeros([ROWS, BLOCK], tl.float32)
        for tile in range(TILES):
            token = (tl.program_id(0) * TILES + tile) * ROWS
            y_offsets, mask = _rows(token, b, s, y_sb, y_ss, channels, channel_ok, ROWS)
            z_offsets, _ = _rows(token, b, s, z_sb, z_ss, channels, channel_ok, ROWS)
            dout_offsets, _ = _rows(token, b, s, dout_sb, dout_ss, channels, channel_ok, ROWS)
            y_tile, silu_z, sig, z_tile = _gated(y, z, y_offsets, z_offsets, mask)
            flat = token + tl.arange(0, ROWS)
            r = tl.load(rstd + flat.to(tl.int64) * (d // GROUP) + group, mask=flat < b * s, other=0.0)
            normed = y_tile * silu_z * r[:, None]
            dout_tile = tl.load(dout + dout_offsets, mask=mask, other=0.0).to(tl.float32)
            dnormed = dout_tile * w[None, :]
            dgated = r[:, None] * (dnormed - normed * (tl.sum(dnormed * normed, 1) / GROUP)[:, None])
            dy_offsets, _ = _rows(token, b, s, dy_sb, dy_ss, channels, channel_ok, ROWS)
            dz_offsets, _ = _rows(token, b, s, dz_sb, dz_ss, channels, channel_ok, ROWS)
            tl.store(dy + dy_offsets, (dgated * silu_z).to(dy.dtype.element_ty), mask=mask)
            tl.store(dz + dz_offsets, (dgated * y_tile * sig * (1 + z_tile * (1 - sig))).to(dz.dtype.element_ty),
                     mask=mask)
            dweight += dout_tile * normed
        tl.store(dweight_parts + tl.program_id(0).to(tl.int64) * d + channels, tl.sum(dweight, 0), mask=channel_ok)
