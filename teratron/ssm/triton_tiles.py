"""Tile addressing shared by the Triton scans (`ssd_triton`, `gated_delta_rule_triton`): a
program's (batch, chunk, head) and the [L, WIDTH] token tiles of [b, s, columns, width] tensors,
contiguous (`load_tokens`) or with any batch and token strides (`load_rows`: a slice of a wider
tensor, as a mixer's projections are)."""

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch paths serve without Triton
    triton = None

if triton is not None:
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
    def load_rows(ptr, bi, c, column, s, stride_b, stride_s, width, first, L: tl.constexpr, WIDTH: tl.constexpr):
        """`load_tokens` of a [b, s, columns, width] tensor whose columns x width are contiguous, its
        batch and token strides stride_b and stride_s (in elements)."""
        t = c * L + tl.arange(0, L)
        lanes = first + tl.arange(0, WIDTH)
        offsets = bi * stride_b + t[:, None].to(tl.int64) * stride_s + column * width + lanes[None, :]
        mask = (t[:, None] < s) & (lanes[None, :] < width)
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)

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
