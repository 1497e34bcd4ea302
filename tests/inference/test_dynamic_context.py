"""The paged KV cache: the block allocator's free list, reference counts, prefix registry and LRU
eviction; the buffer's size from the memory budget; and `attend` over blocks equals causal
attention over each request's whole sequence (GQA, chunks of any size, steps mixing requests)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from teratron.inference.config import InferenceConfig
from teratron.inference.contexts import DynamicInferenceContext, KVBlockAllocator, StepChunk
from teratron.inference.contexts.kv_block_allocator import block_hash

HEADS, GROUPS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def test_allocator_hands_out_free_blocks_then_evicts_least_recently_released_cached_ones():
    allocator = KVBlockAllocator(4)
    a = allocator.allocate(3)
    assert a == [0, 1, 2] and allocator.num_allocatable() == 1
    allocator.register(0, b"h0")
    allocator.register(1, b"h1")
    allocator.retain([0])  # a second request shares block 0
    assert allocator.ref_counts[:3] == [2, 1, 1]
    allocator.release(a[::-1])
    # Block 2 (unregistered) is free again; 1 is cached and evictable; 0 is still referenced.
    assert allocator.num_free == 2 and allocator.num_cached == 2 and allocator.num_allocatable() == 3
    assert allocator.num_allocatable(excluding=[1]) == 2
    assert allocator.lookup([b"h0", b"h1", b"h2"]) == [0, 1] and allocator.lookup([b"h1"]) == [1]
    allocator.release([0])
    assert allocator.allocate(2) == [2, 3]  # the free list before any cached block
    assert allocator.allocate(1) == [1]  # 1 was released before 0: evicted first
    assert allocator.lookup([b"h0", b"h1"]) == [0] and allocator.num_cached == 1
    with pytest.raises(RuntimeError):
        allocator.allocate(2)


def test_a_prefix_cached_twice_keeps_its_first_block():
    allocator = KVBlockAllocator(2)
    allocator.allocate(2)
    allocator.register(0, b"h")
    allocator.register(1, b"h")
    allocator.release([1, 0])
    assert allocator.lookup([b"h"]) == [0] and allocator.num_free == 1


def test_block_hash_covers_the_whole_prefix():
    first = block_hash(None, [1, 2])
    assert block_hash(first, [3, 4]) != block_hash(block_hash(None, [9, 2]), [3, 4])
    assert block_hash(first, [3, 4]) == block_hash(block_hash(None, [1, 2]), [3, 4])


def _context(buffer_size_gb=1e-4, prefix_caching=False, layers=(3, 5)):
    config = InferenceConfig(buffer_size_gb=buffer_size_gb, block_size=BLOCK, prefix_caching=prefix_caching)
    return DynamicInferenceContext(config, layers, GROUPS, HEAD_DIM, torch.float32, "cpu", max_seq_length=64)


def test_the_buffer_holds_as_many_blocks_as_the_budget_allows():
    context = _context(buffer_size_gb=1e-4)
    per_block = 2 * 2 * BLOCK * GROUPS * HEAD_DIM * 4  # K and V, 2 layers, fp32
    # 104 blocks fit the budget; the last is the scratch block, where padding tokens write.
    assert int(1e-4 * 1024**3) // per_block == 104
    assert context.num_blocks == 103 and context.scratch_block == 103
    assert context.memory_buffer.shape == (2, 2, 104, BLOCK, GROUPS, HEAD_DIM)
    with pytest.raises(ValueError, match="buffer_size_gb=1e-09 holds no KV block") as error:
        _context(buffer_size_gb=1e-9)
    assert "\n" not in str(error.value)


def test_config_refusals_name_the_flag_in_one_line():
    for kwargs, message in [(dict(buffer_size_gb=0), "buffer_size_gb=0 must be > 0"),
                            (dict(block_size=0), "block_size=0 must be an integer >= 1"),
                            (dict(max_tokens_per_step=1.5), "max_tokens_per_step=1.5 must be an integer >= 1"),
                            (dict(max_seq_length=1), "max_seq_length=1 must be an integer >= 2"),
                            (dict(prefix_caching_mamba_gb=-1.0), "prefix_caching_mamba_gb=-1.0 must be >= 0"),
                            (dict(mamba_memory_ratio=1.0), "mamba_memory_ratio=1.0 must be between 0 and 1")]:
        with pytest.raises(ValueError, match=message) as error:
            InferenceConfig(**kwargs)
        assert "\n" not in str(error.value)


def _reference(q, k, v):
    """Causal GQA attention over one whole sequence: q [s, np, hn], k, v [s, ng, hn] -> [s, np, hn]."""
    k, v = (x.repeat_interleave(HEADS // GROUPS, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), is_causal=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("paged_query_limit", [16, 2])
def test_attend_over_blocks_equals_causal_attention_of_each_whole_sequence(paged_query_limit):
    """Chunks of up to paged_query_limit tokens attend with the paged kernel, longer ones as SDPA
    batches: 16, every chunk paged; 2, the prefill chunks of 4 and 5 tokens by SDPA."""
    torch.manual_seed(0)
    context = _context()
    context.paged_query_limit = paged_query_limit
    lengths = {0: 11, 1: 3, 2: 7}
    q = {r: torch.randn(n, HEADS, HEAD_DIM) for r, n in lengths.items()}
    k = {r: torch.randn(n, GROUPS, HEAD_DIM) for r, n in lengths.items()}
    v = {r: torch.randn(n, GROUPS, HEAD_DIM) for r, n in lengths.items()}
    for r in lengths:
        context.add_request(r)
    # Steps mixing prefill chunks (crossing block ends) and single decode tokens; request 2 joins late.
    steps = [{0: (0, 5), 1: (0, 2)}, {0: (5, 6), 1: (2, 3), 2: (0, 4)}, {0: (6, 11), 2: (4, 5)}, {2: (5, 7)}]
    for step in steps:
        chunks = [StepChunk(r, list(range(lengths[r])), start, end) for r, (start, end) in step.items()]
        for chunk in chunks:
            context.reserve(chunk.request_id, chunk.end)
        input_ids, position_ids = context.initialize_attention_state(chunks)
        assert position_ids.tolist() == [[p for c in chunks for p in range(c.start, c.end)]]
        assert input_ids.tolist() == position_ids.tolist()  # token i of each request is i here
        cat = lambda x: torch.cat([x[c.request_id][c.start:c.end] for c in chunks])[:, None]  # noqa: E731
        for layer in (3, 5):  # each layer keeps its own keys: the second gets them scaled
            scale = 1.0 if layer == 3 else 2.0
            out = context.attend(layer, cat(q), cat(k) * scale, cat(v) * scale)
            expected = torch.cat([_reference(q[c.request_id][:c.end], k[c.request_id][:c.end] * scale,
                                             v[c.request_id][:c.end] * scale)[c.start:] for c in chunks])
            assert_close(out, expected.reshape(-1, 1, HEADS * HEAD_DIM), rtol=1e-5, atol=1e-5)
    assert [len(context.block_tables[r]) for r in lengths] == [math.ceil(n / BLOCK) for n in lengths.values()]
    for r in lengths:
        context.release(r)
    assert context.allocator.num_free == context.num_blocks


def test_softmax_scale_and_padding_to_a_token_multiple():
    """2 tokens padded to 4 (token_multiple, the TP size): the padding is stored in the scratch
    block only, attended by nothing, and its output is zero."""
    config = InferenceConfig(buffer_size_gb=1e-4, block_size=BLOCK)
    context = DynamicInferenceContext(config, [1], GROUPS, HEAD_DIM, torch.float32, "cpu", softmax_scale=0.3,
                                      token_multiple=4, max_seq_length=64)
    q = torch.randn(4, 1, HEADS, HEAD_DIM)
    k, v = torch.randn(4, 1, GROUPS, HEAD_DIM), torch.randn(4, 1, GROUPS, HEAD_DIM)
    context.add_request(0)
    context.reserve(0, 2)
    input_ids, position_ids = context.initialize_attention_state([StepChunk(0, [7, 8], 0, 2)])
    assert input_ids.tolist() == [[7, 8, 0, 0]] and position_ids.tolist() == [[0, 1, 0, 0]]
    out = context.attend(1, q, k, v)
    kk, vv = (x[:2, 0].repeat_interleave(2, dim=1).transpose(0, 1) for x in (k, v))
    expected = F.scaled_dot_product_attention(q[:2, 0].transpose(0, 1), kk, vv, is_causal=True, scale=0.3)
    assert_close(out[:2], expected.transpose(0, 1).reshape(2, 1, -1))
    assert torch.equal(out[2:], torch.zeros(2, 1, HEADS * HEAD_DIM))
    assert torch.equal(context.memory_buffer[0, 0, 0, :2], k[:2, 0])
    real_blocks = context.memory_buffer[:, :, :context.scratch_block]
    assert real_blocks.count_nonzero() == 2 * 2 * GROUPS * HEAD_DIM  # K and V of 2 tokens


def test_prefix_caching_registers_full_blocks_and_finds_the_longest_cached_prefix():
    context = _context(prefix_caching=True)
    tokens = list(range(100, 111))  # 2 full blocks and 3 tokens
    context.add_request(0)
    context.reserve(0, 11)
    context.initialize_attention_state([StepChunk(0, tokens, 0, 11)])
    context.commit_step()
    assert context.allocator.num_cached == 2
    assert context.cached_prefix(tokens) == context.block_tables[0][:2]
    # The last token is always computed: 8 tokens match 1 block, not 2.
    assert context.cached_prefix(tokens[:8]) == context.block_tables[0][:1]
    assert context.cached_prefix([7] + tokens[1:]) == []
    shared = context.cached_prefix(tokens[:9] + [0, 0, 0])
    context.add_request(1, shared, tokens[:9] + [0, 0, 0])
    assert context.allocator.ref_counts[shared[0]] == 2
    context.release(0)
    context.release(1)
    assert context.allocator.num_cached == 2 and context.allocator.num_allocatable() == context.num_blocks


def test_a_padded_decode_step_equals_causal_attention_and_writes_padding_to_the_scratch_block():
    """initialize_decode_state: 3 requests in 5 rows (the step a CUDA graph of 5 rows replays)."""
    torch.manual_seed(0)
    context = _context()
    lengths = {0: 6, 1: 1, 2: 9}  # prompt lengths; each then decodes one token
    q = {r: torch.randn(n + 1, HEADS, HEAD_DIM) for r, n in lengths.items()}
    k = {r: torch.randn(n + 1, GROUPS, HEAD_DIM) for r, n in lengths.items()}
    v = {r: torch.randn(n + 1, GROUPS, HEAD_DIM) for r, n in lengths.items()}
    for r, n in lengths.items():
        context.add_request(r)
        context.reserve(r, n + 1)
    prefill = [StepChunk(r, list(range(n + 1)), 0, n) for r, n in lengths.items()]
    context.initialize_attention_state(prefill)
    cat = lambda x, chunks: torch.cat([x[c.request_id][c.start:c.end] for c in chunks])[:, None]  # noqa: E731
    context.attend(3, cat(q, prefill), cat(k, prefill), cat(v, prefill))
    before = context.memory_buffer[:, :, :context.scratch_block].clone()
    decode = [StepChunk(r, [100 + r] * (n + 1), n, n + 1) for r, n in lengths.items()]
    input_ids, position_ids = context.initialize_decode_state(decode, 5)
    assert input_ids.tolist() == [[100, 101, 102, 0, 0]] and position_ids.tolist() == [[6, 1, 9, 0, 0]]
    pad = lambda x: torch.cat([cat(x, decode), torch.randn(2, 1, *x[0].shape[1:])])  # noqa: E731
    out = context.attend(3, pad(q), pad(k), pad(v))
    expected = torch.cat([_reference(q[r], k[r], v[r])[-1:] for r in lengths])
    assert_close(out[:3], expected.reshape(3, 1, HEADS * HEAD_DIM), rtol=1e-5, atol=1e-5)
    after = context.memory_buffer[:, :, :context.scratch_block]
    written = (after != before).any(dim=(-2, -1))  # [2, layers, blocks, block_size]
    assert written.sum() == 2 * 3  # K and V of the 3 decode tokens, in layer 3 only
    with pytest.raises(ValueError, match="a decode step of 3 requests in 2 rows"):
        context.initialize_decode_state(decode, 2)


def test_cuda_graph_batch_sizes_cover_every_decode_step():
    from teratron.inference.cuda_graphs import cuda_graph_batch_sizes
    assert cuda_graph_batch_sizes(256, 16) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert cuda_graph_batch_sizes(6, -1) == [1, 2, 3, 4, 5, 6]
    assert cuda_graph_batch_sizes(64, 1) == [64]
    four = cuda_graph_batch_sizes(256, 4)
    assert len(four) == 4 and four[-1] == 256 and four[0] == 1
    assert cuda_graph_batch_sizes(10, 16) == [1, 2, 3, 4, 6, 8, 10]
