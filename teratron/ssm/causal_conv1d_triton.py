"""Mamba's causal depthwise convolution followed by SiLU, silu(causal_conv1d(x)) (teratron.ssm.causal_conv1d
has the definition), as Triton kernels, forward and backward, for training from a zero state.

    forward    y_t = silu(a_t),  a_t = sum_i w_i x_{t-k+1+i} (+ bias)        one pass over x (_forward_kernel)
    backward   g_t = dy_t silu'(a_t), a_t recomputed from x,
               dw_i = sum_t x_{t-k+1+i} g_t,  dbias = sum_t g_t              one pass (_gate_kernel)
               dx_t = sum_j w_{k-1-j} g_{t+j}                               one pass over g (_dx_kernel)

Each program walks a run of tokens of one sequence (WALKS: tokens, channels and warps of each pass) row
by row, four rows an iteration, and carries the three rows before them (dx: after them) in registers:
every row of x, dy and g is read from memory once (tiles of tokens read each row once a tap, from the
cache: four times). A kernel of k < 4 taps runs as 4 taps whose first 4 - k weights are zero. The
pre-activation a and the gate's gradient g are rounded to x's dtype, as the PyTorch path's convolution
and SiLU return them; sums run in fp32. The weight and bias gradients are summed per program of the gate
pass, then over the programs in a fixed order (deterministic), both in one reduction.

Packed documents (seq_idx [b, s], the document of every token, passed to the kernels as contiguous
int32): a tap whose token is in another document than the output's counts as zero, in the forward, the
gate pass (a and dw) and the dx pass alike (`_in_document`), so no document reads or feeds another;
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

# Each pass's (tokens a program, channels a program, warps): the fastest of a sweep on an H200 at the Mamba
# layer's 4 x 2,048 tokens x 6,144 channels (bench/RESULTS.md, session 29).
WALKS = {"forward": (32, 128, 1), "gate": (64, 128, 1), "dx": (16, 256, 2)}
MAX_TAPS = 4  # the walks carry 3 rows (Mamba's and Gated DeltaNet's 4 taps; longer kernels: PyTorch path)


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


def _launch(name: str, b: int, s: int, c: int):
    """(grid, the kernel's WALK and BLOCK_C, num_warps) of pass `name`."""
    walk, block_c, warps = WALKS[name]
    return (b * triton.cdiv(s, walk), triton.cdiv(c, block_c)), dict(WALK=walk, BLOCK_C=block_c, num_warps=warps)


@torch.library.custom_op("teratron::causal_conv1d_silu", mutates_args=())
def _conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               seq_idx: Optional[torch.Tensor]) -> torch.Tensor:
    x, weight, documents = _channels_contiguous(x), weight.contiguous(), _documents(seq_idx)
    b, s, c = x.shape
    y = torch.empty(b, s, c, device=x.device, dtype=x.dtype)
    grid, meta = _launch("forward", b, s, c)
    _forward_kernel[grid](
        x, weight, bias if bias is not None else weight, documents if documents is not None else weight, y, s, c,
        x.stride(0), x.stride(1), WIDE=_wide(x), HAS_BIAS=bias is not None, HAS_SEQ_IDX=documents is not None,
        K=weight.shape[1], **meta)
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
    grid, meta = _launch("gate", b, s, c)
    # each program's share of dw and dbias: [programs, c, k + 1], summed in one reduction
    parts = torch.empty(grid[0], c, k + 1, device=x.device, dtype=torch.float32)
    _gate_kernel[grid](
        x, weight, bias if bias is not None else weight, seq_idx_ptr, dy, gate, parts, s, c,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), WIDE=_wide(x) or _wide(dy), HAS_BIAS=bias is not None,
        HAS_SEQ_IDX=has_seq_idx, K=k, **meta)
    assert dx.stride(-1) == 1, "dx's channels must be contiguous"
    grid, meta = _launch("dx", b, s, c)
    _dx_kernel[grid](
        weight, seq_idx_ptr, gate, dx, s, c, gate.stride(0), dx.stride(0), dx.stride(1), WIDE=_wide(gate) or _wide(dx),
        HAS_SEQ_IDX=has_seq_idx, K=k, **meta)
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
    def _row(ptr, bi, row, channels, channel_ok, s, stride_b, stride_s, WIDE: tl.constexpr):
        """[BLOCK_C] fp32 of row `row` (a scalar) of sequence bi, zeros outside 0 .. s - 1 (the
        convolution's zero padding before the sequence, nothing after it). WIDE: a sequence's offsets
        pass 2**31 (rows times stride_s in int64; bi is int64 anyway)."""
        ok = channel_ok & (row + tl.zeros_like(channels) >= 0) & (row + tl.zeros_like(channels) < s)
        if WIDE:
            row = row.to(tl.int64)
        return tl.load(ptr + bi * stride_b + row * stride_s + channels, mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _document(seq_idx, bi, row, s, HAS_SEQ_IDX: tl.constexpr):
        """Row `row`'s document, -1 outside 0 .. s - 1 (with HAS_SEQ_IDX; else unused)."""
        if HAS_SEQ_IDX:
            return tl.load(seq_idx + bi * s + row, mask=(row >= 0) & (row < s), other=-1)
        else:
            return 0

    @triton.jit
    def _in_document(inputs, document, out_document, HAS_SEQ_IDX: tl.constexpr):
        """A row's inputs where its document is the output row's (with HAS_SEQ_IDX), else zeros."""
        if HAS_SEQ_IDX:
            return tl.where(document == out_document, inputs, 0.0)
        else:
            return inputs

    @triton.jit
    def _rows(ptr, seq_idx, bi, t, channels, channel_ok, s, stride_b, stride_s, WIDE: tl.constexpr,
              HAS_SEQ_IDX: tl.constexpr, COUNT: tl.constexpr):
        """Rows t .. t + COUNT - 1 (`_row`; COUNT 3 or 4), then their documents (`_document`)."""
        r0 = _row(ptr, bi, t, channels, channel_ok, s, stride_b, stride_s, WIDE)
        r1 = _row(ptr, bi, t + 1, channels, channel_ok, s, stride_b, stride_s, WIDE)
        r2 = _row(ptr, bi, t + 2, channels, channel_ok, s, stride_b, stride_s, WIDE)
        d0 = _document(seq_idx, bi, t, s, HAS_SEQ_IDX)
        d1 = _document(seq_idx, bi, t + 1, s, HAS_SEQ_IDX)
        d2 = _document(seq_idx, bi, t + 2, s, HAS_SEQ_IDX)
        if COUNT == 3:
            return r0, r1, r2, d0, d1, d2
        else:
            return (r0, r1, r2, _row(ptr, bi, t + 3, channels, channel_ok, s, stride_b, stride_s, WIDE),
                    d0, d1, d2, _document(seq_idx, bi, t + 3, s, HAS_SEQ_IDX))

    @triton.jit
    def _four_of(j: tl.constexpr, a0, a1, a2, a3, a4, a5, a6):
        """a_j .. a_{j+3} of seven."""
        if j == 0:
            return a0, a1, a2, a3
        elif j == 1:
            return a1, a2, a3, a4
        elif j == 2:
            return a2, a3, a4, a5
        else:
            return a3, a4, a5, a6

    @triton.jit
    def _taps(j: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, d0, d1, d2, d3, d4, d5, d6, OUT_LAST: tl.constexpr,
              HAS_SEQ_IDX: tl.constexpr):
        """Rows j .. j + 3 of seven consecutive rows a (documents d), each zero outside the output row's
        document: the last of the four's (OUT_LAST: a_t's taps x_{t-3} .. x_t) or the first's (dx_t's
        g_t .. g_{t+3})."""
        q0, q1, q2, q3 = _four_of(j, a0, a1, a2, a3, a4, a5, a6)
        e0, e1, e2, e3 = _four_of(j, d0, d1, d2, d3, d4, d5, d6)
        if OUT_LAST:
            return (_in_document(q0, e0, e3, HAS_SEQ_IDX), _in_document(q1, e1, e3, HAS_SEQ_IDX),
                    _in_document(q2, e2, e3, HAS_SEQ_IDX), q3)
        else:
            return (q0, _in_document(q1, e1, e0, HAS_SEQ_IDX), _in_document(q2, e2, e0, HAS_SEQ_IDX),
                    _in_document(q3, e3, e0, HAS_SEQ_IDX))

    @triton.jit
    def _weights(weight, channels, channel_ok, j: tl.constexpr, K: tl.constexpr):
        """[BLOCK_C] fp32: the weight of x_{t-3+j} in a_t (tap j - 4 + K; zero before the kernel's first)."""
        if j >= 4 - K:
            return tl.load(weight + channels * K + (j - 4 + K), mask=channel_ok, other=0.0).to(tl.float32)
        else:
            return tl.zeros(channels.shape, tl.float32)

    @triton.jit
    def _dx_weights(weight, channels, channel_ok, j: tl.constexpr, K: tl.constexpr):
        """[BLOCK_C] fp32: the weight of g_{t+j} in dx_t (tap K - 1 - j; zero past the kernel's last)."""
        if j < K:
            return tl.load(weight + channels * K + (K - 1 - j), mask=channel_ok, other=0.0).to(tl.float32)
        else:
            return tl.zeros(channels.shape, tl.float32)

    @triton.jit
    def _walk_start(weight, bias, c, K: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr):
        """This program's channels, their mask, the 4 taps' weights (`_weights`) and the bias (zeros
        without one)."""
        channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        channel_ok = channels < c
        bias_row = tl.zeros([BLOCK_C], tl.float32)
        if HAS_BIAS:
            bias_row = tl.load(bias + channels, mask=channel_ok, other=0.0).to(tl.float32)
        return (channels, channel_ok, _weights(weight, channels, channel_ok, 0, K),
                _weights(weight, channels, channel_ok, 1, K), _weights(weight, channels, channel_ok, 2, K),
                _weights(weight, channels, channel_ok, 3, K), bias_row)

    @triton.jit
    def _dot4(q0, q1, q2, q3, w0, w1, w2, w3):
        """[BLOCK_C] fp32: q0 w0 + q1 w1 + q2 w2 + q3 w3, summed in that order."""
        out = q0 * w0
        out += q1 * w1
        out += q2 * w2
        out += q3 * w3
        return out

    @triton.jit
    def _preactivation(q0, q1, q2, q3, w0, w1, w2, w3, bias_row, x_dtype: tl.constexpr, HAS_BIAS: tl.constexpr):
        """a_t from x_{t-3} .. x_t (each zero outside a_t's document), rounded to x's dtype; the forward and
        the gate pass sum it alike, to the bit."""
        a = _dot4(q0, q1, q2, q3, w0, w1, w2, w3)
        if HAS_BIAS:
            a += bias_row
        return a.to(x_dtype).to(tl.float32)

    @triton.jit
    def _forward_kernel(x, weight, bias, seq_idx, y, s, c, stride_b, stride_s, WIDE: tl.constexpr,
                        HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, K: tl.constexpr, WALK: tl.constexpr,
                        BLOCK_C: tl.constexpr):
        """Program (bi and a run of WALK tokens, block of channels): y of those tokens."""
        tl.static_assert(K <= 4 and WALK % 4 == 0, "at most 4 taps; walks of whole iterations of 4 rows")
        walks = tl.cdiv(s, WALK)
        bi, t0 = (tl.program_id(0) // walks).to(tl.int64), (tl.program_id(0) % walks) * WALK
        channels, channel_ok, w0, w1, w2, w3, bias_row = _walk_start(weight, bias, c, K, BLOCK_C, HAS_BIAS)
        # x_{t-3}, x_{t-2}, x_{t-1} and their documents, carried
        p3, p2, p1, d3, d2, d1 = _rows(x, seq_idx, bi, t0 - 3, channels, channel_ok, s, stride_b, stride_s, WIDE,
                                       HAS_SEQ_IDX, 3)
        for i in range(0, tl.minimum(WALK, s - t0), 4):
            t = t0 + i  # a tensor (the interpreter's loop counts are ints)
            r0, r1, r2, r3, e0, e1, e2, e3 = _rows(x, seq_idx, bi, t, channels, channel_ok, s, stride_b, stride_s,
                                                   WIDE, HAS_SEQ_IDX, 4)
            for j in tl.static_range(4):  # output row t + j
                q0, q1, q2, q3 = _taps(j, p3, p2, p1, r0, r1, r2, r3, d3, d2, d1, e0, e1, e2, e3, True, HAS_SEQ_IDX)
                a = _preactivation(q0, q1, q2, q3, w0, w1, w2, w3, bias_row, x.dtype.element_ty, HAS_BIAS)
                _store_row(y, a * tl.sigmoid(a), bi, t + j, channels, channel_ok, s, c)
            p3, p2, p1, d3, d2, d1 = r1, r2, r3, e1, e2, e3

    @triton.jit
    def _store_row(ptr, values, bi, t, channels, channel_ok, s, c):
        """Row t of a contiguous [b, s, c] tensor (values rounded to its dtype); nothing past the sequence."""
        tl.store(ptr + (bi * s + t) * c + channels, values.to(ptr.dtype.element_ty),
                 mask=channel_ok & (t + tl.zeros_like(channels) < s))

    @triton.jit
    def _gate_row(q0, q1, q2, q3, w0, w1, w2, w3, bias_row, dy, bi, t, channels, channel_ok, s, dy_stride_b,
                  dy_stride_s, gate, c, WIDE: tl.constexpr, HAS_BIAS: tl.constexpr, x_dtype: tl.constexpr):
        """g of row t from its taps' inputs, stored ([b, s, c] contiguous); returned rounded, in fp32 (as
        dx's pass reads it)."""
        a = _preactivation(q0, q1, q2, q3, w0, w1, w2, w3, bias_row, x_dtype, HAS_BIAS)
        sig = tl.sigmoid(a)
        g = _row(dy, bi, t, channels, channel_ok, s, dy_stride_b, dy_stride_s, WIDE) * sig * (1 + a * (1 - sig))
        _store_row(gate, g, bi, t, channels, channel_ok, s, c)
        return g.to(gate.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _gate_kernel(x, weight, bias, seq_idx, dy, gate, parts, s, c, stride_b, stride_s, dy_stride_b, dy_stride_s,
                     WIDE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, K: tl.constexpr,
                     WALK: tl.constexpr, BLOCK_C: tl.constexpr):
        """Program (bi and a run of WALK tokens, block of channels): g of those tokens, and their share of
        dw and dbias (parts [programs, c, K + 1]: dw's K taps, then dbias)."""
        tl.static_assert(K <= 4 and WALK % 4 == 0, "at most 4 taps; walks of whole iterations of 4 rows")
        walks = tl.cdiv(s, WALK)
        part = tl.program_id(0)
        bi, t0 = (part // walks).to(tl.int64), (part % walks) * WALK
        channels, channel_ok, w0, w1, w2, w3, bias_row = _walk_start(weight, bias, c, K, BLOCK_C, HAS_BIAS)
        p3, p2, p1, d3, d2, d1 = _rows(x, seq_idx, bi, t0 - 3, channels, channel_ok, s, stride_b, stride_s, WIDE,
                                       HAS_SEQ_IDX, 3)
        # sum_t x_{t-3+j} g_t for the 4 taps' places j, and sum_t g_t
        dw0 = tl.zeros([BLOCK_C], tl.float32)
        dw1 = tl.zeros([BLOCK_C], tl.float32)
        dw2 = tl.zeros([BLOCK_C], tl.float32)
        dw3 = tl.zeros([BLOCK_C], tl.float32)
        dbias = tl.zeros([BLOCK_C], tl.float32)
        for i in range(0, tl.minimum(WALK, s - t0), 4):
            t = t0 + i  # a tensor (the interpreter's loop counts are ints)
            r0, r1, r2, r3, e0, e1, e2, e3 = _rows(x, seq_idx, bi, t, channels, channel_ok, s, stride_b, stride_s,
                                                   WIDE, HAS_SEQ_IDX, 4)
            for j in tl.static_range(4):  # output row t + j: its taps' inputs, each in its document or zero
                q0, q1, q2, q3 = _taps(j, p3, p2, p1, r0, r1, r2, r3, d3, d2, d1, e0, e1, e2, e3, True, HAS_SEQ_IDX)
                g = _gate_row(q0, q1, q2, q3, w0, w1, w2, w3, bias_row, dy, bi, t + j, channels, channel_ok, s,
                              dy_stride_b, dy_stride_s, gate, c, WIDE, HAS_BIAS, x.dtype.element_ty)
                dw0 += q0 * g
                dw1 += q1 * g
                dw2 += q2 * g
                dw3 += q3 * g
                dbias += g
            p3, p2, p1, d3, d2, d1 = r1, r2, r3, e1, e2, e3
        # tap i (x_{t-K+1+i}) is place 4 - K + i
        row = parts + (part * c + channels) * (K + 1)  # this program's [c, K + 1] part
        if K == 4:
            tl.store(row + K - 4, dw0, mask=channel_ok)
        if K >= 3:
            tl.store(row + K - 3, dw1, mask=channel_ok)
        if K >= 2:
            tl.store(row + K - 2, dw2, mask=channel_ok)
        tl.store(row + K - 1, dw3, mask=channel_ok)
        tl.store(row + K, dbias, mask=channel_ok)

    @triton.jit
    def _store_dx(dx, tile, bi, t, channels, channel_ok, s, dx_stride_b, dx_stride_s, WIDE: tl.constexpr):
        row = t.to(tl.int64) if WIDE else t
        tl.store(dx + bi * dx_stride_b + row * dx_stride_s + channels, tile.to(dx.dtype.element_ty),
                 mask=channel_ok & (t + tl.zeros_like(channels) < s))

    @triton.jit
    def _dx_kernel(weight, seq_idx, gate, dx, s, c, gate_stride_b, dx_stride_b, dx_stride_s, WIDE: tl.constexpr,
                   HAS_SEQ_IDX: tl.constexpr, K: tl.constexpr, WALK: tl.constexpr, BLOCK_C: tl.constexpr):
        """dx of a run of WALK tokens: x_t feeds the outputs t .. t + K - 1 (those of its document alone),
        g_{t+j} by tap K - 1 - j; the 3 rows after each iteration's 4 carried. dx written by its strides
        (a slice of a wider gradient)."""
        tl.static_assert(K <= 4 and WALK % 4 == 0, "at most 4 taps; walks of whole iterations of 4 rows")
        walks = tl.cdiv(s, WALK)
        bi, t0 = (tl.program_id(0) // walks).to(tl.int64), (tl.program_id(0) % walks) * WALK
        channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        channel_ok = channels < c
        v0 = _dx_weights(weight, channels, channel_ok, 0, K)
        v1 = _dx_weights(weight, channels, channel_ok, 1, K)
        v2 = _dx_weights(weight, channels, channel_ok, 2, K)
        v3 = _dx_weights(weight, channels, channel_ok, 3, K)
        # g_t, g_{t+1}, g_{t+2} and their documents, carried
        n0, n1, n2, f0, f1, f2 = _rows(gate, seq_idx, bi, t0, channels, channel_ok, s, gate_stride_b, c, WIDE,
                                       HAS_SEQ_IDX, 3)
        for i in range(0, tl.minimum(WALK, s - t0), 4):
            t = t0 + i  # a tensor (the interpreter's loop counts are ints)
            r0, r1, r2, r3, e0, e1, e2, e3 = _rows(gate, seq_idx, bi, t + 3, channels, channel_ok, s, gate_stride_b, c,
                                                   WIDE, HAS_SEQ_IDX, 4)
            for j in tl.static_range(4):  # dx row t + j
                q0, q1, q2, q3 = _taps(j, n0, n1, n2, r0, r1, r2, r3, f0, f1, f2, e0, e1, e2, e3, False, HAS_SEQ_IDX)
                _store_dx(dx, _dot4(q0, q1, q2, q3, v0, v1, v2, v3), bi, t + j, channels, channel_ok, s,
                          dx_stride_b, dx_stride_s, WIDE)
            n0, n1, n2, f0, f1, f2 = r1, r2, r3, e1, e2, e3
