"""Mamba-2's chunked state-space scan (`ssd_chunked` in teratron.ssm.ssd: read its docstring for
the math and shapes) as Triton kernels, forward and backward. `ssd_triton` returns what
`ssd_chunked` returns and autograd gives the same gradients; it runs on CUDA tensors (and on CPU
tensors under TRITON_INTERPRET=1, the way the CPU tests check the kernels' code).

Per chunk c of L tokens and head h, with a_t = dt_t A_h, cum_i its running sum in the chunk, its
last entry Lam = cum_{L-1}, xw_j = dt_j x_j, decay_ij = exp(cum_i - cum_j) for j <= i (else 0),
M = (C B^T) o decay [L, L] (o: elementwise), the chunk's own state S_c and H_c the one entering it:

    forward, each program one (batch, chunk, head) unless said
      cum        cumsum of a in the chunk (packed documents: a += DOCUMENT_START_LOG_DECAY at a
                 document's first token, the one place seq_idx is read; a constant, so the
                 backward is unchanged)                                       (_chunk_cumsum_kernel)
      S_c        sum_j exp(Lam - cum_j) xw_j B_j^T = (x o w)^T B             (_chunk_state_kernel)
      H_c        H_0 = initial; H_{c+1} = exp(Lam_c) H_c + S_c, a loop over
                 chunks per (batch, head, block of the p x n state)          (_state_passing_kernel)
      CB         C B^T [L, L], once per (batch, chunk, group): its heads share it (_chunk_scores_kernel)
      y          M (dt o x) + exp(cum) o (C H_c^T) + D x                     (_chunk_scan_kernel)

    backward: with the forward's cum, CB and H_c (saved), dY the output's gradient and dH_m the
    final state's, in this order
      G_c        sum_i exp(cum_i) dY_i C_i^T: the chunk's direct pull on H_c (_chunk_state_kernel)
      dH_c       exp(Lam_c) dH_{c+1} + G_c, backwards over chunks; dS_c = dH_{c+1};
                 d initial = dH_0                                             (_state_passing_backward_kernel)
      dCB        sum over a group's heads of Q = (dY xw^T) o decay; per head, the decay's pull
                 dcum = rowsum(R) - colsum(R), R = Q o CB     (_chunk_scan_backward_dcb_kernel)
      dC, dB     per (batch, chunk, group): dC = dCB B + sum over heads exp(cum) o (dY H_c),
                 dB = dCB^T C + sum over heads exp(Lam - cum) o (xw dS_c); per head, from the
                 same state tiles, the state passing's dLam_c = exp(Lam_c) <dS_c, H_c> and the
                 earlier chunks' pull on the decay, exp(cum) o rowsum(dY o C H_c^T), taken as
                 exp(cum) o rowsum(C o dY H_c) (no C H_c^T product in the backward)
                                                                              (_chunk_scan_backward_dbc_kernel)
      dxw        M^T dY + exp(Lam - cum) o (B dS_c^T)   -> dx = dt o dxw + D dY, ddt = rowsum(x o dxw) + A da
      dcum       + the earlier chunks' pull (above)
                 - e, e_j = exp(Lam - cum_j) xw_j . (B dS_c^T)_j; dLam += sum(e)  (the chunk's state)
                 dcum_{L-1} += dLam; da = reverse cumsum of dcum; dA = sum dt o da; dD = sum dY o x
                                                                              (_chunk_scan_backward_dx_kernel)

A group's heads share B and C, so C B^T and the products with dCB are computed once per group,
not once per head (a Mamba-2 layer has 8 or 16 heads a group). The dCB sum over a group's heads
is split over programs (each a slice of the heads, `_Shape.heads_per_split`) when there are
too few (batch, chunk, group) programs to fill the GPU; their partial sums are added in a fixed
order (deterministic).

x, B, C and the output's gradient are read by their strides: any [b, s, columns, width] view whose
columns x width are contiguous (the mixer's slices of its convolution's output) goes in without a
copy. Outputs and gradients are written contiguous (`scan_backward_into` writes dx, dB and dC by
their strides: slices of the gradient of the convolution's output, in teratron.ssm.mamba_core).

Every sum accumulates in fp32. With 16-bit inputs (bf16, fp16) the chunks' states S_c / H_c and
their gradients G_c / dS_c are kept in that dtype (summed in fp32 by the state passings, rounded
once when stored: half the bytes the kernels that pass them move), and the products take 16-bit
operands on tensor cores (`triton_tiles.dot`): x, B, C, dY and the states as stored, the fp32
tiles M = (C B^T) o decay dt, dCB and (u o w) rounded once to that dtype; dt scales the products'
rows or columns after them, not x before (dY xw^T = (dY x^T) dt, xw dS^T = dt (x dS^T)).
fp32 inputs keep every buffer and product in fp32 ("ieee").
Tiles: [L, L] for the scores, and sides of p and n in blocks of at most MAX_BLOCK (padded to a
power of 2 of at least 16, tl.dot's smallest): y, dx and ddt take one block of p per program and
loop over n (C H^T and B dS^T are sums over n; ddt, dA and dD sum the p blocks' shares
afterwards), the chunk states a block of p (looping over n), dB and dC one block of n (looping
over p), CB and dCB loop over n and p: a program's
registers stay near what the [L, L] tiles take whatever p and n are.
"""

import os
from dataclasses import dataclass
from typing import Optional

import torch

from teratron.ssm.recurrence import DOCUMENT_START_LOG_DECAY

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path serves without Triton
    triton = None
if triton is not None:
    from teratron.ssm.triton_tiles import dot, load_rows, load_rows_as_stored, program_chunk, store_rows, store_tokens
