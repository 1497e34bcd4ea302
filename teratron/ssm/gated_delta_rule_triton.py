"""Gated DeltaNet's chunked gated delta rule (`gated_delta_rule_chunked` in teratron.ssm.gated_delta_rule:
read its docstring for the recurrence and shapes) as Triton kernels, forward and backward.
`gated_delta_rule_triton` returns what `gated_delta_rule_chunked` returns and autograd gives the same
gradients; it runs on CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1, the way the CPU tests
check the kernels' code).

Per chunk c of L tokens and head h, with G the running sum of the log gates g in the chunk, gamma =
exp(G), D_tj = exp(G_t - G_j) for j <= t (else 0), w_j = exp(G_L - G_j) (G_L the last entry), H the
state entering the chunk [dv, dk], H' the one leaving it and (x o y) the product by rows (x [L]):

    A    = strictly lower part of beta o (D * K K^T)       T = (I + A)^-1 (unit lower triangular)
    W    = T (beta gamma o K)        Ub = T (beta o V)      (WY form: no dependence on H)
    U    = Ub - W H^T = T rhs,  rhs = beta o (V - gamma o K H^T)
    O    = gamma o (Q H^T) + (D * Q K^T) U
    H'   = gamma_L H + U^T (w o K)

    forward, three kernels
      G, T, W, Ub    per (batch, chunk, head); T's 16 x 16 diagonal blocks by forward
                     substitution (all blocks at once, a row a step), the rest by products
                     (`_blocked_unit_lower_inverse`)                      (_chunk_solve_kernel)
      H_c, U         H_0 = initial, then the recurrence above, a loop over chunks per
                     (batch, head, STATE_ROWS rows of dv): those columns of U and rows of H'
                     need only those rows of H                            (_state_passing_kernel)
      O              per (batch, chunk, head), a block of dv at a time    (_chunk_output_kernel)

    backward: W, U and the H_c are recomputed from the saved G and T (the solve kernel reads T
    instead of solving: the forward's costliest step is not repeated); with dO the output's
    gradient and dH' the leaving state's (the final state's gradient for the last chunk),
      dU    = (D * Q K^T)^T dO + (w o K) dH'^T        drhs = T^T dU
      dH    = gamma_L dH' + (gamma o dO)^T Q - (beta gamma o drhs)^T K, backwards over chunks per
              (batch, head, STATE_ROWS rows of dv); d initial = dH_0 (_chunk_output_backward_kernel, then
                                                                 _state_passing_backward_kernel)
      then per (batch, chunk, head), from U = T rhs: dA = -(drhs U^T) (strictly lower), and
      dV    = beta o drhs
      dbeta = rowsum(drhs * (V - gamma o K H^T)) + rowsum(dA * D * K K^T)
      dQ    = gamma o (dO H) + P K,           P = D * (dO U^T)
      dK    = M K + M^T K + P^T Q - beta gamma o (drhs H) + w o (U dH'),   M = beta o (dA * D)
      dG    = rowsum(R) - colsum(R) for R = dA * A and for R = P * Q K^T (the D factors)
              + gamma o (rowsum(dO * Q H^T) - beta o rowsum(drhs * K H^T))  (gamma in O and rhs)
              - e, e = w o rowsum(U * K dH'^T);  dG_L += sum(e) + gamma_L <dH', H>   (w and gamma_L)
      dg    = reverse running sum of dG in the chunk                      (_chunk_backward_kernel)

Every sum accumulates in fp32. With 16-bit v the buffers the kernels pass each other (W, U, the
chunks' states H_c and their gradients dH') are kept in v's dtype, as flash-linear-attention keeps
them (half the memory traffic; drhs stays fp32, so that dV = beta o drhs is rounded once), and the
state passings round their products' fp32 operands (the state, U's and dH's steps) to that dtype.
Two 16-bit tiles of one dtype multiply as they are (exact products in the fp32 sums: q and k come
16-bit from GatedDeltaNet, which rounds them to v's dtype after their L2 norm and q's 1/sqrt(dk));
every other product runs on fp32 operands, on tensor cores in tf32 when v is bf16 or fp16 (T's
joining products in 3xTF32, fp32's accuracy) and in full fp32 ("ieee") when v is fp32, with every
buffer fp32: correct, but that variant's state passings spill several KiB of registers a thread on
sm_90 (fp32 FMA products), so it is slow. The chunk kernels tile dk and dv in blocks of at most
MAX_BLOCK and loop over them beside the [L, L] fp32 tiles; the two state passings keep a
[STATE_ROWS, dk] fp32 state tile (dk up to MAX_KEY_DIM) across the chunk loop.
"""

import os
from dataclasses import dataclass
from typing import Optional

import torch

from teratron.ssm.recurrence import start_log_decay

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path serves without Triton
    triton = None
if triton is not None:
    from teratron.ssm.triton_tiles import dot, load_tokens, load_tokens_as_stored, program_chunk, store_tokens
