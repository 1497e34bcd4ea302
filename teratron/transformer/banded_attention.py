"""Causal sliding-window attention on the dense causal kernels, merged by log-sum-exp.

A causal window (W, 0) (Megatron's meaning) lets query i see keys i - W .. i. Cut the sequence
into chunks of C = W tokens (the end padded to a multiple of C; C = s when W >= s, one chunk).
Query row r of chunk i then sees

- key rows r' <= r of its own chunk: a square causal block, and
- key rows r' >= r of chunk i - 1 (distance C + r - r' <= W, exactly W included): the transpose
  of a causal block. Reversing the row order of both the queries and the keys of the chunk pair
  (row r -> C - 1 - r, a flip along the sequence dim) turns r' >= r into r' <= r: a plain causal
  block again.

So both blocks run on the dense causal kernel (aten's flash kernel for the CPU, returning the
log-sum-exp), batched over the chunks; chunk 0 has no previous chunk. Nothing of size s x s
exists, and the kernels do 2 x C^2 / 2 score entries per chunk, about the W + 1 keys each query
sees. Padded keys sit after every real query, so causality hides them; padded query rows are
dropped.

Layout: the layer's [b, n, s, h] (a view of [s, b, n, h]) is viewed as chunk rows [m, C, b * n, h]
(batch folded into the heads, so no copy when the sequence is a multiple of C); a kernel sees
their transpose [m, b * n, C, h], m chunks as its batch. The two blocks' (out, L) merge per query
row by log-sum-exp, and an attention sink (softmax_type) is one more term, as under context
parallelism (`context_parallel.merge_by_lse`, `apply_sink`). Backward is explicit: it keeps q, k,
v, the merged output and L, and each block's gradients come from the dense kernel's backward
given the final output and L (the flash identity dS = P (dP - rowsum(dO * O)), P = exp(S - L)),
the reversed block's inputs and gradients flipped like its forward's; the sink's gradient as
context parallelism computes it.

Core attention runs this on the CPU only, where it spares a windowed layer the reference's s x s
scores. On CUDA a causal window runs cuDNN's native band (`cudnn_window_attention`) or
FlexAttention: measured on an H200 (seq 16,384, window 1,024; bench/RESULTS.md) this path took
0.386 of full causal attention's time against FlexAttention's 0.259, its dense kernels alone
0.205 and the row flips 0.67 ms, so it cannot reach issue 20's 1/6.
"""

import torch
import torch.nn.functional as F

from teratron.transformer.context_parallel import apply_sink, flash_backward, flash_forward, merge_by_lse, sink_grad

# Narrower windows make chunks too small for the dense kernel to pay off: they keep the reference.
MIN_WINDOW = 256


def runs_banded(window, causal: bool, dropout_p: float, q, k, v, reference: bool) -> bool:
    """Whether a layer's attention (q [b, n, sq, h], k and v [b, g, sk, h]) runs banded: on the
    CPU, self-attention (sq = sk) under a causal window of at least MIN_WINDOW keys (the right
    side is hidden by causality), no dropout, not the reference backend."""
    return (not q.is_cuda and not reference and window is not None and causal and window[0] >= MIN_WINDOW
            and dropout_p == 0 and q.shape[2] == k.shape[2])


def banded_attention(q, k, v, window: int, scale: float, sink=None):
    """q [b, n, s, hq], k [b, g, s, hq], v [b, g, s, hv]; each query sees itself and the `window`
    keys before it; sink: logits [n] or None -> [b, n, s, hv] (q's dtype)."""
    return _BandedAttention.apply(q, k, v, sink, min(window, q.shape[2]), scale)


def _to_chunks(t, size: int):
    """[b, n, s, h] -> chunk rows [m, size, b * n, h], the end zero-padded to m * size tokens."""
    b, n, s, h = t.shape
    rows = t.permute(2, 0, 1, 3)  # [s, b, n, h]
    padding = -s % size
    if padding:
        rows = F.pad(rows, (0, 0, 0, 0, 0, 0, 0, padding))
    return rows.reshape(-1, size, b * n, h)