# Triton reads TRITON_INTERPRET when it defines the kernels (at import): then they run on CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements of the p x n state per program of the (sequential over chunks) state passing.
STATE_BLOCK = 512
# Chunk sizes the kernels take ([L, L] fp32 tiles past 128 would not fit a program's registers).
CHUNK_SIZES = (16, 32, 64, 128)
# Largest tile side over p and over n (a program takes a block of p, or of n, and loops over the
# other). Blocks of 64 spill more registers than blocks of 32 (sm_90, bf16 inputs, 8 warps, L = 128:
# up to 1.9 KB a thread in the backward kernels against 800 bytes) yet run 12-15 % faster on an H200
# (half the loop trips and programs; bench/RESULTS.md session 14); with 16-bit tiles the dCB and dB/dC
# kernels, which loop over p inside a program, are fastest on them too (H100, session 26: 322 and
# 284 µs against 353 and 391 at blocks of 32 over p). Every kernel's shared memory stays within an
# H100's 227 KiB, fp32 inputs included (tests/ssm/test_ssd_triton.py compiles them).
MAX_BLOCK = 64
# (batch, chunk, group) programs below which the backward's dCB sum over a group's heads is split
# over several programs (an H200 has 132 SMs; a few programs each keep them busy).
DCB_PROGRAMS = 512
# (warps, software-pipelining stages) of each kernel at chunks of 64 tokens and more: the fastest of
# 2-16 warps x 1-4 stages, each kernel timed alone at chunk 128, tiles of 64, 64 heads x 64, d_state
# 128, 8 groups, 4 x 2,048 bf16 tokens on an H200 (bench/scan_launch_sweep.py; bench/RESULTS.md,
# session 16: 2.65 -> 2.03 ms of kernels per forward + backward); the chunk states, the output, dCB
# and dB/dC kernels swept again on 16-bit operands (4-8 warps x 1-3 stages, H100, session 26; dB/dC
# at 4 warps and blocks of 32 over p, not used, hit an illegal memory access there). One stage
# (no pipelining of a loop's loads) gives the [L, L] kernels the shared memory and registers back.
# Applied from chunk 64 up (timed at chunk 128 only); chunks of 32 and less: 4 warps, Triton's default
# stages.
LAUNCH = dict(cumsum=(4, 1), chunk_state=(4, 2), state_passing=(4, 3), state_passing_backward=(2, 4),
              scores=(4, 1), scan=(8, 1), dcb=(8, 1), dbc=(8, 2), dx=(8, 1))