# Triton reads TRITON_INTERPRET when it defines the kernels (at import): then they run on CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Chunk sizes the kernels take (multiples of SOLVE_BLOCK).
CHUNK_SIZES = (16, 32, 64)
# T's diagonal blocks, inverted by forward substitution (a step a row); the blocks below them
# join by products (`_blocked_unit_lower_inverse`). Compiled kernels read globals only as
# constexprs; the interpreter takes the int.
SOLVE_BLOCK = tl.constexpr(16) if triton is not None and not INTERPRETED else 16
# Largest tile side over dk and dv in the chunk kernels (each loops over blocks of this), and lower caps
# for some kernels (by LAUNCH key): beside its accumulators and [L, L] tiles the per-chunk backward is
# fastest on tiles of 32, the output kernels on tiles of 64 (H100, 16-bit buffers: 1.36 vs 1.51 ms a
# call, and 0.35 vs 0.30 ms for the two output kernels; bench/RESULTS.md, session 25).
MAX_BLOCK = 64
KERNEL_BLOCKS = dict(backward=32)
# The state passings hold a [STATE_ROWS, dk] fp32 tile of the state and [L, dk] tiles of K, Q and W
# whole: rows of 16 kept ptxas's register spills for sm_90 (16-bit v, 8 warps before LAUNCH, chunk 64,
# dk 128) under 128 bytes a thread (32: 336), and all six kernels' shared memory within an H100's 227 KiB
# (tests/ssm/test_gated_delta_rule_triton.py compiles them).
MAX_KEY_DIM = 128
STATE_ROWS = 16
# (warps, software-pipelining stages) of each kernel at GatedDeltaNet's chunk of 64: the fastest of
# 2-16 warps x 1-4 stages, each kernel timed alone at 32 heads, dk = dv = 128, 1 x 8,192 bf16 tokens
# on an H200 (bench/scan_launch_sweep.py --scan rule; bench/RESULTS.md, session 17: 7.42 -> 5.14 ms
# of kernels per forward + backward); with the 16-bit buffers the forward state passing and the
# per-chunk backward take a third stage (H100, session 25: 3.66 -> 3.49 ms). The solve runs twice:
# solving (forward) and rebuilding W and U from the kept T (backward, `solved`). Chunks of 32 and
# less: 4 warps, Triton's default stages.
LAUNCH = dict(solve=(4, 3), solved=(2, 4), state_passing=(4, 3), output=(2, 4), output_backward=(2, 4),
              state_passing_backward=(4, 1), backward=(4, 3))