def _from_chunks(rows, b: int, s: int):
    """Chunk rows [m, C, b * n, h] -> [b, n, s, h], padded rows dropped."""
    m, size, heads, h = rows.shape
    return rows.reshape(m * size, b, heads // b, h)[:s].permute(1, 2, 0, 3)


def _reversed(rows):
    """Chunk rows [m, C, heads, h] with each chunk's rows in reverse order: the previous-chunk
    block's inputs (queries of chunks 1.., keys and values of chunks ..m-2) and outputs."""
    return rows.flip(1)


def _kernel(rows):
    """Chunk rows [m, C, heads, h] as a kernel's [m, heads, C, h] (and back: the same transpose)."""
    return rows.transpose(1, 2)


def _merge(out_own, lse_own, out_previous, lse_previous, sink):
    """The two blocks' results, chunk rows (out [m, C, b * n, hv] q's dtype, L [m, C, b * n] fp32;
    the previous-chunk block's of chunks 1.., rows reversed), merged per query row and with the
    sink logits [b * n] (or None) -> (out q's dtype, L fp32), chunk rows."""
    out, lse = out_own.float(), lse_own
    if out_previous is not None:
        later, later_lse = merge_by_lse(out[1:], lse[1:], _reversed(out_previous).float(), _reversed(lse_previous))
        out, lse = torch.cat([out[:1], later]), torch.cat([lse[:1], later_lse])
    out, lse = apply_sink(_kernel(out), _kernel(lse), sink)  # per head: the heads' dim as apply_sink has it
    return _kernel(out).to(out_own.dtype), _kernel(lse)


def _add_previous(grad_own, grad_previous, queries: bool, dtype):
    """A gradient [m, C, heads, h] of chunk rows in `dtype`: the own-chunk block's plus the
    previous-chunk block's (rows reversed), which covers chunks 1.. for queries, chunks ..m-2 for
    keys and values (summed in fp32)."""
    if grad_previous is None:
        return grad_own.to(dtype)
    chunks = (1, 0) if queries else (0, 1)
    return (grad_own.float() + F.pad(_reversed(grad_previous).float(), (0, 0, 0, 0, 0, 0, *chunks))).to(dtype)


class _BandedAttention(torch.autograd.Function):
    """`banded_attention`; explicit backward (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, size, scale):
        b, s = q.shape[0], q.shape[2]
        qr, kr, vr = (_to_chunks(t, size) for t in (q, k, v))
        out_own, lse_own = flash_forward(_kernel(qr), _kernel(kr), _kernel(vr), True, scale)
        out_previous = lse_previous = None
        if qr.shape[0] > 1:
            out_previous, lse_previous = flash_forward(_kernel(_reversed(qr[1:])), _kernel(_reversed(kr[:-1])),
                                                       _kernel(_reversed(vr[:-1])), True, scale)
            out_previous, lse_previous = _kernel(out_previous), _kernel(lse_previous)
        heads_sink = None if sink is None else sink.repeat(b)  # the sink of every (sample, head)
        out, lse = _merge(_kernel(out_own), _kernel(lse_own), out_previous, lse_previous, heads_sink)
        ctx.size, ctx.scale = size, scale
        ctx.save_for_backward(q, k, v, sink, out, lse)
        return _from_chunks(out, b, s)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sink, out, lse = ctx.saved_tensors
        b, s, size = q.shape[0], q.shape[2], ctx.size
        qr, kr, vr, doutr = (_to_chunks(t, size) for t in (q, k, v, dout))

        def block_grads(dout_rows, q_rows, k_rows, v_rows, out_rows, lse_rows):
            grads = flash_backward(_kernel(dout_rows), _kernel(q_rows), _kernel(k_rows), _kernel(v_rows),
                                   _kernel(out_rows), _kernel(lse_rows), True, ctx.scale)
            return [_kernel(g) for g in grads]

        own = block_grads(doutr, qr, kr, vr, out, lse)
        previous = [None] * 3
        if qr.shape[0] > 1:
            previous = block_grads(*(_reversed(t[1:]) for t in (doutr, qr)), *(_reversed(t[:-1]) for t in (kr, vr)),
                                   *(_reversed(t[1:]) for t in (out, lse)))
        grads = [_from_chunks(_add_previous(own_grad, previous_grad, i == 0, t.dtype), b, s)
                 for i, (own_grad, previous_grad, t) in enumerate(zip(own, previous, (q, k, v)))]
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            dsink = sink_grad(dout, _from_chunks(out, b, s), _from_chunks(lse.unsqueeze(-1), b, s)[..., 0], sink)
        return (*grads, dsink, None, None)
