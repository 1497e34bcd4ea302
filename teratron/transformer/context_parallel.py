"""Core attention over context-parallel (and packed) tokens.

Under context parallelism (CP) every rank holds a part of each sequence: the sequence is cut
into 2 x CP equal chunks and CP rank r keeps chunks r and 2 x CP - 1 - r, so every rank gets the
same share of causal attention work (`cp_token_index`; packed 'thd' batches cut every document
that way). The data path slices tokens, labels, loss mask and positions so (training's
`get_batch_on_this_cp_rank`), RoPE rotates by the sliced positions, and every other layer is
per-token. Attention is where ranks meet; `cp_comm_type` (one per layer, as Megatron allows) says
how:

- 'p2p': a ring. Each step a rank sends the keys and values it holds to the next CP rank while it
  attends its queries over them; after CP steps it has seen every rank's. Transfers are posted
  before each step's attention (batch_isend_irecv; on CUDA they run on NCCL's stream, under the
  compute) and waited for after it.
- 'all_gather': every rank's keys and values gathered at once, then attended.
- 'a2a' (DeepSpeed Ulysses): queries, keys and values exchanged all-to-all from "this rank's
  tokens, all heads" to "every token, 1/CP of the heads" (heads per TP rank must divide by CP;
  key/value heads are repeated up to the query heads where their count does not divide), plain
  attention over the whole sequence, and back.
- 'a2a+p2p': a2a inside groups of `hierarchical_context_parallel_sizes[0]` consecutive CP ranks
  (say one NVLink domain), a p2p ring between the groups.

A step's partial results merge by log-sum-exp: with (o_i, L_i) the output and log-sum-exp of
softmax attention over key set i, the attention over their union is sum_i exp(L_i - L) o_i with
L = log(sum_i exp(L_i)). An attention sink z (softmax_type) is one more such term with o = 0:
out *= exp(L - L'), L' = logaddexp(L, z).

Backward of the exchanged types ('p2p', 'all_gather', and the ring of 'a2a+p2p') is explicit
(`_ExchangedAttention`): autograd through the steps would keep every rank's keys and values and
every step's output until backward, CP times the memory. Forward keeps q, k, v, the merged output
and L of this rank's tokens only; backward sends the keys and values round again, each step's
key/value gradient riding along the ring with them until it is home ('all_gather': gathered again,
gradients reduce-scattered). A block's gradient needs the final output and L only (the flash
backward identity dS = P (dP - rowsum(dO * O)), P = exp(S - L)). 'a2a' keeps autograd: its
attention is local.

Blocks. Which keys a query sees follows from where tokens sit in the full sequence
(`TokenLayout`): causal (or not), the sliding window, and for packed batches the documents. When
nothing but causality masks, a block of contiguous ranges is either whole (all keys before all
queries), causal (the same tokens) or empty, and runs on the flash kernel with log-sum-exp (CPU
or CUDA 16-bit: aten's `_scaled_dot_product_flash_attention[_for_cpu]` and its backward).
Windows and documents mask inside blocks: FlexAttention on CUDA with a 16-bit dtype, else the
explicit reference (scores materialised per block; CPU tests, fp32). Masked blocks' backward
recomputes their forward under autograd and feeds it gradients that make it the final softmax's.
`attention_backend` unfused/local runs every block on the reference. Attention dropout is not
supported on the exchanged types.

Packed batches without CP run here too (one participant, no exchange, autograd).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from teratron import comm, tensor_parallel
from teratron.packed_seq_params import PackedSeqParams, document_ids
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.transformer.attention_masks import allowed_keys, max_attention_logits

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
EXCHANGED = ("p2p", "all_gather", "a2a+p2p")


def layer_cp_comm_type(cp_comm_type, layer_number: int) -> str:
    """This layer's communication type: the one value, the layer's entry of a per-layer list
    (layer_number is 1-based; a multi-token-prediction depth's layers, numbered after the decoder's,
    take the last decoder layer's), or 'p2p' (Megatron's default) when None."""
    if cp_comm_type is None:
        return "p2p"
    if isinstance(cp_comm_type, str):
        return cp_comm_type
    return cp_comm_type[min(layer_number, len(cp_comm_type)) - 1]


# ----- which tokens each CP rank holds ------------------------------------------------------------

def _chunk_pair(start: int, length: int, cp_size: int, cp_rank: int) -> list:
    """The two (start, end) chunks CP rank `cp_rank` keeps of [start, start + length)."""
    if length % (2 * cp_size):
        raise ValueError(f"a sequence (or packed document) of {length} tokens cannot be split into 2 x CP = "
                         f"{2 * cp_size} equal chunks; make --seq-length (or pad every document to) a multiple "
                         f"of {2 * cp_size}")
    chunk = length // (2 * cp_size)
    return [(start + cp_rank * chunk, start + (cp_rank + 1) * chunk),
            (start + (2 * cp_size - 1 - cp_rank) * chunk, start + (2 * cp_size - cp_rank) * chunk)]


def cp_token_ranges(length: int, cp_size: int, cp_rank: int, boundaries=None) -> list:
    """The (start, end) position ranges CP rank `cp_rank` keeps of a sequence of `length`, in
    order: chunks r and 2 x CP - 1 - r of it, or with `boundaries` (packed documents, ints
    ascending from 0; tokens past the last one form one more document) of every document. One
    rank keeps the whole sequence."""
    if cp_size == 1:
        return [(0, length)]
    if boundaries is None:
        return _chunk_pair(0, length, cp_size, cp_rank)
    edges = [int(b) for b in boundaries]
    if edges[-1] < length:
        edges.append(length)
    ranges = []
    for start, end in zip(edges[:-1], edges[1:]):
        if end > start:
            ranges += _chunk_pair(start, end - start, cp_size, cp_rank)
    return ranges


def cp_token_index(length: int, cp_size: int, cp_rank: int, boundaries=None, device=None) -> torch.Tensor:
    """int64 positions of the tokens `cp_token_ranges` keeps, in order."""
    ranges = cp_token_ranges(length, cp_size, cp_rank, boundaries)
    return torch.cat([torch.arange(s, e, device=device) for s, e in ranges])


@dataclass(frozen=True)
class TokenSet:
    """Tokens one participant of an exchange holds: their positions in the full sequence
    (ascending) and those positions as merged (start, end) ranges, or () when not tracked."""

    positions: torch.Tensor
    ranges: tuple

    @classmethod
    def of_ranges(cls, ranges, device) -> "TokenSet":
        merged = []
        for start, end in sorted(ranges):
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((start, end))
        positions = torch.cat([torch.arange(s, e, device=device) for s, e in merged])
        return cls(positions, tuple(merged))


class TokenLayout:
    """Where each CP rank's tokens sit in the full sequence (`ranges[r]`, in the order the rank
    holds them), and the document of every position ([b or 1, length], None when each row is
    one document)."""

    def __init__(self, ranges: list, length: int, documents=None):
        self.ranges, self.length, self.documents = ranges, length, documents
        self._sets, self._blocks = {}, {}

    @classmethod
    def build(cls, packed: PackedSeqParams | None, cp_size: int, local_length: int, batch: int, device):
        """The layout of a micro-batch whose tokens on this rank are [local_length, batch]."""
        length = local_length * cp_size
        if packed is None:
            return cls([cp_token_ranges(length, cp_size, r) for r in range(cp_size)], length)
        if packed.qkv_format == "sbhd":
            ranges = [cp_token_ranges(length, cp_size, r) for r in range(cp_size)]
            return cls(ranges, length, document_ids(packed, batch, length, device))
        if batch != 1:
            raise ValueError(f"a packed 'thd' batch is one row of documents, got a micro-batch of {batch} rows; "
                             "use --micro-batch-size 1 with packed sequences")
        bounds = packed.boundaries.tolist()
        ranges = [cp_token_ranges(length, cp_size, r, bounds) for r in range(cp_size)]
        return cls(ranges, length, document_ids(packed, 1, length, device))

    def token_set(self, cp_ranks: tuple, device) -> TokenSet:
        """The tokens of these CP ranks together, sorted by position (an a2a group's)."""
        if cp_ranks not in self._sets:
            self._sets[cp_ranks] = TokenSet.of_ranges([r for rank in cp_ranks for r in self.ranges[rank]], device)
        return self._sets[cp_ranks]

    def blocks(self, q_ranks: tuple, k_ranks: tuple, causal: bool, window, explicit: bool, device) -> list:
        """The blocks of q_ranks' queries against k_ranks' keys (cached: every layer asks)."""
        key = (q_ranks, k_ranks, causal, window, explicit)
        if key not in self._blocks:
            q, k = self.token_set(q_ranks, device), self.token_set(k_ranks, device)
            self._blocks[key] = plan_blocks(q, k, causal, window, self.documents, explicit)
        return self._blocks[key]

    def order(self, cp_ranks: tuple, device) -> tuple:
        """(indices that sort the tokens of these ranks, concatenated in rank order, by position;
        the indices that put them back)."""
        key = ("order", cp_ranks)
        if key not in self._sets:
            held = torch.cat([torch.arange(s, e, device=device) for rank in cp_ranks for s, e in self.ranges[rank]])
            order = torch.argsort(held)
            self._sets[key] = order, torch.argsort(order)
        return self._sets[key]


def token_layout(attention_mask, cp_size: int, local_length: int, batch: int, device) -> TokenLayout:
    """The layout of this forward, built once and shared by the layers (kept on the
    PackedSeqParams, or cached per shape for unpacked batches)."""
    if isinstance(attention_mask, PackedSeqParams):
        key = ("layout", cp_size, local_length, batch, str(device))
        if key not in attention_mask.cache:
            attention_mask.cache[key] = TokenLayout.build(attention_mask, cp_size, local_length, batch, device)
        return attention_mask.cache[key]
    key = (cp_size, local_length, str(device))
    if key not in _UNPACKED_LAYOUTS:
        _UNPACKED_LAYOUTS[key] = TokenLayout.build(None, cp_size, local_length, batch, device)
    return _UNPACKED_LAYOUTS[key]


_UNPACKED_LAYOUTS: dict = {}


# ----- whole-sequence views of per-token tensors ------------------------------------------------


def gather_sequence(tensor, cp_group, attention_mask=None) -> tuple:
    """This CP rank's per-token tensor [b, s] (ids, labels, masks: no gradient) -> the whole
    sequence's [b, CP * s] in position order, and the document of every position ([b or 1,
    CP * s], or None when each row is one document). With CP 1 and no packed documents: the
    tensor itself."""
    packed = attention_mask if isinstance(attention_mask, PackedSeqParams) else None
    cp_size = get_pg_size(cp_group)
    if cp_size == 1 and packed is None:
        return tensor, None
    b, s = tensor.shape
    layout = token_layout(packed, cp_size, s, b, tensor.device)
    if cp_size == 1:
        return tensor, layout.documents
    order, _ = layout.order(tuple(range(cp_size)), tensor.device)
    held = _all_gather(tensor.contiguous().view(-1), cp_group).view(cp_size, b, s)  # rank by rank
    return held.permute(1, 0, 2).reshape(b, cp_size * s).index_select(1, order), layout.documents


def scatter_sequence(full, cp_group, attention_mask=None) -> torch.Tensor:
    """`gather_sequence`'s inverse: the whole sequence [b, CP * s] -> this CP rank's [b, s]."""
    cp_size = get_pg_size(cp_group)
    if cp_size == 1:
        return full
    packed = attention_mask if isinstance(attention_mask, PackedSeqParams) else None
    b, s = full.shape[0], full.shape[1] // cp_size
    _, back = token_layout(packed, cp_size, s, b, full.device).order(tuple(range(cp_size)), full.device)
    rank = get_pg_rank(cp_group)
    return full.index_select(1, back[rank * s:(rank + 1) * s])


# ----- blocks and their kernels ---------------------------------------------------------------------

class KeyMask:
    """Which keys each query of a block sees, from where the tokens sit: `q_positions` [sq] and
    `k_positions` [sk] in the full sequence, causal or not, the window, and the document of every
    position ([b or 1, length] or None). Built dense ([b or 1, 1, sq, sk], for the reference
    kernel) or as a FlexAttention block mask evaluated block by block (no s x s tensor), each once."""

    def __init__(self, q_positions, k_positions, causal: bool, window=None, documents=None):
        self.q_positions, self.k_positions = q_positions, k_positions
        self.causal, self.window, self.documents = causal, window, documents
        self._dense = self._block_mask = None

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self._allowed(self.q_positions)
        return self._dense

    def hidden_keys(self, q0: int, q1: int) -> torch.Tensor:
        """True where queries q0 .. q1 - 1 of the block may not see a key, [b or 1, 1, q1 - q0, sk]."""
        return ~self._allowed(self.q_positions[q0:q1])

    def _allowed(self, q) -> torch.Tensor:
        k = self.k_positions
        allowed = allowed_keys(q[:, None], k[None, :], self.causal, self.window)[None]
        if self.documents is not None:
            allowed = allowed & (self.documents[:, q, None] == self.documents[:, None, k])
        return allowed.unsqueeze(1)

    def block_mask(self):
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            from teratron import fusions

            q, k, documents = self.q_positions, self.k_positions, self.documents

            rows = 1 if documents is None else documents.shape[0]

            def mask_mod(b, h, q_idx, kv_idx):
                allowed = allowed_keys(q[q_idx], k[kv_idx], self.causal, self.window)
                if documents is not None:
                    row = b if rows > 1 else 0  # one row of documents: every sample's
                    allowed = allowed & (documents[row, q[q_idx]] == documents[row, k[kv_idx]])
                return allowed
            self._block_mask = fusions.fused(create_block_mask)(mask_mod, rows, None, q.numel(), k.numel(),
                                                                device=q.device)
        return self._block_mask


@dataclass(frozen=True)
class Block:
    """Queries q (a slice of the held tokens) against keys kv: 'full' (every key visible),
    'causal' (the same tokens, lower triangle) or 'masked' (by `mask`, a KeyMask)."""

    q: slice
    kv: slice
    kind: str
    mask: KeyMask | None = None


def plan_blocks(q: TokenSet, k: TokenSet, causal: bool, window, documents, explicit: bool) -> list:
    """The blocks of q's queries against k's keys. `explicit`: every block masked explicitly."""
    everything = slice(None)
    if window is not None or documents is not None or explicit or not q.ranges:
        return [Block(everything, everything, "masked", KeyMask(q.positions, k.positions, causal, window, documents))]
    if not causal:
        return [Block(everything, everything, "full")]
    if q is k:
        return [Block(everything, everything, "causal")]
    blocks = []
    q_start = 0
    for qs, qe in q.ranges:
        k_start = 0
        for ks, ke in k.ranges:
            if ke <= qs:
                blocks.append(Block(slice(q_start, q_start + qe - qs), slice(k_start, k_start + ke - ks), "full"))
            elif ks < qe:
                raise AssertionError(f"token ranges {(qs, qe)} and {(ks, ke)} of two participants overlap")
            k_start += ke - ks
        q_start += qe - qs
    return _merge_adjacent(blocks)


def _merge_adjacent(blocks: list) -> list:
    """Join full blocks that share their queries and have adjacent keys, then the reverse."""
    for same, other in (("q", "kv"), ("kv", "q")):
        merged = []
        for block in blocks:
            last = merged[-1] if merged else None
            if (last is not None and getattr(last, same) == getattr(block, same)
                    and getattr(last, other).stop == getattr(block, other).start):
                joined = slice(getattr(last, other).start, getattr(block, other).stop)
                merged[-1] = Block(**{same: getattr(block, same), other: joined, "kind": "full"})
            else:
                merged.append(block)
        blocks = merged
    return blocks


def _expand_groups(k, v, heads: int):
    """Key/value heads [b, g, s, h] repeated to the query heads (GQA)."""
    groups = heads // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _fold_groups(grad, groups: int):
    """The gradient of repeated key/value heads [b, g * groups, s, h] summed back to [b, g, s, h]."""
    if groups == 1:
        return grad
    b, n, s, h = grad.shape
    return grad.view(b, n // groups, groups, s, h).sum(2)


def flash_kernel_fits(q, v, reference: bool) -> bool:
    """Whether aten's flash kernel runs a block: on the CPU any float dtype, on CUDA 16-bit."""
    if reference:
        return False
    if q.is_cuda:
        return q.dtype in (torch.float16, torch.bfloat16) and max(q.shape[-1], v.shape[-1]) <= 256
    return True


def _pad_heads(q, k, v):
    size = max(q.shape[-1], v.shape[-1])
    return tuple(t if t.shape[-1] == size else F.pad(t, (0, size - t.shape[-1])) for t in (q, k, v))


def flash_forward(q, k, v, causal: bool, scale: float):
    """q [b, n, sq, hq], k [b, g, sk, hq], v [b, g, sk, hv] -> (out [b, n, sq, hv] in q's dtype,
    log-sum-exp [b, n, sq] fp32). On CUDA aten's flash kernel; on the CPU aten's flash kernel for
    the CPU."""
    hv = v.shape[-1]
    k, v = _expand_groups(k, v, q.shape[1])
    q, k, v = _pad_heads(q, k, v)
    if not q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out[..., :hv], lse.float()


def flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of q, k, v of one block given the final output `out` (q's dtype) and log-sum-exp
    `lse` of these queries and the gradient of that output."""
    groups, hq, hv = q.shape[1] // k.shape[1], q.shape[-1], v.shape[-1]
    k, v = _expand_groups(k, v, q.shape[1])
    q, k, v = _pad_heads(q, k, v)
    size = q.shape[-1]
    out, dout = (t if size == hv else F.pad(t, (0, size - hv)) for t in (out, dout))
    if not q.is_cuda:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    else:
        # No cumulative lengths (None: the dense kernel, not varlen); without dropout the RNG state is unused.
        rng = torch.zeros((), device=q.device, dtype=torch.int64)
        # The kernel reads the log-sum-exp as a contiguous [b, n, sq] (a block's rows are a slice).
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, rng, rng,
            scale=scale)
    return dq[..., :hq], _fold_groups(dk[..., :hq], groups), _fold_groups(dv[..., :hv], groups)


def uses_flex(q, reference: bool) -> bool:
    """Whether masked blocks run on FlexAttention: CUDA, 16-bit, not the reference backend."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not reference


def masked_forward(q, k, v, mask: KeyMask, scale: float, flex: bool, dropout_p: float = 0.0):
    """Differentiable (out [b, n, sq, hv], log-sum-exp [b, n, sq]) of attention over the keys
    `mask` lets each query see. A query that sees none gets out 0 and L = -inf. FlexAttention
    with `flex` (no dropout), else explicit scores in fp32 (out fp32)."""
    if flex:
        return _flex_forward(q, k, v, mask, scale)
    k, v = _expand_groups(k, v, q.shape[1])
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask.dense(), float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    total = torch.exp(scores - top).sum(-1)
    seen = total > 0
    lse = torch.where(seen, top.squeeze(-1) + torch.log(total.clamp_min(torch.finfo(total.dtype).tiny)),
                      torch.full_like(total, float("-inf")))
    probs = torch.exp(scores - torch.where(seen, lse, torch.zeros_like(lse)).unsqueeze(-1))
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    return torch.matmul(probs, v.float()), lse


def _flex_forward(q, k, v, mask: KeyMask, scale: float):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    from teratron import fusions

    out, aux = fusions.fused(flex_attention)(q, k, v, block_mask=mask.block_mask(), scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))
    return out, aux.lse


def masked_backward(dout, q, k, v, mask: KeyMask, out, lse, scale: float, flex: bool):
    """Gradients of q, k, v of one masked block given the final output and log-sum-exp: the
    block's forward, recomputed under autograd, back-propagates dO_b = w dO and dL_b =
    w (rowsum(dO * O_b) - rowsum(dO * O)) with w = exp(L_b - L), which make its softmax the
    final one's."""
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out_b, lse_b = masked_forward(*inputs, mask, scale, flex)
        dout = dout.float()
        weight = torch.exp(lse_b.detach() - lse)
        weight = torch.where(torch.isfinite(lse_b.detach()), weight, torch.zeros_like(weight))
        final = (dout * out.float()).sum(-1)
        grad_out = (weight.unsqueeze(-1) * dout).to(out_b.dtype)
        grad_lse = weight * ((dout * out_b.detach().float()).sum(-1) - final)
        grads = torch.autograd.grad((out_b, lse_b), inputs, (grad_out, grad_lse.to(lse_b.dtype)), allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))


def block_forward(block: Block, q, k, v, scale: float, flex: bool):
    q, k, v = q[:, :, block.q], k[:, :, block.kv], v[:, :, block.kv]
    if block.kind == "masked":
        out, lse = masked_forward(q, k, v, block.mask, scale, flex)
    else:
        out, lse = flash_forward(q, k, v, block.kind == "causal", scale)
    return out.float(), lse.float()


@torch.no_grad()
def record_max_logits(record, block: Block, q, k, scale: float) -> None:
    """Raise `record` [n] (fp32, QK-clip's per-head max logit) to the largest logit of the
    block's visible (query, key) pairs."""
    q, k = q[:, :, block.q], k[:, :, block.kv]
    if block.kind == "masked":
        logits = max_attention_logits(q, k, scale, False, hidden_keys=block.mask.hidden_keys)
    else:
        logits = max_attention_logits(q, k, scale, block.kind == "causal")
    record.copy_(torch.maximum(record, logits))


def block_backward(block: Block, dout, q, k, v, out, lse, scale: float, flex: bool):
    q, k, v = q[:, :, block.q], k[:, :, block.kv], v[:, :, block.kv]
    dout, out, lse = dout[:, :, block.q], out[:, :, block.q], lse[:, :, block.q]
    if block.kind == "masked":
        return masked_backward(dout, q, k, v, block.mask, out, lse, scale, flex)
    return flash_backward(dout, q, k, v, out, lse, block.kind == "causal", scale)


class _Merged:
    """The running log-sum-exp merge of block results for one participant's queries. The output
    [b, n, s, hv] is laid out [s, b, n, hv] in memory, so the layer's [s, b, n * hv] context is a
    view of it (linear_proj keeps the storage attention keeps, as with SDPA)."""

    def __init__(self, q, hv: int):
        b, n, s, _ = q.shape
        self.out = torch.zeros(s, b, n, hv, dtype=torch.float32, device=q.device).permute(1, 2, 0, 3)
        self.lse = torch.full((b, n, s), float("-inf"), dtype=torch.float32, device=q.device)

    def add(self, rows: slice, out, lse) -> None:
        self.out[:, :, rows], self.lse[:, :, rows] = merge_by_lse(self.out[:, :, rows], self.lse[:, :, rows], out, lse)


def merge_by_lse(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two key sets from each one's output [..., s, h] and log-sum-exp
    [..., s]: (sum_i exp(L_i - L) o_i, L = logaddexp(L_a, L_b)); a set a query saw nothing of
    (L_i = -inf) adds nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = out_a * torch.exp(lse_a - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1)
    return out, lse


def apply_sink(out, lse, sink):
    """Add the sink logits z [n] to the softmax of out [b, n, s, h], lse [b, n, s]: out *= exp(L - L'),
    L' = logaddexp(L, z)."""
    if sink is None:
        return out, lse
    total = torch.logaddexp(lse, sink.float().view(1, -1, 1))
    return out * torch.exp(lse - total).unsqueeze(-1), total


def sink_grad(dout, out, lse, sink):
    """The gradient of the sink logits z [n] from every query's final output and its gradient
    [b, n, s, h] and final log-sum-exp [b, n, s]: the sink is a key of value 0, so dz = -sum over
    queries of P_sink * rowsum(dO * O), P_sink = exp(z - L)."""
    final = (dout.float() * out.float()).sum(-1)
    return -(torch.exp(sink.float().view(1, -1, 1) - lse) * final).sum((0, 2)).to(sink.dtype)


# ----- exchanges --------------------------------------------------------------------------------

def _pack(k, v) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(flat, k_like, v_like):
    split = k_like.numel()
    return flat[:split].view(k_like.shape), flat[split:].view(v_like.shape)


class _RingShift:
    """Send a tensor to the next rank of a group and receive the previous rank's (async)."""

    def __init__(self, group, tensor):
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        self.received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, ranks[(me + 1) % len(ranks)], group),
               dist.P2POp(dist.irecv, self.received, ranks[(me - 1) % len(ranks)], group)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


@dataclass
class Exchange:
    """How an exchanged attention meets the other participants' keys and values: 'ring' or
    'gather' over `group`; plans[(i, j)]: the blocks of group rank i's queries against rank j's
    keys."""

    kind: str
    group: object
    plans: dict
    scale: float
    flex: bool           # masked blocks on FlexAttention
    max_logits: torch.Tensor | None = None  # QK-clip's record [n], raised by forward

    @property
    def me(self) -> int:
        return get_pg_rank(self.group)

    def blocks(self, source: int) -> list:
        return self.plans[(self.me, source)]

    def forward(self, q, k, v):
        merged = _Merged(q, v.shape[-1])
        for source, ks, vs in self._key_values(k, v):
            for block in self.blocks(source):
                merged.add(block.q, *block_forward(block, q, ks, vs, self.scale, self.flex))
                if self.max_logits is not None:
                    record_max_logits(self.max_logits, block, q, ks, self.scale)
        return merged.out, merged.lse

    def _key_values(self, k, v):
        """(source, its keys, its values) for every participant, the ring's transfers overlapping
        the attention over the keys in hand."""
        size = get_pg_size(self.group)
        if self.kind == "gather":
            gathered = _all_gather(_pack(k, v), self.group)
            for source in range(size):
                yield (source, *_unpack(gathered[source], k, v))
            return
        held = _pack(k, v)
        for step in range(size):
            shift = _RingShift(self.group, held) if step < size - 1 else None
            yield ((self.me - step) % size, *_unpack(held, k, v))
            if shift is not None:
                held = shift.wait()

    def backward(self, dout, q, k, v, out, lse):
        dq = torch.zeros_like(q, dtype=torch.float32)
        size = get_pg_size(self.group)
        if self.kind == "gather":
            gathered = _all_gather(_pack(k, v), self.group)
            grads = torch.zeros(gathered.shape, dtype=torch.float32, device=q.device)
            for source in range(size):
                ks, vs = _unpack(gathered[source], k, v)
                grads[source] = self._source_grads(source, dq, dout, q, ks, vs, out, lse)
            return (dq, *_unpack(_reduce_scatter(grads, self.group), k, v))
        if size == 1:
            return (dq, *_unpack(self._source_grads(0, dq, dout, q, k, v, out, lse), k, v))
        held, grads_in_flight = _pack(k, v), None
        for step in range(size):
            shift = _RingShift(self.group, held) if step < size - 1 else None
            ks, vs = _unpack(held, k, v)
            grads = self._source_grads((self.me - step) % size, dq, dout, q, ks, vs, out, lse)
            if grads_in_flight is not None:
                grads += grads_in_flight.wait()  # earlier ranks' gradients of these keys and values
            grads_in_flight = _RingShift(self.group, grads)  # on to the next rank; after the last step, home
            if shift is not None:
                held = shift.wait()
        return (dq, *_unpack(grads_in_flight.wait(), k, v))

    def _source_grads(self, source, dq, dout, q, ks, vs, out, lse) -> torch.Tensor:
        """Add this rank's query gradients from `source`'s keys into dq; return the packed fp32
        gradients of those keys and values."""
        dk = torch.zeros_like(ks, dtype=torch.float32)
        dv = torch.zeros_like(vs, dtype=torch.float32)
        for block in self.blocks(source):
            gq, gk, gv = block_backward(block, dout, q, ks, vs, out, lse, self.scale, self.flex)
            dq[:, :, block.q] += gq
            dk[:, :, block.kv] += gk
            dv[:, :, block.kv] += gv
        return _pack(dk, dv)


def _all_gather(flat, group) -> torch.Tensor:
    gathered = torch.empty(get_pg_size(group) * flat.numel(), dtype=flat.dtype, device=flat.device)
    comm.all_gather_into_tensor(gathered, flat, group)
    return gathered.view(get_pg_size(group), -1)


def _reduce_scatter(grads, group) -> torch.Tensor:
    out = torch.empty(grads.shape[1:], dtype=grads.dtype, device=grads.device)
    comm.reduce_scatter_tensor(out, grads.reshape(-1), group)
    return out


class _ExchangedAttention(torch.autograd.Function):
    """q [b, n, s, hq], k [b, g, s, hq], v [b, g, s, hv] of this participant, the sink logits of
    its heads or None -> out [b, n, s, hv] (q's dtype); explicit backward (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, exchange):
        out, lse = exchange.forward(q, k, v)
        out, lse = apply_sink(out, lse, sink)
        out = out.to(q.dtype)
        ctx.exchange = exchange
        ctx.save_for_backward(q, k, v, out, lse, sink)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv = ctx.exchange.backward(dout.contiguous(), q, k, v, out, lse)
        dsink = sink_grad(dout, out, lse, sink) if sink is not None and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None


# ----- a2a: heads <-> sequence ---------------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """[s, b, n, h] (this rank's tokens, all heads) <-> [a * s, b, n / a, h] (the group's tokens
    in rank order, this rank's 1/a of the heads); backward is the opposite exchange."""

    @staticmethod
    def forward(ctx, x, group, to_sequence: bool):
        ctx.group, ctx.to_sequence = group, to_sequence
        return _all_to_all(x, group, to_sequence)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group, not ctx.to_sequence), None, None


def _all_to_all(x, group, to_sequence: bool):
    a = get_pg_size(group)
    if to_sequence:
        s, b, n, h = x.shape
        send = x.view(s, b, a, n // a, h).permute(2, 0, 1, 3, 4).contiguous()  # [a (head group), s, b, n/a, h]
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)  # [a (source rank), s, b, n/a, h]
        return received.view(a * s, b, n // a, h)
    s_all, b, n_local, h = x.shape
    send = x.view(a, s_all // a, b, n_local, h)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # [a (head group), s, b, n/a, h]
    return received.permute(1, 2, 0, 3, 4).reshape(s_all // a, b, a * n_local, h)


def heads_to_sequence(t, group):
    """[s, b, n, h] of this rank's tokens -> [a * s, b, n / a, h]: the group's tokens (in rank order)
    for this rank's 1/a of the n heads (its index in the group picks them)."""
    return _AllToAll.apply(t, group, True)


def sequence_to_heads(t, group):
    """`heads_to_sequence`'s inverse: [a * s, b, n / a, h] -> [s, b, n, h]."""
    return _AllToAll.apply(t, group, False)


# ----- one layer's core attention -------------------------------------------------------------------

@dataclass
class ContextParallelConfig:
    """What one layer's core attention needs besides its inputs."""

    comm_type: str
    cp_group: object
    hcp_groups: list | None   # [a2a group, p2p group] for 'a2a+p2p'
    scale: float
    window: tuple | None
    reference: bool           # attention_backend unfused/local: every block explicit


def context_parallel_config(config, layer_number: int, cp_comm_type, pg_collection, scale: float, window,
                            reference: bool) -> ContextParallelConfig:
    """One layer's: its cp_comm_type (the argument, else the config's value or per-layer list)."""
    return ContextParallelConfig(cp_comm_type or layer_cp_comm_type(config.cp_comm_type, layer_number),
                                 pg_collection.cp, pg_collection.hcp, scale, window, reference)


def runs_here(config: ContextParallelConfig, attention_mask) -> bool:
    """Whether a layer's core attention runs here: under context parallelism or on packed documents."""
    return get_pg_size(config.cp_group) > 1 or isinstance(attention_mask, PackedSeqParams)


@torch.compiler.disable
def context_parallel_attention(config: ContextParallelConfig, query, key, value, attention_mask, causal: bool,
                               sink=None, dropout_p: float = 0.0, max_logits=None):
    """query [s, b, np, hq], key [s, b, ng, hq], value [s, b, ng, hv] of this rank's tokens;
    attention_mask None or the batch's PackedSeqParams -> context [s, b, np * hv]. Runs outside
    torch.compile (a compiled layer calls it as is): it communicates, and caches its layouts.
    Dropout (a2a, packed documents without CP) draws from the tensor-parallel RNG tracker: every
    TP rank holds other heads. `max_logits` (QK-clip's record, [np] fp32, or None) is raised to
    the largest logit each head sees here; under 'a2a' a rank sees its share of the heads, and
    the record's max-reduction over the CP ranks completes it."""
    with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
        return _context_parallel_attention(config, query, key, value, attention_mask, causal, sink, dropout_p,
                                           max_logits)


def _context_parallel_attention(config, query, key, value, attention_mask, causal, sink, dropout_p, max_logits):
    if attention_mask is not None and not isinstance(attention_mask, PackedSeqParams):
        raise ValueError("context parallelism and packed sequences take no dense attention mask; pass "
                         "packed_seq_params (documents) or None (causal)")
    cp_size = get_pg_size(config.cp_group)
    s, b = query.shape[:2]
    layout = token_layout(attention_mask, cp_size, s, b, query.device)
    if cp_size > 1 and config.comm_type in ("a2a", "a2a+p2p"):
        out = _attention_after_a2a(config, layout, query, key, value, causal, sink, dropout_p, max_logits)
    else:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, h]
        exchange = "local" if cp_size == 1 else config.comm_type
        participants = [(r,) for r in range(cp_size)]
        out = _attend(config, exchange, config.cp_group, layout, participants, get_pg_rank(config.cp_group),
                      q, k, v, causal, sink, dropout_p, max_logits).permute(2, 0, 1, 3)
    return out.reshape(s, b, -1)


def _attention_after_a2a(config, layout, query, key, value, causal, sink, dropout_p, max_logits):
    """Heads exchanged for tokens inside the a2a group, sorted by position, attention (local, or
    a ring between the groups), and back."""
    if config.comm_type == "a2a":
        a2a_group, ring_group = config.cp_group, None
    else:
        a2a_group, ring_group = config.hcp_groups
    size, index = get_pg_size(a2a_group), get_pg_rank(a2a_group)
    heads, groups = query.shape[2], key.shape[2]
    if groups % size:  # too few key/value heads to split: one per query head
        key, value = (t.repeat_interleave(heads // groups, dim=2) for t in (key, value))
    first = get_pg_rank(config.cp_group) - index  # a2a groups are runs of consecutive CP ranks
    members = tuple(range(first, first + size))
    order, back = layout.order(members, query.device)
    q, k, v = (heads_to_sequence(t, a2a_group).index_select(0, order).permute(1, 2, 0, 3)
               for t in (query, key, value))
    mine = slice(index * heads // size, (index + 1) * heads // size)  # the heads this rank attends
    sink = None if sink is None else sink[mine]
    max_logits = None if max_logits is None else max_logits[mine]
    if ring_group is None:
        out = _attend(config, "local", None, layout, [members], 0, q, k, v, causal, sink, dropout_p, max_logits)
    else:
        participants = [tuple(range(o * size, (o + 1) * size)) for o in range(get_pg_size(ring_group))]
        out = _attend(config, "p2p", ring_group, layout, participants, get_pg_rank(ring_group), q, k, v, causal,
                      sink, dropout_p, max_logits)
    out = out.permute(2, 0, 1, 3).index_select(0, back)
    return sequence_to_heads(out.contiguous(), a2a_group)


def _attend(config, exchange, group, layout, participants, me, q, k, v, causal, sink, dropout_p, max_logits=None):
    """Participant `me`'s queries [b, n, s, hq] over every participant's keys -> [b, n, s, hv].
    `participants[i]`: the CP ranks whose tokens rank i of `group` holds; `exchange`: 'local'
    (one participant), 'p2p' or 'all_gather'."""
    flex = uses_flex(q, config.reference)
    explicit = config.reference or not flash_kernel_fits(q, v, config.reference)

    def blocks(i, j):
        return layout.blocks(participants[i], participants[j], causal, config.window, explicit, q.device)
    if exchange == "local":
        block = blocks(me, me)[0]
        if max_logits is not None:
            record_max_logits(max_logits, block, q, k, config.scale)
        return _local_attention(config, block, q, k, v, sink, dropout_p, flex)
    if dropout_p > 0:
        raise ValueError(f"attention_dropout={dropout_p} with cp_comm_type {config.comm_type!r}: context-parallel "
                         "attention has no dropout; set attention_dropout to 0 (--attention-dropout 0)")
    plans = {(me, j): blocks(me, j) for j in range(len(participants))}
    kind = "gather" if exchange == "all_gather" else "ring"
    return _ExchangedAttention.apply(q, k, v, sink, Exchange(kind, group, plans, config.scale, flex, max_logits))


def _local_attention(config, block: Block, q, k, v, sink, dropout_p, flex: bool):
    """Attention without exchange (one participant), under autograd."""
    if block.kind != "masked" and sink is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=block.kind == "causal",
                                              scale=config.scale, enable_gqa=q.shape[1] != k.shape[1])
    mask = block.mask
    if mask is None:  # a sink on a whole or causal block
        positions = torch.arange(q.shape[2], device=q.device)
        mask = KeyMask(positions, positions, block.kind == "causal")
    if flex and dropout_p > 0:
        raise ValueError(f"attention_dropout={dropout_p}: FlexAttention (packed documents, windows or sinks) has no "
                         "attention dropout; set attention_dropout to 0 or attention_backend to 'unfused'")
    out, lse = masked_forward(q, k, v, mask, config.scale, flex, dropout_p)
    out, _ = apply_sink(out, lse, sink)
    return out.to(q.dtype)
