"""Mamba's causal depthwise convolution followed by SiLU, silu(causal_conv1d(x)) (teratron.ssm.causal_conv1d
has the definition), as Triton kernels, forward and backward, for training from a zero state.

    forward    y_t = silu(a_t),  a_t = sum_i w_i x_{t-k+1+i} (+ bias)        one pass over x (_forward_kernel)
    backward   g_t = dy_t silu'(a_t), a_t recomputed from x,
               dw_i = sum_t x_{t-k+1+i} g_t,  dbias = sum_t g_t              one pass (_gate_kernel)
               dx_t = sum_j w_{k-1-j} g_{t+j}                               one pass over g (_dx_kernel)

Each program takes tiles of tokens by channels of one sequence; the k - 1 neighbouring
rows of a tile are read again from the cache, not from memory (the gate pass reads each tap's
inputs once, for a and for dw). The pre-activation a and the gate's
gradient g are rounded to x's dtype, as the PyTorch path's convolution and SiLU return them; sums run
in fp32. The weight and bias gradients are summed per program of the gate pass (TILES tiles of tokens
in turn), then over the programs in a fixed order (deterministic), both in one reduction.

Packed documents (seq_idx [b, s], the document of every token, passed to the kernels as contiguous
int32): a tap whose token is in another document than the output's counts as zero, in the forward, the
gate pass (a and dw) and the dx pass alike (`_same_document`), so no document reads or feeds another;
without seq_idx the kernels compile without that work (HAS_SEQ_IDX).

x [b, s, c] may be any view whose channels are contiguous (the mixer's slice of its input projection):
it is read by its strides; y and the custom op's dx are contiguous [b, s, c] (`conv_silu_backward_into`
writes dx into any such view: a slice of the input projection's gradient, in teratron.ssm.mamba_core). A
pair of custom ops with autograd between them, so a compiled layer traces through them without a graph
break.
"""

from typing import Optional

import torch

from teratron.ssm.ssd_triton import INTERPRETED, SUPPORTED_DTYPES, triton

if triton is not None:
    import triton.language as tl

# Tiles (tokens x channels) of each pass, timed on an H200 at the Mamba layer's 4 x 2,048 tokens x 6,144
# channels (bench/RESULTS.md, session 16). The gate pass keeps a [tokens, channels] fp32 sum per tap and
# the taps' inputs in registers: small tiles, many of them a program (re-timed on an H100, session 27: the
# backward 315 -> 272 µs with the taps' inputs loaded once, at 16 x 32 tiles, 64 a program, 4 warps).
BLOCK_T, BLOCK_C = 64, 64  # the forward's
# the gate pass's tile, tiles a program and warps
GATE_BLOCK_T, GATE_BLOCK_C, TILES, GATE_WARPS = 16, 32, 64, 4
DX_BLOCK_T, DX_BLOCK_C = 32, 256  # the dx pass's
MAX_TAPS = 4  # the gate pass keeps a sum per tap (Mamba's and Gated DeltaNet's 4; longer kernels: PyTorch path)


def runs_here(x, weight, initial_state) -> bool:
    """Whether the kernels take this call: CUDA tensors (CPU ones under TRITON_INTERPRET=1) of a
    supported dtype, at most MAX_TAPS taps, from a zero state (a decoding step's state goes through
    the PyTorch path)."""
    return (triton is not None and initial_state is None and (x.is_cuda or INTERPRETED)
            and x.dtype in SUPPORTED_DTYPES and weight.shape[-1] <= MAX_TAPS)


def causal_conv1d_silu_triton(x, weight, bias=None, seq_idx=None):
    """x [b, s, c], weight [c, k], bias [c] or None, seq_idx [b, s] or None (packed documents) ->
    silu(causal_conv1d(x)) [b, s, c] in x's dtype."""
    return _conv_silu(x, weight, bias, seq_idx)


def _channels_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _documents(seq_idx):
    """seq_idx as the kernels read it: contiguous int32 [b, s]."""
    return seq_idx.to(torch.int32).contiguous() if seq_idx is not None else None


def _wide(t) -> bool:
    """Whether a sequence's offsets in t [b, s, c] (rows times the token stride, a few rows of
    padding on either side) pass int32: then the kernels compute them in int64."""
    return (t.shape[1] + 2 * MAX_TAPS) * t.stride(1) >= 2 ** 31


def _grid(b: int, s: int, c: int, block_t: int, block_c: int):
    return b * triton.cdiv(s, block_t), triton.cdiv(c, block_c)