def ssd_triton(x, dt, A, B, C, D=None, initial_state=None, chunk_size: int = 64, seq_idx=None):
    """`ssd_chunked` by the Triton kernels (the module docstring): x [b, s, h, p], dt [b, s, h],
    A [h], B and C [b, s, g, n], D [h] or None, initial_state [b, h, p, n] or None, seq_idx [b, s]
    int or None (packed documents) -> (y [b, s, h, p], final state [b, h, p, n]), both in x's dtype.
    chunk_size: 16, 32, 64 or 128."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"ssd_triton: chunk_size {chunk_size} must be one of {', '.join(map(str, CHUNK_SIZES))} "
                         "(the kernels' tile sizes; MambaMixer's default is 128)")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"ssd_triton: x is {x.dtype}; the kernels take float32, bfloat16 or float16 "
                         "(ssd_chunked computes other dtypes)")
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32).contiguous()
    y, final, *_ = _ssd_scan(x, dt, A, B, C, D, initial_state, chunk_size, seq_idx)
    return y, final


@dataclass(frozen=True)
class _Shape:
    """Sizes every kernel takes, and their tiles' padded sides."""
    batch: int
    seq: int
    heads: int
    head_dim: int  # p
    groups: int
    d_state: int   # n
    chunk: int     # L
    chunks: int    # m

    @classmethod
    def of(cls, x, B, chunk_size):
        (b, s, h, p), (g, n) = x.shape, B.shape[2:]
        return cls(b, s, h, p, g, n, chunk_size, -(-s // chunk_size))

    def sizes(self):
        return dict(s=self.seq, heads=self.heads, heads_per_group=self.heads // self.groups, m=self.chunks,
                    p=self.head_dim, n=self.d_state)

    def meta(self, dtype, kernel: str):
        """The tile sizes and launch configuration of `kernel` (a key of LAUNCH)."""
        block_p, block_n = self.blocks
        return dict(L=self.chunk, BLOCK_P=block_p, BLOCK_N=block_n,
                    # fp32 inputs need "ieee" to match ssd_chunked to fp32 rounding; with 16-bit inputs
                    # products of 16-bit tiles ignore it (`dot`), a pair of mixed dtypes takes tf32
                    PRECISION="ieee" if dtype == torch.float32 else "tf32", **self.launch(kernel))

    def launch(self, kernel: str):
        if self.chunk <= 32:
            return dict(num_warps=4)
        warps, stages = LAUNCH[kernel]
        return dict(num_warps=warps, num_stages=stages)

    @property
    def blocks(self):
        """(BLOCK_P, BLOCK_N): p and n padded to a power of 2 of at least 16 (tl.dot's smallest tile
        side), at most MAX_BLOCK."""
        return (min(max(16, triton.next_power_of_2(self.head_dim)), MAX_BLOCK),
                min(max(16, triton.next_power_of_2(self.d_state)), MAX_BLOCK))

    @property
    def p_blocks(self):
        return triton.cdiv(self.head_dim, self.blocks[0])

    @property
    def n_blocks(self):
        return triton.cdiv(self.d_state, self.blocks[1])

    @property
    def heads_per_split(self):
        """Heads per program of the dCB sum: a group's heads, or a slice of them when fewer than
        DCB_PROGRAMS (batch, chunk, group) programs would run."""
        heads_per_group = self.heads // self.groups
        splits = min(heads_per_group, triton.cdiv(DCB_PROGRAMS, self.batch * self.chunks * self.groups))
        return triton.cdiv(heads_per_group, splits)

    @property
    def splits(self):
        return triton.cdiv(self.heads // self.groups, self.heads_per_split)


def _rows(t):
    """t [b, s, columns, width] as the kernels read it (`load_rows`): itself when its columns x width
    are contiguous (e.g. the mixer's slice of its convolution's output), else a contiguous copy."""
    if t.stride(-1) == 1 and (t.shape[2] == 1 or t.stride(2) == t.shape[3]):
        return t
    return t.contiguous()


def _row_strides(**tensors):
    """{name_sb: batch stride, name_ss: token stride} of each tensor, the kernels' arguments."""
    return {f"{name}_{which}": t.stride(dim) for name, t in tensors.items() for which, dim in (("sb", 0), ("ss", 1))}


def _token_inputs(x, B, C):
    """x, B and C as the kernels read them (B and C take one pair of strides: copies if theirs differ)."""
    x, B, C = _rows(x), _rows(B), _rows(C)
    if B.stride() != C.stride():
        B, C = B.contiguous(), C.contiguous()
    return x, B, C


def _empty_tokens(t):
    """A contiguous tensor of t's shape and dtype (outputs and gradients are written contiguous)."""
    return torch.empty(t.shape, device=t.device, dtype=t.dtype)


# The scan is a pair of custom ops (forward, backward) with autograd between them, so a layer compiled
# whole (`--torch-compile`) traces through it as one node: one graph per layer, its norms, convolution
# and layout changes fused around the kernels (a disabled function would break the graph in every
# frame on the stack, leaving each piece compiled apart).
@torch.library.custom_op("teratron::ssd_scan", mutates_args=())
def _ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: Optional[torch.Tensor], initial_state: Optional[torch.Tensor], chunk_size: int,
              seq_idx: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """(y, final state in x's dtype, and what the backward keeps: the chunks' cumulative decays cum
    (their documents' starts included) and C B^T per group in fp32, the states entering each chunk
    in x's dtype)."""
    shape = _Shape.of(x, B, chunk_size)
    x, B, C = _token_inputs(x, B, C)
    dt = dt.contiguous()
    A32 = A.float().contiguous()
    cum, states, final = _scan_states(x, dt, A32, B, initial_state, seq_idx, shape)
    b, m, g, L = shape.batch, shape.chunks, shape.groups, shape.chunk
    scores = torch.empty(b, m, g, L, L, device=x.device, dtype=torch.float32)  # C B^T per group
    _chunk_scores_kernel[(b * m, g)](B, C, scores, **_row_strides(bc=B), **shape.sizes(),
                                     **shape.meta(x.dtype, "scores"))
    y = _empty_tokens(x)
    D32 = D.float().contiguous() if D is not None else A32  # unused without D
    _chunk_scan_kernel[(b * m, shape.heads, shape.p_blocks)](
        x, dt, C, D32, cum, scores, states, y, **_row_strides(x=x, bc=B), **shape.sizes(), HAS_D=D is not None,
        **shape.meta(x.dtype, "scan"))
    # The entering states are kept ([b, m, h, p, n] in x's dtype: d_state / chunk times x's bytes,
    # as many at d_state 128 and chunk 128): recomputing them cost the backward a chunk-state and a
    # state-passing pass, a fifth of its time (H200, the hybrid benchmark's shape). C B^T is kept
    # too (fp32 [b, m, g, L, L]: half a bf16 x's bytes at 8 groups of 8 heads of 64, chunk 128).
    return y, final.to(x.dtype), cum, scores, states


@_ssd_scan.register_fake
def _(x, dt, A, B, C, D, initial_state, chunk_size, seq_idx):
    shape = _Shape.of(x, B, chunk_size)
    b, h, m, L = shape.batch, shape.heads, shape.chunks, shape.chunk
    g, p, n = shape.groups, shape.head_dim, shape.d_state
    fp32 = dict(device=x.device, dtype=torch.float32)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(b, h, p, n),
            torch.empty(b, h, m * L, **fp32), torch.empty(b, m, g, L, L, **fp32), x.new_empty(b, m, h, p, n))


def _setup_scan(ctx, inputs, output):
    x, dt, A, B, C, D, initial_state, chunk_size, _ = inputs
    _, _, cum, scores, states = output
    ctx.save_for_backward(x, dt, A, B, C, D, initial_state, cum, scores, states)
    ctx.chunk_size = chunk_size
    ctx.has_D, ctx.has_initial = D is not None, initial_state is not None


def _scan_autograd(ctx, dy, dfinal, *unused):
    x, dt, A, B, C, D, initial_state, cum, scores, states = ctx.saved_tensors
    if dy is None:  # only the final state used
        dy = torch.zeros_like(x)
    if dfinal is None:
        dfinal = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[3])
    dx, ddt, dA, dB, dC, dD, dinitial = _ssd_scan_backward(dy, dfinal, x, dt, A, B, C, D, initial_state, cum,
                                                           scores, states, ctx.chunk_size)
    return (dx, ddt, dA, dB, dC, dD if ctx.has_D else None, dinitial if ctx.has_initial else None, None, None)


@torch.library.custom_op("teratron::ssd_scan_backward", mutates_args=())
def _ssd_scan_backward(dy: torch.Tensor, dfinal: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                       B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor],
                       initial_state: Optional[torch.Tensor],
                       cum: torch.Tensor, scores: torch.Tensor, states: torch.Tensor,
                       chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of x, dt, A, B, C, D and the initial state (the last two unused without them)."""
    dx, dB, dC = _empty_tokens(x), _empty_tokens(B), _empty_tokens(C)
    ddt, dA, dD, dinitial = scan_backward_into(dx, dB, dC, dy, dfinal, x, dt, A, B, C, D, initial_state, cum, scores,
                                               states, chunk_size)
    return dx, ddt, dA.clone(), dB, dC, dD, dinitial  # an op's outputs may not alias: dA and dD may be views


def scan_backward_into(dx, dB, dC, dy, dfinal, x, dt, A, B, C, D, initial_state, cum, scores, states, chunk_size):
    """Writes the gradients of x, B and C into dx, dB and dC (views laid out as `_rows` takes an input,
    dB and dC with the same strides: slices of the gradient of the convolution's output, in
    teratron.ssm.mamba_core; dfinal None: the final state is discarded); returns those of dt, A, D and the
    initial state (dA and dD may be views of one tensor)."""
    assert dB.stride() == dC.stride() and _rows(dx) is dx and _rows(dB) is dB, "dx, dB, dC: rows of contiguous heads"
    shape = _Shape.of(x, B, chunk_size)
    b, h, m = shape.batch, shape.heads, shape.chunks
    x, B, C = _token_inputs(x, B, C)
    dt, dy = dt.contiguous(), _rows(dy)
    A32 = A.float().contiguous()
    D32 = D.float().contiguous() if D is not None else A32  # unused without D
    dstates, dinitial = _state_grads(dy, dt, C, cum, dfinal, shape)

    fp32 = dict(device=x.device, dtype=torch.float32)
    # dCB's partial sums over slices of a group's heads, and each head's dcum from the decay
    dscores_parts = torch.empty(shape.splits, b, m, shape.groups, shape.chunk, shape.chunk, **fp32)
    dcum_intra = torch.empty_like(cum)
    _chunk_scan_backward_dcb_kernel[(b * m, shape.groups, shape.splits)](
        x, dt, dy, cum, scores, dscores_parts, dcum_intra, **_row_strides(x=x, dy=dy), **shape.sizes(),
        HEADS_PER_SPLIT=shape.heads_per_split, **shape.meta(x.dtype, "dcb"))
    # dB and dC, and each n block's share of dLam_c = exp(Lam_c) <dS_c, H_c> (the state passing's
    # pull on the chunk's decay), summed by the dx kernel
    n_parts = shape.n_blocks
    dlast_parts = torch.empty(b, h, m, n_parts, **fp32)
    # ... and each n block's share of the earlier chunks' pull on the decay (dcum), added by the dx kernel
    dcum_earlier_parts = torch.empty(n_parts, *cum.shape, **fp32)
    _chunk_scan_backward_dbc_kernel[(b * m, shape.groups, n_parts)](
        x, dt, B, C, dy, cum, dscores_parts, states, dstates, dB, dC, dlast_parts, dcum_earlier_parts,
        **_row_strides(x=x, bc=B, dy=dy, dbc=dB), **shape.sizes(), SPLITS=shape.splits, **shape.meta(x.dtype, "dbc"))
    # Each block of p adds its share of ddt, and of dA and dD ([2, p blocks, b, m, h], summed in one
    # reduction): summed here, in a fixed order (ddt's a copy when p is one block: none made).
    ddt_parts = torch.empty(shape.p_blocks, b, shape.seq, h, **fp32)
    dAD_parts = torch.empty(2, shape.p_blocks, b, m, h, **fp32)
    _chunk_scan_backward_dx_kernel[(b * m, h, shape.p_blocks)](
        x, dt, A32, B, D32, dy, cum, scores, dstates, dlast_parts, dcum_intra, dcum_earlier_parts, dx, ddt_parts,
        dAD_parts, **_row_strides(x=x, bc=B, dy=dy, dx=dx), **shape.sizes(), HAS_D=D is not None, N_PARTS=n_parts,
        **shape.meta(x.dtype, "dx"))
    ddt = (ddt_parts[0] if shape.p_blocks == 1 else ddt_parts.sum(0)).to(dt.dtype)
    dA, dD = dAD_parts.flatten(1, 3).sum(1)  # views of one tensor
    dA, dD = dA.to(A.dtype), dD.to(D.dtype if D is not None else torch.float32)
    return ddt, dA, dD, dinitial.to(initial_state.dtype if initial_state is not None else torch.float32)


@_ssd_scan_backward.register_fake
def _(dy, dfinal, x, dt, A, B, C, D, initial_state, cum, scores, states, chunk_size):
    contiguous = dict(memory_format=torch.contiguous_format)
    dD = D.new_empty(D.shape) if D is not None else A.new_empty(A.shape, dtype=torch.float32)
    dinitial = dfinal.new_empty(dfinal.shape, dtype=initial_state.dtype if initial_state is not None else torch.float32)
    return (torch.empty_like(x, **contiguous), torch.empty_like(dt, **contiguous), torch.empty_like(A),
            torch.empty_like(B, **contiguous), torch.empty_like(C, **contiguous), dD, dinitial)


_ssd_scan.register_autograd(_scan_autograd, setup_context=_setup_scan)


def _scan_states(x, dt, A32, B, initial_state, seq_idx, shape):
    """The chunks' cumulative decays cum [b, h, m * L] (fp32), the states entering each chunk
    [b, m, h, p, n] (x's dtype), and the final state [b, h, p, n] (fp32)."""
    b, h, m, L, p, n = shape.batch, shape.heads, shape.chunks, shape.chunk, shape.head_dim, shape.d_state
    cum = torch.empty(b, h, m * L, device=x.device, dtype=torch.float32)
    _chunk_cumsum_kernel[(b * m, h)](dt, A32, seq_idx if seq_idx is not None else dt, cum, shape.seq, h, m,
                                     START_LOG_DECAY=DOCUMENT_START_LOG_DECAY, HAS_SEQ_IDX=seq_idx is not None,
                                     L=L, **shape.launch("cumsum"))
    states = torch.empty(b, m, h, p, n, device=x.device, dtype=x.dtype)  # S_c, then H_c in place
    _chunk_state_kernel[(b * m, h, shape.p_blocks)](
        x, B, dt, cum, states, **_row_strides(u=x, v=B), **shape.sizes(), FROM_START=False,
        **shape.meta(x.dtype, "chunk_state"))
    final = torch.empty(b, h, p, n, device=x.device, dtype=torch.float32)
    initial = initial_state.float().contiguous() if initial_state is not None else final  # unused without
    _state_passing_kernel[(b, h, triton.cdiv(p * n, STATE_BLOCK))](
        states, cum, initial, final, h, m, p * n, L=L, BLOCK=STATE_BLOCK, HAS_INITIAL=initial_state is not None,
        **shape.launch("state_passing"))
    return cum, states, final


def _state_grads(dy, dt, C, cum, dfinal, shape):
    """dS_c, the gradient of each chunk's own state (that of the state leaving it) [b, m, h, p, n]
    in dy's dtype, and the initial state's gradient [b, h, p, n] (fp32)."""
    b, h, m, p, n = shape.batch, shape.heads, shape.chunks, shape.head_dim, shape.d_state
    dstates = torch.empty(b, m, h, p, n, device=dy.device, dtype=dy.dtype)  # G_c, then dS_c in place
    _chunk_state_kernel[(b * m, h, shape.p_blocks)](
        dy, C, dt, cum, dstates, **_row_strides(u=dy, v=C), **shape.sizes(), FROM_START=True,
        **shape.meta(dy.dtype, "chunk_state"))
    dinitial = torch.empty(b, h, p, n, device=dy.device, dtype=torch.float32)
    _state_passing_backward_kernel[(b, h, triton.cdiv(p * n, STATE_BLOCK))](
        dstates, cum, dfinal.float().contiguous() if dfinal is not None else dinitial, dinitial, h, m, p * n,
        L=shape.chunk, BLOCK=STATE_BLOCK, HAS_DFINAL=dfinal is not None, **shape.launch("state_passing_backward"))
    return dstates, dinitial


if triton is not None:
    @triton.jit
    def _load_dt(dt, bi, c, head, s, heads, L: tl.constexpr):
        """[L] fp32: chunk c's dt of (bi, head), 0 past the end (no decay, nothing added)."""
        t = c * L + tl.arange(0, L)
        return tl.load(dt + (bi * s + t) * heads + head, mask=t < s, other=0.0).to(tl.float32)

    @triton.jit
    def _load_cum(cum, bi, c, head, heads, m, L: tl.constexpr):
        """[L] running sums of dt A in chunk c, and the last (the whole chunk's log-decay)."""
        row = cum + ((bi * heads + head) * m + c) * L
        return tl.load(row + tl.arange(0, L)), tl.load(row + L - 1)

    @triton.jit
    def _load_state(states, bi, c, head, heads, m, p, n, p0, n0, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        """The [BLOCK_P, BLOCK_N] tile at (p0, n0) of chunk c's state in [b, m, h, p, n], as stored."""
        rows = p0 + tl.arange(0, BLOCK_P)
        lanes = n0 + tl.arange(0, BLOCK_N)
        offsets = ((bi * m + c) * heads + head) * p * n + rows[:, None] * n + lanes[None, :]
        return tl.load(states + offsets, mask=(rows[:, None] < p) & (lanes[None, :] < n), other=0.0)

    @triton.jit
    def _causal_decay(cum, L: tl.constexpr):
        """[L, L]: exp(cum_i - cum_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)."""
        rows = tl.arange(0, L)
        causal = rows[:, None] >= rows[None, :]
        return tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))

    @triton.jit
    def _chunk_cumsum_kernel(dt, A, seq_idx, cum, s, heads, m, START_LOG_DECAY: tl.constexpr,
                             HAS_SEQ_IDX: tl.constexpr, L: tl.constexpr):
        """cum of chunk c: the running sum of a = dt A (+ START_LOG_DECAY where seq_idx [b, s] changes:
        a document's first token)."""
        bi, c, head = program_chunk(m)
        a = _load_dt(dt, bi, c, head, s, heads, L) * tl.load(A + head)
        if HAS_SEQ_IDX:
            t = c * L + tl.arange(0, L)
            document = tl.load(seq_idx + bi * s + t, mask=t < s, other=0)
            before = tl.load(seq_idx + bi * s + t - 1, mask=(t > 0) & (t < s), other=0)
            a += tl.where((t > 0) & (t < s) & (document != before), START_LOG_DECAY, 0.0)
        tl.store(cum + ((bi * heads + head) * m + c) * L + tl.arange(0, L), tl.cumsum(a, 0))

    @triton.jit
    def _chunk_state_kernel(u, v, dt, cum, states, u_sb, u_ss, v_sb, v_ss, s, heads, heads_per_group, m, p, n,
                            L: tl.constexpr,
                            BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                            FROM_START: tl.constexpr):
        """Rows k (a block of p) of states[bi, c, head] = (u o w)^T v over the chunk's tokens, a block of
        n at a time: u [b, s, h, p], v [b, s, g, n] (the head's group); w = exp(Lam - cum) dt (the
        chunk's own state: u = x, v = B) or, FROM_START, exp(cum) (the output gradient's pull on the
        entering state: u = dY, v = C)."""
        bi, c, head = program_chunk(m)
        p0 = tl.program_id(2) * BLOCK_P
        cum_c, last = _load_cum(cum, bi, c, head, heads, m, L)
        if FROM_START:
            weight = tl.exp(cum_c)
        else:
            weight = tl.exp(last - cum_c) * _load_dt(dt, bi, c, head, s, heads, L)
        u_tile = load_rows(u, bi, c, head, s, u_sb, u_ss, p, p0, L, BLOCK_P) * weight[:, None]
        u_tile = u_tile.to(states.dtype.element_ty)  # the product's operand: one rounding of u o w
        rows = p0 + tl.arange(0, BLOCK_P)
        for n0 in range(0, n, BLOCK_N):
            v_tile = load_rows_as_stored(v, bi, c, head // heads_per_group, s, v_sb, v_ss, n, n0, L, BLOCK_N)
            state = dot(tl.trans(u_tile), v_tile, PRECISION)  # [BLOCK_P, BLOCK_N]
            lanes = n0 + tl.arange(0, BLOCK_N)
            tl.store(states + ((bi * m + c) * heads + head) * p * n + rows[:, None] * n + lanes[None, :],
                     state.to(states.dtype.element_ty), mask=(rows[:, None] < p) & (lanes[None, :] < n))

    @triton.jit
    def _state_passing_kernel(states, cum, initial, final, heads, m, pn, L: tl.constexpr, BLOCK: tl.constexpr,
                              HAS_INITIAL: tl.constexpr):
        """Program (bi, head, k): block k of the flattened p x n state, over the chunks in order;
        replaces each chunk's own state S_c by the state entering it, H_c."""
        bi = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        lanes = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        ok = lanes < pn
        if HAS_INITIAL:
            state = tl.load(initial + (bi * heads + head) * pn + lanes, mask=ok, other=0.0)
        else:
            state = tl.zeros([BLOCK], tl.float32)
        # Chunk c + 1's loads are issued before chunk c's store: two chunks' reads in flight
        # (the loop is one long chain, bound by memory latency, not bandwidth).
        own = tl.load(states + (bi * m * heads + head) * pn + lanes, mask=ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(cum + (bi * heads + head) * m * L + L - 1))
        for c in range(m):
            ahead = tl.minimum(c + 1, m - 1)  # the last chunk reloads itself (unused)
            next_own = tl.load(states + ((bi * m + ahead) * heads + head) * pn + lanes, mask=ok, other=0.0)
            next_decay = tl.exp(tl.load(cum + ((bi * heads + head) * m + ahead) * L + L - 1))
            tl.store(states + ((bi * m + c) * heads + head) * pn + lanes, state.to(states.dtype.element_ty), mask=ok)
            state = decay * state + own
            own, decay = next_own.to(tl.float32), next_decay
        tl.store(final + (bi * heads + head) * pn + lanes, state, mask=ok)

    @triton.jit
    def _state_passing_backward_kernel(dstates, cum, dfinal, dinitial, heads, m, pn, L: tl.constexpr,
                                       BLOCK: tl.constexpr, HAS_DFINAL: tl.constexpr):
        """Program (bi, head, k), the chunks in reverse: replaces G_c by dS_c = dH_{c+1}, and writes
        dH_0 (chunk c - 1's loads issued before chunk c's store, as in the forward). Without
        HAS_DFINAL the final state's gradient is zero (the state is discarded)."""
        bi = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        lanes = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        ok = lanes < pn
        if HAS_DFINAL:
            dstate = tl.load(dfinal + (bi * heads + head) * pn + lanes, mask=ok, other=0.0)
        else:
            dstate = tl.zeros([BLOCK], tl.float32)
        pull = tl.load(dstates + ((bi * m + m - 1) * heads + head) * pn + lanes, mask=ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(cum + ((bi * heads + head) * m + m - 1) * L + L - 1))
        for i in range(m):
            c = m - 1 - i
            ahead = tl.maximum(c - 1, 0)  # the first chunk reloads itself (unused)
            next_pull = tl.load(dstates + ((bi * m + ahead) * heads + head) * pn + lanes, mask=ok, other=0.0)
            next_decay = tl.exp(tl.load(cum + ((bi * heads + head) * m + ahead) * L + L - 1))
            tl.store(dstates + ((bi * m + c) * heads + head) * pn + lanes, dstate.to(dstates.dtype.element_ty),
                     mask=ok)
            dstate = decay * dstate + pull
            pull, decay = next_pull.to(tl.float32), next_decay
        tl.store(dinitial + (bi * heads + head) * pn + lanes, dstate, mask=ok)

    @triton.jit
    def _scores_offsets(bi, c, group, groups, m, L: tl.constexpr):
        """Offsets of the [L, L] tile of (bi, c, group) in a [b, m, g, L, L] tensor."""
        rows = tl.arange(0, L)
        return ((bi * m + c) * groups + group) * L * L + rows[:, None] * L + rows[None, :]

    @triton.jit
    def _chunk_scores_kernel(B, C, scores, bc_sb, bc_ss, s, heads, heads_per_group, m, p, n, L: tl.constexpr,
                             BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """Program (bi * m + c, group): C B^T [L, L] of the chunk, over blocks of n."""
        bi, c, group = program_chunk(m)
        groups = heads // heads_per_group
        acc = tl.zeros([L, L], tl.float32)
        for n0 in range(0, n, BLOCK_N):
            B_tile = load_rows_as_stored(B, bi, c, group, s, bc_sb, bc_ss, n, n0, L, BLOCK_N)
            C_tile = load_rows_as_stored(C, bi, c, group, s, bc_sb, bc_ss, n, n0, L, BLOCK_N)
            acc += dot(C_tile, tl.trans(B_tile), PRECISION)
        tl.store(scores + _scores_offsets(bi, c, group, groups, m, L), acc)

    @triton.jit
    def _times_state(u, states, bc_sb, bc_ss, bi, c, head, group, s, heads, m, p, n, p0,
                     L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """U S^T [L, BLOCK_P] over blocks of n, for u [b, s, g, n] (C or B) and chunk c's state S
        (its rows p0 ...) in [b, m, h, p, n]: C H_c^T, B dS_c^T."""
        out = tl.zeros([L, BLOCK_P], tl.float32)
        for n0 in range(0, n, BLOCK_N):
            u_tile = load_rows_as_stored(u, bi, c, group, s, bc_sb, bc_ss, n, n0, L, BLOCK_N)
            state = _load_state(states, bi, c, head, heads, m, p, n, p0, n0, BLOCK_P, BLOCK_N)
            out += dot(u_tile, tl.trans(state), PRECISION)
        return out

    @triton.jit
    def _chunk_scan_kernel(x, dt, C, D, cum, scores, states, y, x_sb, x_ss, bc_sb, bc_ss, s, heads, heads_per_group,
                           m, p, n, L: tl.constexpr,
                           BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                           HAS_D: tl.constexpr):
        """Program (bi * m + c, head, k): y's block k of p in chunk c, M (dt o x) + exp(cum) o (C H_c^T) + D x."""
        bi, c, head = program_chunk(m)
        group, groups = head // heads_per_group, heads // heads_per_group
        p0 = tl.program_id(2) * BLOCK_P
        earlier = _times_state(C, states, bc_sb, bc_ss, bi, c, head, group, s, heads, m, p, n, p0, L, BLOCK_P,
                               BLOCK_N, PRECISION)
        x_tile = load_rows_as_stored(x, bi, c, head, s, x_sb, x_ss, p, p0, L, BLOCK_P)
        cum_c, _ = _load_cum(cum, bi, c, head, heads, m, L)
        M = tl.load(scores + _scores_offsets(bi, c, group, groups, m, L)) * _causal_decay(cum_c, L)
        M *= _load_dt(dt, bi, c, head, s, heads, L)[None, :]
        out = dot(M.to(x_tile.dtype), x_tile, PRECISION) + tl.exp(cum_c)[:, None] * earlier
        if HAS_D:
            out += tl.load(D + head) * x_tile.to(tl.float32)
        store_tokens(y, out, bi, c, head, s, heads, p, p0, L, BLOCK_P)

    @triton.jit
    def _chunk_scan_backward_dcb_kernel(x, dt, dy, cum, scores, dscores_parts, dcum_intra, x_sb, x_ss, dy_sb, dy_ss,
                                        s, heads, heads_per_group, m, p, n, L: tl.constexpr, BLOCK_P: tl.constexpr,
                                        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                                        HEADS_PER_SPLIT: tl.constexpr):
        """Program (bi * m + c, group, split): the sum of Q = (dY xw^T) o decay over the split's
        heads of the group (its part of dCB, [splits, b, m, g, L, L]), and each of those heads'
        dcum from the decay, rowsum(R) - colsum(R) with R = Q o CB ([b, h, m * L], like cum)."""
        bi, c, group = program_chunk(m)
        groups = heads // heads_per_group
        split = tl.program_id(2)
        tile = _scores_offsets(bi, c, group, groups, m, L)
        dscores = tl.zeros([L, L], tl.float32)
        scores_tile = tl.load(scores + tile)  # the group's C B^T, once for its heads
        first = group * heads_per_group + split * HEADS_PER_SPLIT
        last = tl.minimum(first + HEADS_PER_SPLIT, (group + 1) * heads_per_group)
        for head in range(first, last):
            pair_grads = tl.zeros([L, L], tl.float32)  # dY x^T, then Q
            for p0 in range(0, p, BLOCK_P):
                x_tile = load_rows_as_stored(x, bi, c, head, s, x_sb, x_ss, p, p0, L, BLOCK_P)
                dy_tile = load_rows_as_stored(dy, bi, c, head, s, dy_sb, dy_ss, p, p0, L, BLOCK_P)
                pair_grads += dot(dy_tile, tl.trans(x_tile), PRECISION)
            cum_c, _ = _load_cum(cum, bi, c, head, heads, m, L)
            # dY xw^T = (dY x^T) o dt over the columns: no rounding of xw
            pair_grads *= _causal_decay(cum_c, L) * _load_dt(dt, bi, c, head, s, heads, L)[None, :]
            dscores += pair_grads
            decay_grads = pair_grads * scores_tile  # R
            tl.store(dcum_intra + ((bi * heads + head) * m + c) * L + tl.arange(0, L),
                     tl.sum(decay_grads, 1) - tl.sum(decay_grads, 0))
        tl.store(dscores_parts + split * tl.num_programs(0) * groups * L * L + tile, dscores)

    @triton.jit
    def _chunk_scan_backward_dx_kernel(x, dt, A, B, D, dy, cum, scores, dstates, dlast_parts, dcum_intra,
                                       dcum_earlier_parts, dx, ddt_parts, dAD_parts, x_sb, x_ss, bc_sb, bc_ss, dy_sb,
                                       dy_ss, dx_sb, dx_ss, s, heads, heads_per_group, m, p, n,
                                       L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                                       PRECISION: tl.constexpr, HAS_D: tl.constexpr, N_PARTS: tl.constexpr):
        """Program (bi * m + c, head, k): dx of block k of p in chunk c, and this block's shares of
        ddt ([p blocks, b, s, h]), dA and dD ([2, p blocks, b, m, h]): every dcum term is a sum over p
        (block 0 adds the terms summed elsewhere: the decay's, dcum_intra, and the dB/dC kernel's
        N_PARTS blocks of n's shares of the earlier chunks' (dcum_earlier_parts) and of the state
        passing's (dlast_parts))."""
        bi, c, head = program_chunk(m)
        group, groups = head // heads_per_group, heads // heads_per_group
        block = tl.program_id(2)
        p0 = block * BLOCK_P
        B_dstate = _times_state(B, dstates, bc_sb, bc_ss, bi, c, head, group, s, heads, m, p, n, p0, L, BLOCK_P,
                                BLOCK_N, PRECISION)
        x_tile = load_rows(x, bi, c, head, s, x_sb, x_ss, p, p0, L, BLOCK_P)
        dy_stored = load_rows_as_stored(dy, bi, c, head, s, dy_sb, dy_ss, p, p0, L, BLOCK_P)
        dy_tile = dy_stored.to(tl.float32)
        dt_c = _load_dt(dt, bi, c, head, s, heads, L)
        cum_c, last = _load_cum(cum, bi, c, head, heads, m, L)
        M = tl.load(scores + _scores_offsets(bi, c, group, groups, m, L)) * _causal_decay(cum_c, L)
        xw = x_tile * dt_c[:, None]
        to_end = tl.exp(last - cum_c)
        dxw = dot(tl.trans(M.to(dy_stored.dtype)), dy_stored, PRECISION) + to_end[:, None] * B_dstate
        dx_tile = dt_c[:, None] * dxw
        part = (block * tl.num_programs(0) + bi * m + c) * heads + head  # in [p blocks, b, m, h]
        if HAS_D:
            dx_tile += tl.load(D + head) * dy_tile
            dD_part = part + tl.num_programs(2) * tl.num_programs(0) * heads  # dAD_parts[1]
            tl.store(dAD_parts + dD_part, tl.sum(tl.sum(dy_tile * x_tile, 1), 0))
        store_rows(dx, dx_tile, bi, c, head, s, dx_sb, dx_ss, p, p0, L, BLOCK_P)

        own_state = to_end * tl.sum(xw * B_dstate, 1)
        dcum = -own_state
        dlast_c = tl.sum(own_state, 0)
        row = ((bi * heads + head) * m + c) * L + tl.arange(0, L)
        if block == 0:
            dcum += tl.load(dcum_intra + row)
            part_size = tl.num_programs(0).to(tl.int64) * heads * L  # one n block's [b, h, m * L]
            for share in range(N_PARTS):  # in order: the same sums every run
                dcum += tl.load(dcum_earlier_parts + share * part_size + row)
                dlast_c += tl.load(dlast_parts + ((bi * heads + head) * m + c) * N_PARTS + share)
        dcum += tl.where(tl.arange(0, L) == L - 1, dlast_c, 0.0)
        da = tl.cumsum(dcum, 0, reverse=True)
        ddt_c = tl.sum(x_tile * dxw, 1) + tl.load(A + head) * da
        t = c * L + tl.arange(0, L)
        tl.store(ddt_parts + ((block * (tl.num_programs(0) // m) + bi) * s + t) * heads + head, ddt_c, mask=t < s)
        tl.store(dAD_parts + part, tl.sum(dt_c * da, 0))

    @triton.jit
    def _chunk_scan_backward_dbc_kernel(x, dt, B, C, dy, cum, dscores_parts, states, dstates, dB, dC, dlast_parts,
                                        dcum_earlier_parts, x_sb, x_ss, bc_sb, bc_ss, dy_sb, dy_ss, dbc_sb, dbc_ss, s,
                                        heads, heads_per_group, m, p, n, L: tl.constexpr, BLOCK_P: tl.constexpr,
                                        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr):
        """Program (bi * m + c, group, k): block k of n of dB and dC in chunk c: dCB's products
        with C and B, and the state terms summed over the group's heads (each a loop over blocks of p);
        and, from the same state tiles, each head's shares of this block of n of dLam_c ([b, h, m,
        n blocks]) and of the earlier chunks' dcum, exp(cum) o rowsum(dY o C H_c^T) = exp(cum) o
        rowsum(C o dY H_c) ([n blocks, b, h, m * L])."""
        bi, c, group = program_chunk(m)
        groups = heads // heads_per_group
        n0 = tl.program_id(2) * BLOCK_N
        tile = _scores_offsets(bi, c, group, groups, m, L)
        dscores = tl.zeros([L, L], tl.float32)
        for split in range(SPLITS):  # in order: the same sum every run
            dscores += tl.load(dscores_parts + split * tl.num_programs(0) * groups * L * L + tile)
        B_tile = load_rows_as_stored(B, bi, c, group, s, bc_sb, bc_ss, n, n0, L, BLOCK_N)
        C_tile = load_rows_as_stored(C, bi, c, group, s, bc_sb, bc_ss, n, n0, L, BLOCK_N)
        dC_tile = dot(dscores.to(B_tile.dtype), B_tile, PRECISION)
        dB_tile = dot(tl.trans(dscores.to(C_tile.dtype)), C_tile, PRECISION)
        for k in range(heads_per_group):
            head = group * heads_per_group + k
            dy_entering = tl.zeros([L, BLOCK_N], tl.float32)
            x_dstate = tl.zeros([L, BLOCK_N], tl.float32)
            state_grads = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)  # dS_c o H_c
            for p0 in range(0, p, BLOCK_P):
                x_tile = load_rows_as_stored(x, bi, c, head, s, x_sb, x_ss, p, p0, L, BLOCK_P)
                dy_tile = load_rows_as_stored(dy, bi, c, head, s, dy_sb, dy_ss, p, p0, L, BLOCK_P)
                entering = _load_state(states, bi, c, head, heads, m, p, n, p0, n0, BLOCK_P, BLOCK_N)
                dstate = _load_state(dstates, bi, c, head, heads, m, p, n, p0, n0, BLOCK_P, BLOCK_N)
                dy_entering += dot(dy_tile, entering, PRECISION)
                x_dstate += dot(x_tile, dstate, PRECISION)
                state_grads += dstate.to(tl.float32) * entering.to(tl.float32)
            cum_c, last = _load_cum(cum, bi, c, head, heads, m, L)
            dC_tile += tl.exp(cum_c)[:, None] * dy_entering
            tl.store(dcum_earlier_parts + (tl.program_id(2) * tl.num_programs(0) * heads + (bi * heads + head) * m + c)
                     * L + tl.arange(0, L), tl.exp(cum_c) * tl.sum(C_tile.to(tl.float32) * dy_entering, 1))
            # xw dS_c = dt o (x dS_c) over the rows: no rounding of xw
            dB_tile += (tl.exp(last - cum_c) * _load_dt(dt, bi, c, head, s, heads, L))[:, None] * x_dstate
            tl.store(dlast_parts + ((bi * heads + head) * m + c) * tl.num_programs(2) + tl.program_id(2),
                     tl.exp(last) * tl.sum(tl.sum(state_grads, 1), 0))
        store_rows(dB, dB_tile, bi, c, group, s, dbc_sb, dbc_ss, n, n0, L, BLOCK_N)
        store_rows(dC, dC_tile, bi, c, group, s, dbc_sb, dbc_ss, n, n0, L, BLOCK_N)