def gated_delta_rule_triton(q, k, v, g, beta, initial_state=None, chunk_size: int = 64, seq_idx=None):
    """`gated_delta_rule_chunked` by the Triton kernels (the module docstring): q, k [b, s, h, dk],
    v [b, s, h, dv], g and beta [b, s, h], initial_state [b, h, dv, dk] or None, seq_idx [b, s] int or
    None (packed documents: their first tokens' g take DOCUMENT_START_LOG_DECAY) -> (o [b, s, h, dv],
    final state [b, h, dv, dk]), both in v's dtype. chunk_size: 16, 32 or 64; dk at most 128."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"gated_delta_rule_triton: chunk_size {chunk_size} must be one of "
                         f"{', '.join(map(str, CHUNK_SIZES))} (the kernels' tile sizes; GatedDeltaNet uses 64)")
    if v.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"gated_delta_rule_triton: v is {v.dtype}; the kernels take float32, bfloat16 or "
                         "float16 (gated_delta_rule_chunked computes other dtypes)")
    if k.shape[-1] > MAX_KEY_DIM:
        raise ValueError(f"gated_delta_rule_triton: key head dim {k.shape[-1]} is over {MAX_KEY_DIM}, the "
                         "kernels' state tile (gated_delta_rule_chunked takes any)")
    if q.dtype != k.dtype or q.dtype not in SUPPORTED_DTYPES:  # Q K^T takes tiles of one dtype tl.dot takes
        q, k = q.float(), k.float()
    if seq_idx is not None:
        g = g.float() + start_log_decay(seq_idx)[..., None]
    o, final, *_ = _gated_delta_rule(q, k, v, g, beta, initial_state, chunk_size)
    return o, final


@dataclass(frozen=True)
class _Shape:
    """Sizes every kernel takes, and their tiles' padded sides."""
    batch: int
    seq: int
    heads: int
    key_dim: int    # dk
    value_dim: int  # dv
    chunk: int      # L
    chunks: int     # m

    @classmethod
    def of(cls, k, v, chunk_size):
        b, s, h, dk = k.shape
        return cls(b, s, h, dk, v.shape[-1], chunk_size, -(-s // chunk_size))

    def sizes(self):
        return dict(s=self.seq, heads=self.heads, m=self.chunks, dk=self.key_dim, dv=self.value_dim)

    def meta(self, dtype, kernel: str):
        """The tile sizes and launch configuration of `kernel` (a key of LAUNCH)."""
        return dict(L=self.chunk, BLOCK_K=self.block(self.key_dim, kernel),
                    BLOCK_V=self.block(self.value_dim, kernel), KEY_TILE=self.key_tile,
                    **self.launch(kernel),
                    # fp32 v needs "ieee" to match the PyTorch path to fp32 rounding; 16-bit v takes tf32
                    PRECISION="ieee" if dtype == torch.float32 else "tf32")

    def launch(self, kernel: str):
        if self.chunk <= 32:
            return dict(num_warps=4)
        warps, stages = LAUNCH[kernel]
        return dict(num_warps=warps, num_stages=stages)

    def state_meta(self, dtype, kernel: str):
        """`meta` for the two state passings, with their rows of the state."""
        return {**self.meta(dtype, kernel), "STATE_ROWS": STATE_ROWS}

    @staticmethod
    def block(width: int, kernel: str):
        """`kernel`'s tile side over dk or dv (`width`): 16 at least (tl.dot's smallest tile side), at
        most MAX_BLOCK and the kernel's KERNEL_BLOCKS cap."""
        return min(max(16, triton.next_power_of_2(width)), MAX_BLOCK, KERNEL_BLOCKS.get(kernel, MAX_BLOCK))

    @property
    def key_tile(self):  # dk whole, for the state passings
        return max(16, triton.next_power_of_2(self.key_dim))

    @property
    def state_grid(self):  # (batch, head, block of STATE_ROWS rows of the state)
        return self.batch, self.heads, triton.cdiv(self.value_dim, STATE_ROWS)


# The rule is a pair of custom ops (forward, backward) with autograd between them, so a layer compiled
# whole (`--torch-compile`) traces through it as one node (see teratron.ssm.ssd_triton).
@torch.library.custom_op("teratron::gated_delta_rule", mutates_args=())
def _gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: Optional[torch.Tensor],
                      chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, final state in v's dtype, and what the backward keeps: the chunks' cumulative gates and
    G and T (fp32, [b, m, h, L, L]: L / dv of U's size): the backward recomputes W, U and the
    entering states from them, not the solve (the costliest of the forward's kernels))."""
    shape = _Shape.of(k, v, chunk_size)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    cum, solve, u, states, final = _forward_states(k, v, g, beta, initial_state, shape)
    o = torch.empty_like(v)
    _chunk_output_kernel[(shape.batch * shape.chunks, shape.heads)](
        q, k, u, cum, states, o, **shape.sizes(), **shape.meta(v.dtype, "output"))
    return o, final.to(v.dtype), cum, solve


@_gated_delta_rule.register_fake
def _(q, k, v, g, beta, initial_state, chunk_size):
    shape = _Shape.of(k, v, chunk_size)
    b, h, m, L = shape.batch, shape.heads, shape.chunks, shape.chunk
    fp32 = dict(device=v.device, dtype=torch.float32)
    return (torch.empty_like(v, memory_format=torch.contiguous_format),
            v.new_empty(b, h, shape.value_dim, shape.key_dim),
            torch.empty(b, h, m * L, **fp32), torch.empty(b, m, h, L, L, **fp32))


def _setup_rule(ctx, inputs, output):
    q, k, v, g, beta, initial_state, chunk_size = inputs
    _, _, cum, solve = output
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cum, solve)
    ctx.chunk_size, ctx.has_initial = chunk_size, initial_state is not None


def _rule_autograd(ctx, do, dfinal, *unused):
    q, k, v, g, beta, initial_state, cum, solve = ctx.saved_tensors
    if do is None:  # only the final state used
        do = torch.zeros_like(v)
    if dfinal is None:
        dfinal = v.new_zeros(v.shape[0], v.shape[2], v.shape[3], k.shape[3])
    dq, dk, dv, dg, dbeta, dinitial = _gated_delta_rule_backward(do, dfinal, q, k, v, g, beta, initial_state, cum,
                                                                 solve, ctx.chunk_size)
    return dq, dk, dv, dg, dbeta, dinitial if ctx.has_initial else None, None


@torch.library.custom_op("teratron::gated_delta_rule_backward", mutates_args=())
def _gated_delta_rule_backward(do: torch.Tensor, dfinal: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               initial_state: Optional[torch.Tensor], cum: torch.Tensor, solve: torch.Tensor,
                               chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v, g, beta and the initial state (the last unused without one)."""
    shape = _Shape.of(k, v, chunk_size)
    b, h, m = shape.batch, shape.heads, shape.chunks
    q, k, v, g, beta, do = (t.contiguous() for t in (q, k, v, g, beta, do))
    cum, solve, u, states, _ = _forward_states(k, v, g, beta, initial_state, shape, solved=(cum, solve))
    # (D * Q K^T)^T dO, then drhs in place: fp32, as dV = beta o drhs is rounded once, to dV's dtype
    drhs = torch.empty(u.shape, device=u.device, dtype=torch.float32)
    _chunk_output_backward_kernel[(b * m, h)](
        q, k, do, cum, drhs, **shape.sizes(), **shape.meta(v.dtype, "output_backward"))
    dstates = torch.empty_like(states)
    dinitial = torch.empty(b, h, shape.value_dim, shape.key_dim, device=v.device, dtype=torch.float32)
    _state_passing_backward_kernel[shape.state_grid](
        q, k, beta, do, cum, solve, drhs, dstates, dfinal.float().contiguous(), dinitial, **shape.sizes(),
        **shape.state_meta(v.dtype, "state_passing_backward"))
    dq, dk, dv, dg, dbeta = (torch.empty_like(t) for t in (q, k, v, g, beta))
    _chunk_backward_kernel[(b * m, h)](
        q, k, v, beta, do, cum, u, states, dstates, drhs, dq, dk, dv, dg, dbeta, **shape.sizes(),
        **shape.meta(v.dtype, "backward"))
    return dq, dk, dv, dg, dbeta, dinitial.to(initial_state.dtype if initial_state is not None else torch.float32)


@_gated_delta_rule_backward.register_fake
def _(do, dfinal, q, k, v, g, beta, initial_state, cum, solve, chunk_size):
    grads = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, g, beta))
    dinitial = dfinal.new_empty(dfinal.shape, dtype=initial_state.dtype if initial_state is not None else torch.float32)
    return (*grads, dinitial)


_gated_delta_rule.register_autograd(_rule_autograd, setup_context=_setup_rule)


def _forward_states(k, v, g, beta, initial_state, shape, solved=None):
    """G [b, h, m * L] and T [b, m, h, L, L] (fp32), U [b, m, h, L, dv] and the states entering each
    chunk [b, m, h, dv, dk] (v's dtype: 16-bit or fp32), and the final state [b, h, dv, dk] (fp32). `solved`:
    (G, T) of an earlier call on the same inputs, taken instead of solving again."""
    b, h, m, L, dk, dv = shape.batch, shape.heads, shape.chunks, shape.chunk, shape.key_dim, shape.value_dim
    fp32 = dict(device=v.device, dtype=torch.float32)
    buffers = dict(device=v.device, dtype=v.dtype)  # one of SUPPORTED_DTYPES
    if solved is None:
        cum, solve = torch.empty(b, h, m * L, **fp32), torch.empty(b, m, h, L, L, **fp32)
    else:
        cum, solve = solved
    w = torch.empty(b, m, h, L, dk, **buffers)
    u = torch.empty(b, m, h, L, dv, **buffers)  # Ub, then U in place
    _chunk_solve_kernel[(b * m, h)](k, v, g, beta, cum, solve, w, u, **shape.sizes(), SOLVED=solved is not None,
                                    **shape.meta(v.dtype, "solve" if solved is None else "solved"))
    states = torch.empty(b, m, h, dv, dk, **buffers)
    final = torch.empty(b, h, dv, dk, **fp32)
    initial = initial_state.float().contiguous() if initial_state is not None else final  # unused without
    _state_passing_kernel[shape.state_grid](
        k, w, u, cum, states, initial, final, **shape.sizes(), HAS_INITIAL=initial_state is not None,
        **shape.state_meta(v.dtype, "state_passing"))
    return cum, solve, u, states, final


if triton is not None:
    @triton.jit
    def _token_scalars_offsets(bi, c, head, s, heads, L: tl.constexpr):
        t = c * L + tl.arange(0, L)
        return (bi * s + t) * heads + head, t < s

    @triton.jit
    def _load_scalars(ptr, bi, c, head, s, heads, L: tl.constexpr):
        """[L] fp32: chunk c's entries of a [b, s, h] tensor (g or beta) at (bi, head), 0 past the end
        (no decay, no update)."""
        offsets, mask = _token_scalars_offsets(bi, c, head, s, heads, L)
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _chunk_tile_offsets(bi, c, head, heads, m, width, first, L: tl.constexpr, WIDTH: tl.constexpr):
        """Offsets and mask of an [L, WIDTH] tile of a [b, m, h, L, width] buffer at chunk c."""
        rows = tl.arange(0, L)
        lanes = first + tl.arange(0, WIDTH)
        offsets = ((bi * m + c) * heads + head) * L * width + rows[:, None] * width + lanes[None, :]
        return offsets, (rows[:, None] < L) & (lanes[None, :] < width)

    @triton.jit
    def _load_chunk_tile(ptr, bi, c, head, heads, m, width, first, L: tl.constexpr, WIDTH: tl.constexpr):
        offsets, mask = _chunk_tile_offsets(bi, c, head, heads, m, width, first, L, WIDTH)
        return tl.load(ptr + offsets, mask=mask, other=0.0)

    @triton.jit
    def _store_chunk_tile(ptr, tile, bi, c, head, heads, m, width, first, L: tl.constexpr, WIDTH: tl.constexpr):
        offsets, mask = _chunk_tile_offsets(bi, c, head, heads, m, width, first, L, WIDTH)
        tl.store(ptr + offsets, tile.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _state_offsets(bi, c, head, heads, m, dk, dv, v0, k0, ROWS: tl.constexpr, LANES: tl.constexpr):
        """Offsets and mask of the [ROWS, LANES] tile at (v0, k0) of chunk c's state in [b, m, h, dv, dk]
        (c = 0, m = 1 for a [b, h, dv, dk] state)."""
        rows = v0 + tl.arange(0, ROWS)
        lanes = k0 + tl.arange(0, LANES)
        offsets = ((bi * m + c) * heads + head) * dv * dk + rows[:, None] * dk + lanes[None, :]
        return offsets, (rows[:, None] < dv) & (lanes[None, :] < dk)

    @triton.jit
    def _load_state(ptr, bi, c, head, heads, m, dk, dv, v0, k0, ROWS: tl.constexpr, LANES: tl.constexpr):
        offsets, mask = _state_offsets(bi, c, head, heads, m, dk, dv, v0, k0, ROWS, LANES)
        return tl.load(ptr + offsets, mask=mask, other=0.0)

    @triton.jit
    def _store_state(ptr, tile, bi, c, head, heads, m, dk, dv, v0, k0, ROWS: tl.constexpr, LANES: tl.constexpr):
        offsets, mask = _state_offsets(bi, c, head, heads, m, dk, dv, v0, k0, ROWS, LANES)
        tl.store(ptr + offsets, tile.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _load_cum(cum, bi, c, head, heads, m, L: tl.constexpr):
        """[L] running sums G of the log gates in chunk c, and the last (the whole chunk's)."""
        row = cum + ((bi * heads + head) * m + c) * L
        return tl.load(row + tl.arange(0, L)), tl.load(row + L - 1)

    @triton.jit
    def _load_solve(solve, bi, c, head, heads, m, L: tl.constexpr):
        """[L, L] T of chunk c at (bi, head) from the [b, m, h, L, L] buffer."""
        rows = tl.arange(0, L)
        return tl.load(solve + ((bi * m + c) * heads + head) * L * L + rows[:, None] * L + rows[None, :])

    @triton.jit
    def _decay(cum, STRICT: tl.constexpr, L: tl.constexpr):
        """[L, L]: exp(G_t - G_j) for j <= t (j < t if STRICT), else 0 (masked before exp: no overflow)."""
        rows = tl.arange(0, L)
        if STRICT:
            kept = rows[:, None] > rows[None, :]
        else:
            kept = rows[:, None] >= rows[None, :]
        return tl.exp(tl.where(kept, cum[:, None] - cum[None, :], float("-inf")))

    @triton.jit
    def _products(x, y, bi, c, head, s, heads, dk, L: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
        """[L, L]: X Y^T over dk, of two [b, s, h, dk] tensors of one dtype in chunk c. 16-bit tiles
        multiply as they are: their products are exact in the fp32 sums (as tf32's of the same values)."""
        out = tl.zeros([L, L], tl.float32)
        for k0 in range(0, dk, BLOCK_K):
            x_tile = load_tokens_as_stored(x, bi, c, head, s, heads, dk, k0, L, BLOCK_K)
            y_tile = load_tokens_as_stored(y, bi, c, head, s, heads, dk, k0, L, BLOCK_K)
            out += dot(x_tile, tl.trans(y_tile), PRECISION)
        return out

    @triton.jit
    def _diagonal_block_inverses(tile, L: tl.constexpr):
        """The [L, L] strictly lower a in `tile` -> the offsets of its L / SOLVE_BLOCK diagonal blocks
        a_r and (I + a_r)^-1 [blocks, SOLVE_BLOCK, SOLVE_BLOCK]: all blocks at once by forward
        substitution, row t = e_t - sum_{j < t} a_r[t, j] (row j), SOLVE_BLOCK - 1 steps (a_r's row t read
        from `tile`, not picked out of a register tile by a masked sum)."""
        r = tl.arange(0, L // SOLVE_BLOCK)[:, None, None]
        i = tl.arange(0, SOLVE_BLOCK)
        rows, lanes = i[None, :, None], i[None, None, :]
        offsets = (r * SOLVE_BLOCK + rows) * L + r * SOLVE_BLOCK + lanes
        inverse = tl.where(rows == lanes, 1.0, 0.0) + tl.zeros([L // SOLVE_BLOCK, SOLVE_BLOCK, SOLVE_BLOCK], tl.float32)
        first = tl.arange(0, L // SOLVE_BLOCK)[:, None] * SOLVE_BLOCK  # [blocks, 1]: each block's first row and lane
        for t in range(1, SOLVE_BLOCK):
            a_row = tl.load(tile + (first + t) * L + first + i[None, :])  # [blocks, SOLVE_BLOCK] over j
            row = tl.where(i[None, :] == t, 1.0, 0.0) - tl.sum(a_row[:, :, None] * inverse, 1)
            inverse = tl.where(rows == t, row[:, None, :], inverse)
        return offsets, inverse

    @triton.jit
    def _accurate_dot(x, y, PRECISION: tl.constexpr):
        """x y with fp32 accuracy: 3xTF32 on tensor cores where the kernels take tf32 products, for
        the solve (T's error would otherwise pass the inputs' rounding)."""
        if PRECISION == "tf32":
            return tl.dot(x, y, input_precision="tf32x3")
        return tl.dot(x, y, input_precision=PRECISION)

    @triton.jit
    def _blocked_unit_lower_inverse(a, tile, L: tl.constexpr, PRECISION: tl.constexpr):
        """(I + a)^-1 for a strictly lower [L, L], through `tile` (this program's [L, L] fp32 scratch,
        where the result is left): the diagonal [SOLVE_BLOCK, SOLVE_BLOCK] blocks D = I + a_diag
        inverted by substitution (`_diagonal_block_inverses`), then (I + a)^-1 = (I + N)^-1 D^-1 with N = D^-1 a_off strictly
        block-lower (N^(L / SOLVE_BLOCK) = 0): (I + N)^-1 = I - N + N^2 - ..., by Horner."""
        rows = tl.arange(0, L)
        offsets = rows[:, None] * L + rows[None, :]
        tl.store(tile + offsets, a)
        tl.debug_barrier()  # the block loads below read what other threads stored
        blocks, block_inverses = _diagonal_block_inverses(tile, L)
        tl.store(tile + blocks, block_inverses)
        tl.debug_barrier()
        both = tl.load(tile + offsets)  # D^-1 on the diagonal blocks, a below them
        same_block = rows[:, None] // SOLVE_BLOCK == rows[None, :] // SOLVE_BLOCK
        diagonal_inverse = tl.where(same_block, both, 0.0)
        inverse = diagonal_inverse
        if L > SOLVE_BLOCK:
            identity = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
            n = _accurate_dot(diagonal_inverse, tl.where(same_block, 0.0, both), PRECISION)
            series = identity - n
            for _ in tl.static_range(L // SOLVE_BLOCK - 2):
                series = identity - _accurate_dot(n, series, PRECISION)
            inverse = _accurate_dot(series, diagonal_inverse, PRECISION)
        tl.store(tile + offsets, inverse)
        return inverse

    @triton.jit
    def _chunk_solve_kernel(k, v, g, beta, cum, solve, w, u, s, heads, m, dk, dv, SOLVED: tl.constexpr,
                            L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, KEY_TILE: tl.constexpr,
                            PRECISION: tl.constexpr):
        """Program (bi * m + c, head): G, T = (I + A)^-1 (read from cum and solve if SOLVED),
        W = T (beta gamma o K), Ub = T (beta o V)."""
        bi, c, head = program_chunk(m)
        beta_c = _load_scalars(beta, bi, c, head, s, heads, L)
        if SOLVED:
            G, _ = _load_cum(cum, bi, c, head, heads, m, L)
            inverse = _load_solve(solve, bi, c, head, heads, m, L)
        else:
            G = tl.cumsum(_load_scalars(g, bi, c, head, s, heads, L), 0)
            tl.store(cum + ((bi * heads + head) * m + c) * L + tl.arange(0, L), G)
            a = (beta_c[:, None] * _decay(G, True, L)
                 * _products(k, k, bi, c, head, s, heads, dk, L, BLOCK_K, PRECISION))
            inverse = _blocked_unit_lower_inverse(a, solve + ((bi * m + c) * heads + head) * L * L, L, PRECISION)
        key_weight = beta_c * tl.exp(G)
        for k0 in range(0, dk, BLOCK_K):
            k_tile = load_tokens(k, bi, c, head, s, heads, dk, k0, L, BLOCK_K) * key_weight[:, None]
            _store_chunk_tile(w, tl.dot(inverse, k_tile, input_precision=PRECISION), bi, c, head, heads, m, dk, k0,
                              L, BLOCK_K)
        for v0 in range(0, dv, BLOCK_V):
            v_tile = load_tokens(v, bi, c, head, s, heads, dv, v0, L, BLOCK_V) * beta_c[:, None]
            _store_chunk_tile(u, tl.dot(inverse, v_tile, input_precision=PRECISION), bi, c, head, heads, m, dv, v0,
                              L, BLOCK_V)

    @triton.jit
    def _state_passing_kernel(k, w, u, cum, states, initial, final, s, heads, m, dk, dv, HAS_INITIAL: tl.constexpr,
                              L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                              KEY_TILE: tl.constexpr, STATE_ROWS: tl.constexpr, PRECISION: tl.constexpr):
        """Program (bi, head, k): rows v0 .. v0 + STATE_ROWS - 1 of the state, over the chunks in order:
        stores H_c, replaces Ub by U = Ub - W H_c^T and steps H_{c+1} = gamma_L H_c + U^T (w o K). The
        products take their operands in the buffers' dtype (16-bit with 16-bit v), the sums stay fp32."""
        operand = w.dtype.element_ty
        bi = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        v0 = tl.program_id(2) * STATE_ROWS
        if HAS_INITIAL:
            state = _load_state(initial, bi, 0, head, heads, 1, dk, dv, v0, 0, STATE_ROWS, KEY_TILE)
        else:
            state = tl.zeros([STATE_ROWS, KEY_TILE], tl.float32)
        for c in range(m):
            _store_state(states, state, bi, c, head, heads, m, dk, dv, v0, 0, STATE_ROWS, KEY_TILE)
            k_tile = load_tokens(k, bi, c, head, s, heads, dk, 0, L, KEY_TILE)
            w_tile = _load_chunk_tile(w, bi, c, head, heads, m, dk, 0, L, KEY_TILE)
            u_tile = (_load_chunk_tile(u, bi, c, head, heads, m, dv, v0, L, STATE_ROWS).to(tl.float32)
                      - dot(w_tile, tl.trans(state).to(operand), PRECISION))
            _store_chunk_tile(u, u_tile, bi, c, head, heads, m, dv, v0, L, STATE_ROWS)
            G, last = _load_cum(cum, bi, c, head, heads, m, L)
            to_end = tl.exp(last - G)
            state = tl.exp(last) * state + dot(tl.trans(u_tile * to_end[:, None]).to(operand), k_tile.to(operand),
                                                PRECISION)
        _store_state(final, state, bi, 0, head, heads, 1, dk, dv, v0, 0, STATE_ROWS, KEY_TILE)

    @triton.jit
    def _chunk_output_kernel(q, k, u, cum, states, o, s, heads, m, dk, dv, L: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_V: tl.constexpr, KEY_TILE: tl.constexpr, PRECISION: tl.constexpr):
        """Program (bi * m + c, head): O of chunk c, gamma o (Q H^T) + (D * Q K^T) U, a block of dv at
        a time (D * Q K^T computed once for them all)."""
        bi, c, head = program_chunk(m)
        G, _ = _load_cum(cum, bi, c, head, heads, m, L)
        scores = _products(q, k, bi, c, head, s, heads, dk, L, BLOCK_K, PRECISION) * _decay(G, False, L)
        for v0 in range(0, dv, BLOCK_V):
            earlier = tl.zeros([L, BLOCK_V], tl.float32)
            for k0 in range(0, dk, BLOCK_K):
                q_tile = load_tokens_as_stored(q, bi, c, head, s, heads, dk, k0, L, BLOCK_K)
                entering = _load_state(states, bi, c, head, heads, m, dk, dv, v0, k0, BLOCK_V, BLOCK_K)
                earlier += dot(q_tile, tl.trans(entering), PRECISION)
            u_tile = _load_chunk_tile(u, bi, c, head, heads, m, dv, v0, L, BLOCK_V)
            out = tl.exp(G)[:, None] * earlier + dot(scores, u_tile, PRECISION)
            store_tokens(o, out, bi, c, head, s, heads, dv, v0, L, BLOCK_V)

    @triton.jit
    def _chunk_output_backward_kernel(q, k, do, cum, du, s, heads, m, dk, dv, L: tl.constexpr, BLOCK_K: tl.constexpr,
                                      BLOCK_V: tl.constexpr, KEY_TILE: tl.constexpr, PRECISION: tl.constexpr):
        """Program (bi * m + c, head): O's pull on U in chunk c, (D * Q K^T)^T dO, a block of dv at a time."""
        bi, c, head = program_chunk(m)
        G, _ = _load_cum(cum, bi, c, head, heads, m, L)
        scores = _products(q, k, bi, c, head, s, heads, dk, L, BLOCK_K, PRECISION) * _decay(G, False, L)
        for v0 in range(0, dv, BLOCK_V):
            do_tile = load_tokens(do, bi, c, head, s, heads, dv, v0, L, BLOCK_V)
            _store_chunk_tile(du, tl.dot(tl.trans(scores), do_tile, input_precision=PRECISION), bi, c, head, heads,
                              m, dv, v0, L, BLOCK_V)

    @triton.jit
    def _state_passing_backward_kernel(q, k, beta, do, cum, solve, drhs, dstates, dfinal, dinitial, s, heads, m, dk,
                                       dv, L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                                       KEY_TILE: tl.constexpr, STATE_ROWS: tl.constexpr, PRECISION: tl.constexpr):
        """Program (bi, head, k): rows v0 .. of the state's gradient, the chunks in reverse: stores dH'
        (the leaving state's gradient) of each chunk, completes dU with (w o K) dH'^T, replaces it by
        drhs = T^T dU, and steps dH = gamma_L dH' + (gamma o dO)^T Q - (beta gamma o drhs)^T K (the
        products of dH and its steps on operands in dH's buffer dtype, as the forward's)."""
        operand = dstates.dtype.element_ty
        bi = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        v0 = tl.program_id(2) * STATE_ROWS
        dstate = _load_state(dfinal, bi, 0, head, heads, 1, dk, dv, v0, 0, STATE_ROWS, KEY_TILE)
        for i in range(m):
            c = m - 1 - i
            _store_state(dstates, dstate, bi, c, head, heads, m, dk, dv, v0, 0, STATE_ROWS, KEY_TILE)
            G, last = _load_cum(cum, bi, c, head, heads, m, L)
            gamma = tl.exp(G)
            k_tile = load_tokens(k, bi, c, head, s, heads, dk, 0, L, KEY_TILE)
            q_tile = load_tokens(q, bi, c, head, s, heads, dk, 0, L, KEY_TILE)
            du = (_load_chunk_tile(drhs, bi, c, head, heads, m, dv, v0, L, STATE_ROWS)
                  + dot((k_tile * tl.exp(last - G)[:, None]).to(operand), tl.trans(dstate).to(operand), PRECISION))
            inverse = _load_solve(solve, bi, c, head, heads, m, L)
            drhs_tile = tl.dot(tl.trans(inverse), du, input_precision=PRECISION)
            _store_chunk_tile(drhs, drhs_tile, bi, c, head, heads, m, dv, v0, L, STATE_ROWS)
            do_tile = load_tokens(do, bi, c, head, s, heads, dv, v0, L, STATE_ROWS)
            key_weight = _load_scalars(beta, bi, c, head, s, heads, L) * gamma
            dstate = (tl.exp(last) * dstate
                      + dot(tl.trans(do_tile * gamma[:, None]).to(operand), q_tile.to(operand), PRECISION)
                      - dot(tl.trans(drhs_tile * key_weight[:, None]).to(operand), k_tile.to(operand), PRECISION))
        _store_state(dinitial, dstate, bi, 0, head, heads, 1, dk, dv, v0, 0, STATE_ROWS, KEY_TILE)

    @triton.jit
    def _chunk_backward_kernel(q, k, v, beta, do, cum, u, states, dstates, drhs, dq, dk_out, dv_out, dg, dbeta, s,
                               heads, m, dk, dv, L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                               KEY_TILE: tl.constexpr, PRECISION: tl.constexpr):
        """Program (bi * m + c, head): dQ, dK, dV, dg and dbeta of chunk c (the module docstring). The
        states enter dg and dbeta only through row sums that the dQ and dK products already hold:
        rowsum(dO * Q H^T) = rowsum(Q * dO H), rowsum(drhs * K H^T) = rowsum(K * drhs H) and
        rowsum(U * K dH'^T) = rowsum(K * U dH'), so the states are read in one pass, per block of dk."""
        bi, c, head = program_chunk(m)
        G, last = _load_cum(cum, bi, c, head, heads, m, L)
        gamma = tl.exp(G)
        to_end = tl.exp(last - G)
        beta_c = _load_scalars(beta, bi, c, head, s, heads, L)

        # Sums over dv without the states: dO U^T and drhs U^T [L, L], rowsum(drhs * V); and dV.
        do_u = tl.zeros([L, L], tl.float32)
        drhs_u = tl.zeros([L, L], tl.float32)
        dbeta_c = tl.zeros([L], tl.float32)
        for v0 in range(0, dv, BLOCK_V):
            drhs_tile = _load_chunk_tile(drhs, bi, c, head, heads, m, dv, v0, L, BLOCK_V)
            u_tile = _load_chunk_tile(u, bi, c, head, heads, m, dv, v0, L, BLOCK_V)
            do_tile = load_tokens_as_stored(do, bi, c, head, s, heads, dv, v0, L, BLOCK_V)
            v_tile = load_tokens(v, bi, c, head, s, heads, dv, v0, L, BLOCK_V)
            store_tokens(dv_out, beta_c[:, None] * drhs_tile, bi, c, head, s, heads, dv, v0, L, BLOCK_V)
            dbeta_c += tl.sum(drhs_tile * v_tile, 1)
            do_u += dot(do_tile, tl.trans(u_tile), PRECISION)
            drhs_u += dot(drhs_tile, tl.trans(u_tile), PRECISION)

        # The [L, L] terms, one product of the chunk's keys at a time.
        key_keys = _products(k, k, bi, c, head, s, heads, dk, L, BLOCK_K, PRECISION)
        d_a = -drhs_u * _decay(G, True, L)  # dA * D (dA strictly lower)
        dbeta_c += tl.sum(d_a * key_keys, 1)
        key_pairs = beta_c[:, None] * d_a  # M = d(K K^T)
        pair_grads = key_pairs * key_keys  # dA * A
        dG = tl.sum(pair_grads, 1) - tl.sum(pair_grads, 0)
        out_pairs = do_u * _decay(G, False, L)  # P = d(Q K^T)
        pair_grads = out_pairs * _products(q, k, bi, c, head, s, heads, dk, L, BLOCK_K, PRECISION)
        dG += tl.sum(pair_grads, 1) - tl.sum(pair_grads, 0)

        # Per block of dk: dO H, drhs H and U dH' (sums over dv), then dQ, dK and the states' row sums.
        key_weight = beta_c * gamma
        pull_to_end = tl.zeros([L], tl.float32)  # rowsum(K * U dH') = rowsum(U * K dH'^T)
        dstate_state = tl.sum(tl.zeros([L], tl.float32), 0)  # <dH', H>
        for k0 in range(0, dk, BLOCK_K):
            k_tile = load_tokens(k, bi, c, head, s, heads, dk, k0, L, BLOCK_K)
            q_tile = load_tokens(q, bi, c, head, s, heads, dk, k0, L, BLOCK_K)
            do_entering = tl.zeros([L, BLOCK_K], tl.float32)
            drhs_entering = tl.zeros([L, BLOCK_K], tl.float32)
            u_dleaving = tl.zeros([L, BLOCK_K], tl.float32)
            for v0 in range(0, dv, BLOCK_V):
                drhs_tile = _load_chunk_tile(drhs, bi, c, head, heads, m, dv, v0, L, BLOCK_V)
                u_tile = _load_chunk_tile(u, bi, c, head, heads, m, dv, v0, L, BLOCK_V)
                do_tile = load_tokens_as_stored(do, bi, c, head, s, heads, dv, v0, L, BLOCK_V)
                entering = _load_state(states, bi, c, head, heads, m, dk, dv, v0, k0, BLOCK_V, BLOCK_K)
                dleaving = _load_state(dstates, bi, c, head, heads, m, dk, dv, v0, k0, BLOCK_V, BLOCK_K)
                do_entering += dot(do_tile, entering, PRECISION)
                drhs_entering += dot(drhs_tile, entering, PRECISION)
                u_dleaving += dot(u_tile, dleaving, PRECISION)
                dstate_state += tl.sum(tl.sum(entering.to(tl.float32) * dleaving.to(tl.float32), 1), 0)
            keys_drhs_entering = tl.sum(k_tile * drhs_entering, 1)  # this block's part of rowsum(drhs * K H^T)
            dbeta_c -= gamma * keys_drhs_entering
            dG += gamma * tl.sum(q_tile * do_entering, 1) - key_weight * keys_drhs_entering
            pull_to_end += tl.sum(k_tile * u_dleaving, 1)
            dq_tile = gamma[:, None] * do_entering + tl.dot(out_pairs, k_tile, input_precision=PRECISION)
            dk_tile = (tl.dot(key_pairs, k_tile, input_precision=PRECISION)
                       + tl.dot(tl.trans(key_pairs), k_tile, input_precision=PRECISION)
                       + tl.dot(tl.trans(out_pairs), q_tile, input_precision=PRECISION)
                       - key_weight[:, None] * drhs_entering + to_end[:, None] * u_dleaving)
            store_tokens(dq, dq_tile, bi, c, head, s, heads, dk, k0, L, BLOCK_K)
            store_tokens(dk_out, dk_tile, bi, c, head, s, heads, dk, k0, L, BLOCK_K)

        ends = to_end * pull_to_end
        dG -= ends
        dG += tl.where(tl.arange(0, L) == L - 1, tl.sum(ends, 0) + tl.exp(last) * dstate_state, 0.0)
        offsets, mask = _token_scalars_offsets(bi, c, head, s, heads, L)
        tl.store(dg + offsets, tl.cumsum(dG, 0, reverse=True).to(dg.dtype.element_ty), mask=mask)
        tl.store(dbeta + offsets, dbeta_c.to(dbeta.dtype.element_ty), mask=mask)