@torch.library.custom_op("teratron::causal_conv1d_silu", mutates_args=())
def _conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               seq_idx: Optional[torch.Tensor]) -> torch.Tensor:
    x, weight, documents = _channels_contiguous(x), weight.contiguous(), _documents(seq_idx)
    b, s, c = x.shape
    y = torch.empty(b, s, c, device=x.device, dtype=x.dtype)
    _forward_kernel[_grid(b, s, c, BLOCK_T, BLOCK_C)](
        x, weight, bias if bias is not None else weight, documents if documents is not None else weight, y, s, c,
        x.stride(0), x.stride(1), WIDE=_wide(x), HAS_BIAS=bias is not None, HAS_SEQ_IDX=documents is not None,
        K=weight.shape[1], BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=4)
    return y


@_conv_silu.register_fake
def _(x, weight, bias, seq_idx):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    x, weight, bias, seq_idx = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx)
    ctx.has_bias = bias is not None


def _autograd(ctx, dy):
    x, weight, bias, seq_idx = ctx.saved_tensors
    dx, dweight, dbias = _conv_silu_backward(dy, x, weight, bias, seq_idx)
    return dx, dweight, dbias if ctx.has_bias else None, None


@torch.library.custom_op("teratron::causal_conv1d_silu_backward", mutates_args=())
def _conv_silu_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        seq_idx: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of x, the weight and the bias (the last unused without a bias)."""
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    return (dx, *conv_silu_backward_into(dx, dy, x, weight, bias, seq_idx))


def conv_silu_backward_into(dx, dy, x, weight, bias, seq_idx):
    """Writes x's gradient into dx (any [b, s, c] view whose channels are contiguous: a slice of a
    wider gradient); returns the weight's and the bias's gradients."""
    x, dy, weight = _channels_contiguous(x), _channels_contiguous(dy), weight.contiguous()
    documents = _documents(seq_idx)
    has_seq_idx, seq_idx_ptr = documents is not None, documents if documents is not None else weight
    b, s, c = x.shape
    k = weight.shape[1]
    gate = torch.empty(b, s, c, device=x.device, dtype=x.dtype)  # g: the gradient of a
    programs = b * triton.cdiv(s, GATE_BLOCK_T * TILES)
    # each program's share of dw and dbias: [programs, c, k + 1], summed in one reduction
    parts = torch.empty(programs, c, k + 1, device=x.device, dtype=torch.float32)
    _gate_kernel[(programs, triton.cdiv(c, GATE_BLOCK_C))](
        x, weight, bias if bias is not None else weight, seq_idx_ptr, dy, gate, parts, s, c,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), WIDE=_wide(x) or _wide(dy), HAS_BIAS=bias is not None,
        HAS_SEQ_IDX=has_seq_idx, K=k, TILES=TILES, BLOCK_T=GATE_BLOCK_T, BLOCK_C=GATE_BLOCK_C, num_warps=GATE_WARPS)
    assert dx.stride(-1) == 1, "dx's channels must be contiguous"
    _dx_kernel[_grid(b, s, c, DX_BLOCK_T, DX_BLOCK_C)](
        weight, seq_idx_ptr, gate, dx, s, c, gate.stride(0), dx.stride(0), dx.stride(1), WIDE=_wide(gate) or _wide(dx),
        HAS_SEQ_IDX=has_seq_idx, K=k, BLOCK_T=DX_BLOCK_T, BLOCK_C=DX_BLOCK_C, num_warps=4)
    sums = parts.sum(0)  # [c, k + 1]
    dbias_dtype = bias.dtype if bias is not None else weight.dtype
    return sums[:, :k].to(weight.dtype, copy=True), sums[:, k].to(dbias_dtype, copy=True)  # no views of one tensor


@_conv_silu_backward.register_fake
def _(dy, x, weight, bias, seq_idx):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), (bias if bias is not None else weight).new_empty(
        weight.shape[0])


_conv_silu.register_autograd(_autograd, setup_context=_setup)


if triton is not None:
    @triton.jit
    def _tile(ti, c, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """This program's tokens [BLOCK_T] and channels [BLOCK_C] and the channels' mask."""
        t = ti * BLOCK_T + tl.arange(0, BLOCK_T)
        channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        return t, channels, channels < c

    @triton.jit
    def _load_rows(ptr, bi, rows, channels, channel_ok, s, stride_b, stride_s, WIDE: tl.constexpr):
        """[BLOCK_T, BLOCK_C] fp32 of rows `rows` of sequence bi, zeros outside 0 .. s - 1 (the
        convolution's zero padding before the sequence, nothing after it). WIDE: a sequence's
        offsets pass 2**31 (rows times stride_s in int64; bi is int64 anyway)."""
        ok = (rows >= 0) & (rows < s)
        if WIDE:
            rows = rows.to(tl.int64)
        offsets = bi * stride_b + rows[:, None] * stride_s + channels[None, :]
        return tl.load(ptr + offsets, mask=ok[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _same_document(seq_idx, bi, rows, other_rows, s):
        """[BLOCK_T] whether each of `rows` of sequence bi is in the document of the same entry of
        `other_rows`: never where either is outside 0 .. s - 1 (whatever document ids seq_idx holds)."""
        ok = (rows >= 0) & (rows < s) & (other_rows >= 0) & (other_rows < s)
        documents = tl.load(seq_idx + bi * s + rows, mask=ok, other=0)
        return ok & (documents == tl.load(seq_idx + bi * s + other_rows, mask=ok, other=0))

    @triton.jit
    def _taps_of(x, seq_idx, bi, rows, i, channels, channel_ok, s, stride_b, stride_s, WIDE: tl.constexpr,
                 HAS_SEQ_IDX: tl.constexpr, K: tl.constexpr):
        """[BLOCK_T, BLOCK_C] fp32 of what tap i reads for the outputs at `rows`, x_{row-K+1+i}: zeros
        before the sequence and, with HAS_SEQ_IDX, in another document than the output's."""
        tap_rows = rows - (K - 1) + i
        inputs = _load_rows(x, bi, tap_rows, channels, channel_ok, s, stride_b, stride_s, WIDE)
        if HAS_SEQ_IDX:
            inputs = tl.where(_same_document(seq_idx, bi, tap_rows, rows, s)[:, None], inputs, 0.0)
        return inputs

    @triton.jit
    def _tap(weight, channels, channel_ok, i, K: tl.constexpr):
        """[BLOCK_C] fp32: tap i's weight of each channel."""
        return tl.load(weight + channels * K + i, mask=channel_ok, other=0.0).to(tl.float32)

    @triton.jit
    def _preactivation(x, weight, bias, seq_idx, bi, rows, channels, channel_ok, s, stride_b, stride_s,
                       WIDE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, K: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """a at `rows`: sum_i w_i x_{row-K+1+i} (+ bias), rounded to x's dtype."""
        a = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for i in tl.static_range(K):
            tap = tl.load(weight + channels * K + i, mask=channel_ok, other=0.0).to(tl.float32)
            a += _taps_of(x, seq_idx, bi, rows, i, channels, channel_ok, s, stride_b, stride_s, WIDE, HAS_SEQ_IDX,
                          K) * tap[None, :]
        if HAS_BIAS:
            a += tl.load(bias + channels, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
        return a.to(x.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _forward_kernel(x, weight, bias, seq_idx, y, s, c, stride_b, stride_s, WIDE: tl.constexpr,
                        HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr):
        tiles = tl.cdiv(s, BLOCK_T)
        bi, ti = (tl.program_id(0) // tiles).to(tl.int64), tl.program_id(0) % tiles
        t, channels, channel_ok = _tile(ti, c, BLOCK_T, BLOCK_C)
        a = _preactivation(x, weight, bias, seq_idx, bi, t, channels, channel_ok, s, stride_b, stride_s, WIDE,
                           HAS_BIAS, HAS_SEQ_IDX, K, BLOCK_T, BLOCK_C)
        out = a * tl.sigmoid(a)
        offsets = (bi * s + t[:, None]) * c + channels[None, :]
        tl.store(y + offsets, out.to(y.dtype.element_ty), mask=(t < s)[:, None] & channel_ok[None, :])

    @triton.jit
    def _gate_kernel(x, weight, bias, seq_idx, dy, gate, parts, s, c, stride_b, stride_s, dy_stride_b, dy_stride_s,
                     WIDE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, K: tl.constexpr,
                     TILES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """Program (bi and TILES tiles of tokens, block of channels): g of those tokens, and their
        share of dw and dbias (parts [programs, c, K + 1]: dw's K taps, then dbias)."""
        programs = tl.cdiv(s, BLOCK_T * TILES)
        part = tl.program_id(0)
        bi, first_tile = (part // programs).to(tl.int64), (part % programs) * TILES
        # x_{t-K+1+i} g_t per tap i (K <= MAX_TAPS) and g_t, summed over the tiles elementwise and over
        # tokens once at the end (a sum over a tile's tokens crosses threads: one a program, not one a
        # tile and tap)
        dw0 = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        dw1 = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        dw2 = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        dw3 = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        dbias = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        tl.static_assert(K <= 4, "the gate pass keeps a sum for each of at most 4 taps (MAX_TAPS)")
        for ti in range(first_tile, tl.minimum(first_tile + TILES, tl.cdiv(s, BLOCK_T))):
            t, channels, channel_ok = _tile(ti, c, BLOCK_T, BLOCK_C)
            # the taps' inputs, loaded once for a and for dw (x_{t-K+1+i}: tap i; K - 1 the token's own); a is
            # _preactivation's sum in its order, so it equals the forward's to the bit (sharing a function that
            # also returned the taps made ptxas spill the packed forward: 8 -> 212 bytes a thread on sm_90)
            x0 = _taps_of(x, seq_idx, bi, t, 0, channels, channel_ok, s, stride_b, stride_s, WIDE, HAS_SEQ_IDX, K)
            a = x0 * _tap(weight, channels, channel_ok, 0, K)[None, :]
            if K > 1:
                x1 = _taps_of(x, seq_idx, bi, t, 1, channels, channel_ok, s, stride_b, stride_s, WIDE, HAS_SEQ_IDX, K)
                a += x1 * _tap(weight, channels, channel_ok, 1, K)[None, :]
            if K > 2:
                x2 = _taps_of(x, seq_idx, bi, t, 2, channels, channel_ok, s, stride_b, stride_s, WIDE, HAS_SEQ_IDX, K)
                a += x2 * _tap(weight, channels, channel_ok, 2, K)[None, :]
            if K > 3:
                x3 = _taps_of(x, seq_idx, bi, t, 3, channels, channel_ok, s, stride_b, stride_s, WIDE, HAS_SEQ_IDX, K)
                a += x3 * _tap(weight, channels, channel_ok, 3, K)[None, :]
            if HAS_BIAS:
                a += tl.load(bias + channels, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
            a = a.to(x.dtype.element_ty).to(tl.float32)
            sig = tl.sigmoid(a)
            g = _load_rows(dy, bi, t, channels, channel_ok, s, dy_stride_b, dy_stride_s, WIDE)
            g = g * sig * (1 + a * (1 - sig))
            g = g.to(gate.dtype.element_ty)
            offsets = (bi * s + t[:, None]) * c + channels[None, :]
            tl.store(gate + offsets, g, mask=(t < s)[:, None] & channel_ok[None, :])
            g = g.to(tl.float32)  # the rounded g, as dx's pass reads it
            dbias += g
            dw0 += x0 * g
            if K > 1:
                dw1 += x1 * g
            if K > 2:
                dw2 += x2 * g
            if K > 3:
                dw3 += x3 * g
        channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        channel_ok = channels < c
        row = parts + (part * c + channels) * (K + 1)  # this program's [c, K + 1] part
        tl.store(row, tl.sum(dw0, 0), mask=channel_ok)
        if K > 1:
            tl.store(row + 1, tl.sum(dw1, 0), mask=channel_ok)
        if K > 2:
            tl.store(row + 2, tl.sum(dw2, 0), mask=channel_ok)
        if K > 3:
            tl.store(row + 3, tl.sum(dw3, 0), mask=channel_ok)
        tl.store(row + K, tl.sum(dbias, 0), mask=channel_ok)

    @triton.jit
    def _dx_kernel(weight, seq_idx, gate, dx, s, c, gate_stride_b, dx_stride_b, dx_stride_s, WIDE: tl.constexpr,
                   HAS_SEQ_IDX: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """dx of a tile: the outputs at t + j, which x_t feeds through tap K - 1 - j (with HAS_SEQ_IDX,
        those of x_t's document alone); dx written by its strides (a slice of a wider gradient)."""
        tiles = tl.cdiv(s, BLOCK_T)
        bi, ti = (tl.program_id(0) // tiles).to(tl.int64), tl.program_id(0) % tiles
        t, channels, channel_ok = _tile(ti, c, BLOCK_T, BLOCK_C)
        dx_tile = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(K):
            tap = tl.load(weight + channels * K + (K - 1 - j), mask=channel_ok, other=0.0).to(tl.float32)
            gates = _load_rows(gate, bi, t + j, channels, channel_ok, s, gate_stride_b, c, WIDE)
            if HAS_SEQ_IDX:
                gates = tl.where(_same_document(seq_idx, bi, t + j, t, s)[:, None], gates, 0.0)
            dx_tile += gates * tap[None, :]
        rows = t.to(tl.int64) if WIDE else t
        tl.store(dx + bi * dx_stride_b + rows[:, None] * dx_stride_s + channels[None, :],
                 dx_tile.to(dx.dtype.element_ty), mask=(t < s)[:, None] & channel_ok[None, :])
