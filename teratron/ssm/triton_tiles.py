"""Tile addressing shared by the Triton scans (`ssd_triton`, `gated_delta_rule_triton`): a
program's (batch, chunk, head), the [L, WIDTH] token tiles of [b, s, columns, width] tensors,
contiguous (`load_tokens`, `store_tokens`) or with any batch and token strides (`load_rows`,
`store_rows`: a slice of a wider tensor, as a mixer's projections and their gradients are), and their
products (`dot`)."""

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch paths serve without Triton
    triton = None

if triton is not None:
    # Triton's interpreter multiplies 16-bit tiles as their raw bits: `dot` takes them in fp32 there
    # (the same products: a 16-bit value's is exact in fp32). Compiled kernels read globals only as
    # constexprs; the interpreter takes the bool.
    NATIVE_16BIT_DOTS = False if os.environ.get("TRITON_INTERPRET") == "1" else tl.constexpr(True)

    @triton.jit
    def dot(x, y, PRECISION: tl.constexpr):
        """x y accumulated in fp32: two 16-bit tiles of one dtype multiply as they are (exact products),
        any other pair in fp32 at PRECISION ("ieee", or "tf32" where the kernel's inputs are 16-bit)."""
        if NATIVE_16BIT_DOTS and x.dtype == y.dtype and x.dtype != tl.float32:
            out = tl.dot(x, y)
        else:
            out = tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision=PRECISION)
        return out

    @triton.jit
    def program_chunk(m):
        """(batch, chunk, head or group) of a program on grid (b * m, h or g, ...); batch in int64
        (offsets of [b, s, h, p] tensors can pass 2**31)."""
        pid = tl.program_id(0)
        return (pid // m).to(tl.int64), pid % m, tl.program_id(1)

    @triton.jit
    def token_offsets(bi, c, column, s, columns, width, first, L: tl.constexpr, WIDTH: tl.constexpr):
        """Offsets and mask of the [L, WIDTH] tile of chunk c, lanes first .. first + WIDTH - 1, of a
        contiguous [b, s, columns, width] tensor at (bi, :, column); masked past the sequence and width."""
        t = c * L + tl.arange(0, L)
        lanes = first + tl.arange(0, WIDTH)
        offsets = ((bi * s + t[:, None]) * columns + column) * width + lanes[None, :]
        return offsets, (t[:, None] < s) & (lanes[None, :] < width)

    @triton.jit
    def load_rows_as_stored(ptr, bi, c, column, s, stride_b, stride_s, width, first, L: tl.constexpr,
                            WIDTH: tl.constexpr):
        """`load_tokens_as_stored` of a [b, s, columns, width] tensor whose columns x width are
        contiguous, its batch and token strides stride_b and stride_s (in elements)."""
        t = c * L + tl.arange(0, L)
        lanes = first + tl.arange(0, WIDTH)
        offsets = bi * stride_b + t[:, None].to(tl.int64) * stride_s + column * width + lanes[None, :]
        mask = (t[:, None] < s) & (lanes[None, :] < width)
        return tl.load(ptr + offsets, mask=mask, other=0.0)

    @triton.jit
    def store_rows(ptr, tile, bi, c, column, s, stride_b, stride_s, width, first, L: tl.constexpr,
                   WIDTH: tl.constexpr):
        """`store_tokens` into a tensor laid out as `load_rows` reads one."""
        t = c * L + tl.arange(0, L)
        lanes = first + tl.arange(0, WIDTH)
        offsets = bi * stride_b + t[:, None].to(tl.int64) * stride_s + column * width + lanes[None, :]
        tl.store(ptr + offsets, tile.to(ptr.dtype.element_ty), mask=(t[:, None] < s) & (lanes[None, :] < width))

    @triton.jit
    def load_rows(ptr, bi, c, column, s, stride_b, stride_s, width, first, L: tl.constexpr, WIDTH: tl.constexpr):
        """`load_rows_as_stored` in fp32."""
        return load_rows_as_stored(ptr, bi, c, column, s, stride_b, stride_s, width, first, L, WIDTH).to(tl.float32)

    @triton.jit
    def load_tokens_as_stored(ptr, bi, c, column, s, columns, width, first, L: tl.constexpr, WIDTH: tl.constexpr):
        """The tile of `token_offsets` in the tensor's own dtype, zeros where masked."""
        offsets, mask = token_offsets(bi, c, column, s, columns, width, first, L, WIDTH)
        return tl.load(ptr + offsets, mask=mask, other=0.0)

    @triton.jit
    def load_tokens(ptr, bi, c, column, s, columns, width, first, L: tl.constexpr, WIDTH: tl.constexpr):
        """`load_tokens_as_stored` in fp32."""
        return load_tokens_as_stored(ptr, bi, c, column, s, columns, width, first, L, WIDTH).to(tl.float32)

    @triton.jit
    def store_tokens(ptr, tile, bi, c, column, s, columns, width, first, L: tl.constexpr, WIDTH: tl.constexpr):
        offsets, mask = token_offsets(bi, c, column, s, columns, width, first, L, WIDTH)
        tl.store(ptr + offsets, tile.to(ptr.dtype.element_ty), mask=mask)
