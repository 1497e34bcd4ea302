"""Decode attention over the paged KV cache on one GPU: the Triton kernel
(teratron.inference.kernels.paged_attention) against the gather + SDPA of
DynamicInferenceContext._attend_batch (the blocks of every request copied out, then SDPA with a
boolean mask). np = ng = 16, hn = 128, bf16, block 16; batch 1 (context 768) and batch 256
(contexts 512 .. 768). Prints µs per call, eager and replayed from a CUDA graph, and the GB/s of
keys and values read (their bytes / time). L2 is flushed before every call (triton's do_bench),
as a decode step reads each layer's cache once.

    PYTHONPATH=. python bench/paged_attention_bench.py
"""

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from teratron.inference.kernels.paged_attention import paged_attention

HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 128, 16, torch.bfloat16


def make_inputs(lengths: list[int]):
    """query [n, np, hn], caches [num_blocks, 16, ng, hn] (requests' blocks shuffled), block table
    int32 [n, max_blocks], kv_lengths int32 [n]."""
    used = [-(-length // BLOCK_SIZE) for length in lengths]
    num_blocks = sum(used)
    order = torch.randperm(num_blocks, device="cuda").int()
    table = torch.zeros(len(lengths), max(used), dtype=torch.int32, device="cuda")
    first = 0
    for row, count in enumerate(used):
        table[row, :count] = order[first:first + count]
        first += count
    caches = torch.randn(2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    query = torch.randn(len(lengths), HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return query, caches[0], caches[1], table, torch.tensor(lengths, dtype=torch.int32, device="cuda")


def gather_sdpa(query, key_cache, value_cache, block_table, kv_lengths, softmax_scale):
    """The engine's decode path today: [n, B * bs] keys gathered per request, masked SDPA."""
    n = query.shape[0]
    keys, values = (cache[block_table.long()].flatten(1, 2).transpose(1, 2) for cache in (key_cache, value_cache))
    mask = torch.arange(keys.shape[2], device=query.device) < kv_lengths[:, None]  # [n, B * bs]
    context = F.scaled_dot_product_attention(query[:, :, None], keys, values, attn_mask=mask[:, None, None],
                                             scale=softmax_scale)
    return context.view(n, HEADS, HEAD_DIM)


def microseconds(function, args, graphed: bool) -> float:
    if graphed:
        function(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            function(*args)
        return do_bench(graph.replay) * 1e3
    return do_bench(lambda: function(*args)) * 1e3


def main() -> None:
    torch.manual_seed(0)
    workloads = {"batch 1, context 768": [768],
                 "batch 256, contexts 512-768": torch.randint(512, 769, (256,)).tolist()}
    print(f"{torch.cuda.get_device_name()}: np = ng = {HEADS}, hn = {HEAD_DIM}, bf16, block {BLOCK_SIZE}")
    for name, lengths in workloads.items():
        args = (*make_inputs(lengths), HEAD_DIM ** -0.5)
        error = (paged_attention(*args).float() - gather_sdpa(*args).float()).abs().max().item()
        kv_bytes = 2 * sum(lengths) * HEADS * HEAD_DIM * args[1].element_size()
        print(f"{name}: {kv_bytes / 1e6:.1f} MB of keys and values; max |triton - gather+sdpa| = {error:.2e}")
        for label, function in (("triton paged_attention", paged_attention), ("gather + SDPA", gather_sdpa)):
            times = [microseconds(function, args, graphed) for graphed in (False, True)]
            print(f"  {label:24s} eager {times[0]:8.1f} µs ({kv_bytes / times[0] / 1e3:6.0f} GB/s)   "
                  f"graph {times[1]:8.1f} µs ({kv_bytes / times[1] / 1e3:6.0f} GB/s)")


if __name__ == "__main__":
    main()
