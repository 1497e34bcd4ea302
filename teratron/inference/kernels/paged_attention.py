"""Paged attention for decode: each query attends to the first kv_lengths[i] keys of its request,
read in place from the paged KV cache (the layout of `DynamicInferenceContext.memory_buffer`, one
layer: [num_blocks, block_size, ng, hn]; token p of a request is in block block_table[p //
block_size] at offset p % block_size).

`paged_attention` runs a Triton kernel on CUDA (and on CPU tensors under TRITON_INTERPRET=1, the
way the CPU tests check the kernel's code), else `paged_attention_reference`. Both are safe to
capture in a CUDA graph: shapes, launches and allocations depend on tensor shapes only, never on
values.

The kernel works flash-decoding style: a program takes one query, one kv head and the np // ng
query heads that share it (the rows of its tile), loops over tiles of keys gathered through the
block table with an online softmax in fp32, and accumulates in fp32. When the batch has too few
(query, kv head) pairs to fill the GPU, each pair's keys are split over several programs, and a
second kernel merges their partial results by their log-sum-exp.
"""

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference serves without Triton
    triton = None
# Triton reads TRITON_INTERPRET when it defines the kernels (at import): then they run on CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Split a pair's keys until the launch has this many programs per SM (batch-1 decode of a long
# context would otherwise run on ng of the SMs).
PROGRAMS_PER_SM = 2
MAX_SPLITS = 32
# fp32 elements in a tile of keys (32 KiB; a tile of keys and one of values are held at a time).
TILE_ELEMENTS = 8192
KERNEL_OPTIONS = dict(num_warps=4, num_stages=3)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, kv_lengths: torch.Tensor, softmax_scale: float,
                    window_left: int = -1, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of n queries over their requests' cached keys and values.

    query [n, np, hn]; key_cache, value_cache [num_blocks, block_size, ng, hn] (np % ng == 0: query
    head h uses kv head h // (np // ng)); block_table int32 [n, max_blocks] (row i: the blocks of
    query i's request in order; entries past the used ones are any valid block ids); kv_lengths
    int32 [n], from 1 to max_blocks * block_size: query i attends to keys 0 .. kv_lengths[i] - 1 of
    its row (nothing checks the values: that would sync with the GPU). window_left >= 0: a sliding
    window, query i attends only to its last window_left + 1 keys (from position kv_lengths[i] - 1 -
    window_left); -1: no window. sinks [np] (logits) or None: attention sinks, one more logit per
    head in every softmax's denominator (with no value).
    Returns [n, np, hn] in query's dtype; scores, softmax and sums in fp32.
    """
    _check_shapes(query, key_cache, value_cache, block_table, kv_lengths)
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(f"paged_attention: sinks {tuple(sinks.shape)} must be [{query.shape[1]}], one per query head")
    args = (query, key_cache, value_cache, block_table, kv_lengths, softmax_scale, window_left, sinks)
    if triton is not None and (query.is_cuda or INTERPRETED):
        return paged_attention_triton(*args)
    return paged_attention_reference(*args)


def paged_attention_reference(query, key_cache, value_cache, block_table, kv_lengths, softmax_scale,
                              window_left: int = -1, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention` in plain PyTorch: gathers every row's blocks [n, max_blocks * block_size]
    and masks the keys past kv_lengths."""
    n, heads, head_dim = query.shape
    groups = key_cache.shape[2]
    # [n, max_blocks, block_size, ng, hn] -> [n, L, ng, hn], L = max_blocks * block_size
    keys, values = (cache[block_table.long()].flatten(1, 2).float() for cache in (key_cache, value_cache))
    positions = torch.arange(keys.shape[1], device=query.device)
    valid = positions < kv_lengths[:, None]  # [n, L]
    if window_left >= 0:
        valid &= positions >= kv_lengths[:, None] - 1 - window_left
    # Masked keys may be anything (NaN too): their scores become -inf, their values zeros.
    values = values.masked_fill(~valid[:, :, None, None], 0)
    q = query.float().reshape(n, groups, heads // groups, head_dim)  # [n, ng, np / ng, hn]
    scores = torch.einsum("ngqd,nlgd->ngql", q, keys) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    if sinks is not None:  # a column of sink logits joins the softmax, then leaves it
        sink_column = sinks.float().view(1, groups, heads // groups, 1).expand(n, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    context = torch.einsum("ngql,nlgd->ngqd", probs, values)
    return context.reshape(n, heads, head_dim).to(query.dtype)


def paged_attention_triton(query, key_cache, value_cache, block_table, kv_lengths, softmax_scale,
                           window_left: int = -1, sinks: torch.Tensor | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """`paged_attention` by the Triton kernel, each (query, kv head)'s keys split over `num_splits`
    programs (1: one kernel, no merge; None: as many as fill the GPU, `_num_splits`)."""
    n, heads, head_dim = query.shape
    _, block_size, groups, _ = key_cache.shape
    group_size = heads // groups
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # 16: tl.dot's smallest tile side
    tile_keys = max(16, min(64, TILE_ELEMENTS // head_dim_pad))
    if num_splits is None:
        num_splits = _num_splits(n * groups, block_table.shape[1] * block_size, tile_keys, query.device)
    output = query.new_empty(query.shape)
    meta = dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP_SIZE=group_size,
                ROWS=max(16, triton.next_power_of_2(group_size)), TILE_KEYS=tile_keys,
                # Tiles are converted to fp32: tf32 holds every bf16 and fp16 value, so their q.k
                # products are exact; fp32 inputs need "ieee" for that.
                PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    if num_splits == 1:
        partial, lse = output, output  # unused
    else:
        partial = query.new_empty(n, heads, num_splits, head_dim_pad, dtype=torch.float32)
        lse = query.new_empty(n, heads, num_splits, dtype=torch.float32)
    sink_logits = sinks.float().contiguous() if sinks is not None else output  # unused without sinks
    _paged_attention_kernel[(n, groups, num_splits)](
        query, key_cache, value_cache, block_table, kv_lengths, output, partial, lse, sink_logits,
        softmax_scale * math.log2(math.e), window_left, *query.stride(), *key_cache.stride(), *value_cache.stride(),
        block_table.stride(0), *output.stride(), NUM_SPLITS=num_splits, HAS_SINKS=sinks is not None, **meta,
        **KERNEL_OPTIONS)
    if num_splits > 1:
        _merge_splits_kernel[(n, heads)](partial, lse, output, sink_logits, *output.stride(), HEAD_DIM=head_dim,
                                         HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
                                         SPLITS_PAD=triton.next_power_of_2(num_splits), HAS_SINKS=sinks is not None)
    return output


def _check_shapes(query, key_cache, value_cache, block_table, kv_lengths) -> None:
    n, heads, head_dim = query.shape
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4 or key_cache.shape[3] != head_dim:
        raise ValueError(f"paged_attention: key_cache {tuple(key_cache.shape)} and value_cache "
                         f"{tuple(value_cache.shape)} must both be [num_blocks, block_size, ng, {head_dim}]")
    if heads % key_cache.shape[2]:
        raise ValueError(f"paged_attention: {heads} query heads are not a multiple of {key_cache.shape[2]} kv heads")
    if block_table.dim() != 2 or block_table.shape[0] != n or tuple(kv_lengths.shape) != (n,):
        raise ValueError(f"paged_attention: block_table {tuple(block_table.shape)} must be [{n}, max_blocks] and "
                         f"kv_lengths {tuple(kv_lengths.shape)} [{n}] for {n} queries")
    if block_table.dtype != torch.int32 or kv_lengths.dtype != torch.int32:
        raise ValueError(f"paged_attention: block_table ({block_table.dtype}) and kv_lengths ({kv_lengths.dtype}) "
                         "must be int32")


def _num_splits(pairs: int, max_keys: int, tile_keys: int, device: torch.device) -> int:
    """Programs per (query, kv head) pair: enough for PROGRAMS_PER_SM programs on every SM, at
    most one per tile of the longest context the block table holds (from shapes only: graph-safe)."""
    wanted = PROGRAMS_PER_SM * _sm_count(device)
    return max(1, min(-(-wanted // pairs), -(-max_keys // tile_keys), MAX_SPLITS))


@functools.lru_cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


if triton is not None:
    @triton.jit
    def _paged_attention_kernel(
            query, key_cache, value_cache, block_table, kv_lengths, output, partial, lse, sinks, scale_log2,
            window_left, stride_qn, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd, stride_table, stride_on, stride_oh, stride_od,
            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP_SIZE: tl.constexpr,
            ROWS: tl.constexpr, TILE_KEYS: tl.constexpr, PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr,
            HAS_SINKS: tl.constexpr):
        """Program (i, g, s): query i's heads g * GROUP_SIZE ... (g + 1) * GROUP_SIZE - 1 (tile rows,
        padded to ROWS) over the s-th of NUM_SPLITS equal runs of tiles of its keys (those of its
        window: from kv_length - 1 - window_left when window_left >= 0)."""
        i = tl.program_id(0)
        g = tl.program_id(1)
        s = tl.program_id(2)
        rows = tl.arange(0, ROWS)
        dims = tl.arange(0, HEAD_DIM_PAD)
        row_ok = rows < GROUP_SIZE
        dim_ok = dims < HEAD_DIM
        heads = g * GROUP_SIZE + rows
        q = tl.load(query + i * stride_qn + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)  # [ROWS, HEAD_DIM_PAD]

        kv_length = tl.load(kv_lengths + i)
        first_key = tl.where(window_left >= 0, tl.maximum(kv_length - 1 - window_left, 0), 0)
        tiles_per_split = tl.cdiv(tl.cdiv(kv_length - first_key, TILE_KEYS), NUM_SPLITS)
        start = first_key + s * tiles_per_split * TILE_KEYS
        end = tl.minimum(start + tiles_per_split * TILE_KEYS, kv_length)

        row_max = tl.full([ROWS], float("-inf"), tl.float32)  # in log2 units
        row_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
        for first in range(start, end, TILE_KEYS):
            positions = first + tl.arange(0, TILE_KEYS)
            key_ok = positions < end
            blocks = tl.load(block_table + i * stride_table + positions // BLOCK_SIZE, mask=key_ok, other=0)
            blocks = blocks.to(tl.int64)
            offsets = positions % BLOCK_SIZE
            load_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(key_cache + blocks[:, None] * stride_kb + offsets[:, None] * stride_kt + g * stride_kh
                        + dims[None, :] * stride_kd, mask=load_mask, other=0.0).to(tl.float32)  # [TILE_KEYS, HD_PAD]
            v = tl.load(value_cache + blocks[:, None] * stride_vb + offsets[:, None] * stride_vt + g * stride_vh
                        + dims[None, :] * stride_vd, mask=load_mask, other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [ROWS, TILE_KEYS]
            scores = tl.where(key_ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            weights = tl.exp2(scores - new_max[:, None])
            rescale = tl.exp2(row_max - new_max)
            row_sum = row_sum * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision=PRECISION)
            row_max = new_max

        if NUM_SPLITS == 1:
            if HAS_SINKS:  # the sink's exp(z) joins the denominator (z in log2 units: times log2(e))
                sink = tl.load(sinks + heads, mask=row_ok, other=0.0) * 1.4426950408889634
                row_sum += tl.exp2(sink - row_max)
            tl.store(output + i * stride_on + heads[:, None] * stride_oh + dims[None, :] * stride_od,
                     (acc / row_sum[:, None]).to(output.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        else:
            # An empty split (start >= kv_length) leaves zeros and a log-sum-exp of -inf: no weight.
            safe_sum = tl.where(row_sum > 0, row_sum, 1.0)
            split_row = (i * GROUP_SIZE * tl.num_programs(1) + heads) * NUM_SPLITS + s  # [n, np, NUM_SPLITS]
            tl.store(partial + split_row[:, None] * HEAD_DIM_PAD + dims[None, :], acc / safe_sum[:, None],
                     mask=row_ok[:, None])
            tl.store(lse + split_row, row_max + tl.log2(safe_sum), mask=row_ok)

    @triton.jit
    def _merge_splits_kernel(partial, lse, output, sinks, stride_on, stride_oh, stride_od, HEAD_DIM: tl.constexpr,
                             HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                             HAS_SINKS: tl.constexpr):
        """Program (i, h): output[i, h] = the splits' partial results weighted by their sums of
        exponentials (2 ** log-sum-exp), over that total plus the sink's exp(z) with sinks."""
        i = tl.program_id(0)
        h = tl.program_id(1)
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        split_row = (i * tl.num_programs(1) + h) * NUM_SPLITS + splits
        split_ok = splits < NUM_SPLITS
        split_lse = tl.load(lse + split_row, mask=split_ok, other=float("-inf"))
        weights = tl.exp2(split_lse - tl.max(split_lse, 0))  # split 0 is never empty: the max is finite
        values = tl.load(partial + split_row[:, None] * HEAD_DIM_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
        split_max = tl.max(split_lse, 0)
        total = tl.sum(weights, 0)
        if HAS_SINKS:
            total += tl.exp2(tl.load(sinks + h) * 1.4426950408889634 - split_max)
        merged = tl.sum(values * weights[:, None], 0) / total
        tl.store(output + i * stride_on + h * stride_oh + dims * stride_od, merged.to(output.dtype.element_ty),
                 mask=dims < HEAD_DIM)
