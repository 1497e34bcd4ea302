"""Context-parallel core attention (teratron/transformer/context_parallel.py) against attention
over the whole sequence in one process.

Single process: the load-balanced split, the block plans, and the log-sum-exp merge and per-block
backward that the exchanged types rely on. Four gloo ranks: DotProductAttention under CP 2 and
CP 4 with every cp_comm_type (a2a+p2p as 2 x 2), with GQA, an attention sink, a sliding window,
value heads narrower than the query heads (MLA), packed documents (both layouts) and the
reference backend: each rank's output and the gradients of its q, k, v (and the sink) equal
those rows of the single process's.
"""

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from teratron.packed_seq_params import PackedSeqParams, cu_seqlens_from_documents, document_ids
from teratron.process_groups import ProcessGroupCollection
from teratron.transformer import context_parallel as cp
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.transformer_config import TransformerConfig


def test_each_rank_keeps_chunks_r_and_mirror():
    assert cp.cp_token_ranges(16, 2, 0) == [(0, 4), (12, 16)]
    assert cp.cp_token_ranges(16, 2, 1) == [(4, 8), (8, 12)]
    assert cp.cp_token_index(16, 4, 1).tolist() == [2, 3, 12, 13]
    # Packed documents: each one cut in 2 x CP chunks; tokens past the last boundary are one more.
    assert cp.cp_token_ranges(16, 2, 1, [0, 8, 12]) == [(2, 4), (4, 6), (9, 10), (10, 11), (13, 14), (14, 15)]
    every = sorted(torch.cat([cp.cp_token_index(24, 3, r) for r in range(3)]).tolist())
    assert every == list(range(24))
    with pytest.raises(ValueError, match="2 x CP = 4 equal chunks"):
        cp.cp_token_ranges(10, 2, 0)


def test_block_plans_of_the_ring():
    """CP 4, rank 1 holds chunks 1 and 6 of 8: its own keys causally, rank 0's (chunks 0, 7)
    with every query on chunk 0, rank 2's (2, 5) and rank 3's (3, 4) with the queries of chunk 6."""
    layout = cp.TokenLayout([cp.cp_token_ranges(16, 4, r) for r in range(4)], 16)

    def plan(j):
        return [(b.q, b.kv, b.kind) for b in layout.blocks((1,), (j,), True, None, False, "cpu")]
    assert plan(1) == [(slice(None), slice(None), "causal")]
    assert plan(0) == [(slice(0, 4), slice(0, 2), "full")]
    assert plan(2) == [(slice(2, 4), slice(0, 4), "full")]
    assert plan(3) == [(slice(2, 4), slice(0, 4), "full")]
    masked = layout.blocks((1,), (0,), True, (3, 0), False, "cpu")
    assert [b.kind for b in masked] == ["masked"]
    queries, keys = torch.tensor([2, 3, 12, 13])[:, None], torch.tensor([0, 1, 14, 15])
    expected = (queries >= keys) & (queries - keys <= 3)
    assert torch.equal(masked[0].mask.dense()[0, 0], expected)


def _reference(q, k, v, allowed, scale):
    k, v = cp._expand_groups(k, v, q.shape[1])
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("kernel", ["flash", "masked"])
def test_merged_blocks_and_their_backward_equal_whole_attention(kernel):
    """Keys cut in three blocks: merged forward and summed per-block backward (from the final
    output and log-sum-exp) equal attention over all keys, with GQA and narrower values (fp32:
    the merge accumulates in fp32)."""
    torch.manual_seed(0)
    b, n, g, s, hq, hv, scale = 2, 4, 2, 12, 8, 6, 0.3
    q = torch.randn(b, n, s, hq, requires_grad=True)
    k = torch.randn(b, g, s, hq, requires_grad=True)
    v = torch.randn(b, g, s, hv, requires_grad=True)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    expected = _reference(q, k, v, causal, scale)
    dout = torch.randn_like(expected)
    expected.backward(dout)
    cuts = [(0, 5), (5, 9), (9, 12)]
    merged = cp._Merged(q, hv)
    blocks = []
    for start, end in cuts:  # queries 5.. see block 0 whole; the diagonal blocks causally
        for qs, qe in cuts:
            if qs < start:
                continue
            if kernel == "flash":
                kind, mask = ("causal" if qs == start else "full"), None
            else:
                kind, mask = "masked", cp.KeyMask(torch.arange(qs, qe), torch.arange(start, end), causal=True)
            blocks.append(cp.Block(slice(qs, qe), slice(start, end), kind, mask))
    with torch.no_grad():
        for block in blocks:
            merged.add(block.q, *cp.block_forward(block, q, k, v, scale, False))
        out = merged.out.to(q.dtype)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for block in blocks:
            gq, gk, gv = cp.block_backward(block, dout, q, k, v, out, merged.lse, scale, False)
            grads[0][:, :, block.q] += gq
            grads[1][:, :, block.kv] += gk
            grads[2][:, :, block.kv] += gv
    for grad, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(grad, t.grad, rtol=1e-5, atol=1e-6)


def test_packed_sequence_documents():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2], [3, 3, 4, 4, 4, 4]])
    cu = cu_seqlens_from_documents(documents)
    assert cu.tolist() == [0, 3, 5, 6, 8, 12] and cu.dtype == torch.int32
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu)
    assert document_ids(params, 2, 6, "cpu").tolist() == [[0, 0, 0, 1, 1, 2], [3, 3, 4, 4, 4, 4]]
    with pytest.raises(ValueError, match="only self-attention"):
        PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_kv=cu + 1)


# ----- four ranks -----------------------------------------------------------------------------

S, B, HEADS, GROUPS, HQ = 16, 2, 4, 2, 8


def _config(cp_size=1, **kwargs):
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=HEADS, num_query_groups=GROUPS,
                             kv_channels=HQ, attention_dropout=0.0, context_parallel_size=cp_size,
                             use_cpu_initialization=True, **kwargs)


def _inputs(hv, batch=B, length=S):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(length, batch, HEADS, HQ, generator=gen)
    k = torch.randn(length, batch, GROUPS, HQ, generator=gen)
    v = torch.randn(length, batch, GROUPS, hv, generator=gen)
    dout = torch.randn(length, batch, HEADS * hv, generator=gen)
    return q, k, v, dout


def _run(attention, q, k, v, dout, mask):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, mask)
    out.backward(dout)
    sink = attention.softmax_offset
    grads = [q.grad, k.grad, v.grad]
    if isinstance(sink, torch.nn.Parameter):
        grads.append(sink.grad.clone())
        sink.grad = None
    return out.detach(), grads


CASES = {  # name -> (config fields, value head size, packed layout)
    "plain": ({}, HQ, None),
    "sink": ({"softmax_type": "learnable"}, HQ, None),
    "window": ({"window_size": (5, 0)}, HQ, None),
    "mla heads": ({}, 6, None),
    "reference": ({"attention_backend": "unfused"}, HQ, None),
    "documents": ({}, HQ, "sbhd"),
    "thd": ({}, HQ, "thd"),
}


def _packed(layout):
    if layout == "sbhd":  # rows of 16 with documents of 5, 7, 4 and 16 tokens
        documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [3] * 16])
        return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens_from_documents(documents))
    # one row of 32: documents of 8, 16 and 8 (divisible by 2 x CP for CP 2 and 4)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8, 24, 32], dtype=torch.int32))


def _dense_mask(packed, batch, length):
    """[b, 1, s, s] True = masked out: a key in another document or after the query."""
    if packed is None:
        return None
    documents = document_ids(packed, batch, length, "cpu")
    allowed = (documents[:, :, None] == documents[:, None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    return ~allowed.unsqueeze(1)


def _cp_groups():
    """CP 4 over all ranks, CP 2 over {0, 1} and {2, 3}, and a2a+p2p's 2 x 2 levels."""
    world = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rank = dist.get_rank()
    return {2: ProcessGroupCollection(cp=pairs[rank // 2]),
            4: ProcessGroupCollection(cp=world, hcp=[pairs[rank // 2], strided[rank % 2]])}


def _check_all_comm_types():
    """Output, gradients and the max-logit record of every case and comm type against the single
    process's."""
    groups = _cp_groups()
    rank, failures, checked = dist.get_rank(), [], 0
    for name, (fields, hv, layout) in CASES.items():
        batch, length = (1, 2 * S) if layout == "thd" else (B, S)
        q, k, v, dout = _inputs(hv, batch, length)
        packed = _packed(layout) if layout else None
        torch.manual_seed(11)
        single = DotProductAttention(_config(log_max_attention_logit=True, **fields), layer_number=1)
        # The single process attends with a dense mask: documents as Megatron's s x s mask.
        expected, expected_grads = _run(single, q, k, v, dout, _dense_mask(packed, batch, length))
        for cp_size, comm_types in ((2, cp.CP_COMM_TYPES[:3]), (4, cp.CP_COMM_TYPES)):
            for comm_type in comm_types:
                extra = {"hierarchical_context_parallel_sizes": [2, 2]} if comm_type == "a2a+p2p" else {}
                config = _config(cp_size, cp_comm_type=comm_type, log_max_attention_logit=True, **extra, **fields)
                torch.manual_seed(11)
                attention = DotProductAttention(config, layer_number=1, pg_collection=groups[cp_size])
                cp_rank = rank % cp_size
                bounds = packed.boundaries.tolist() if layout == "thd" else None
                index = cp.cp_token_index(length, cp_size, cp_rank, bounds)
                local = [t.index_select(0, index) for t in (q, k, v, dout)]
                out, grads = _run(attention, *local, packed)
                wanted = [expected.index_select(0, index)] + [g.index_select(0, index) for g in expected_grads[:3]]
                got = [out] + grads[:3]
                if len(grads) == 4:  # the sink's gradient: summed over the CP ranks' queries
                    total = grads[3].clone()
                    dist.all_reduce(total, group=groups[cp_size].cp)
                    got.append(total)
                    wanted.append(expected_grads[3])
                # QK-clip's record: each rank's (its queries; under a2a its heads), max-reduced over CP.
                max_logits = attention.current_max_attn_logits.clone()
                dist.all_reduce(max_logits, op=dist.ReduceOp.MAX, group=groups[cp_size].cp)
                got.insert(0, max_logits)
                wanted.insert(0, single.current_max_attn_logits)
                for what, a, b in zip(["max logit", "out", "dq", "dk", "dv", "dsink"], got, wanted):
                    if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                        failures.append(f"{name} cp{cp_size} {comm_type} {what}: {(a - b).abs().max().item()}")
                checked += 1
    return failures, checked


def test_every_comm_type_equals_the_single_process():
    for failures, checked in run_distributed(_check_all_comm_types, 4):
        assert failures == [] and checked == len(CASES) * 7


def test_config_checks_what_each_comm_type_needs():
    assert _config(4, cp_comm_type=["a2a", "p2p"]).cp_comm_type == ["a2a", "p2p"]
    refusals = {
        "must be one of": dict(cp_comm_type=["p2p"]),  # one per layer: 2 layers
        "use p2p, all_gather, a2a, a2a\\+p2p": dict(cp_comm_type="ring"),
        "needs hierarchical_context_parallel_sizes of two levels": dict(cp_comm_type="a2a+p2p"),
        "splits the 4 attention heads of each tensor-parallel rank over 8": dict(cp_comm_type="a2a", cp_size=8),
        "has no dropout; set attention_dropout to 0 or use cp_comm_type 'a2a'": dict(attention_dropout=0.1),
    }
    for message, fields in refusals.items():
        fields = dict(fields)
        cp_size = fields.pop("cp_size", 4)
        with pytest.raises(ValueError, match=message) as error:
            TransformerConfig(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=HEADS,
                                        attention_dropout=0.0, context_parallel_size=cp_size), **fields})
        assert "\n" not in str(error.value)
    # a2a keeps autograd (its attention is local): dropout is fine there
    TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=HEADS, attention_dropout=0.1,
                      context_parallel_size=4, cp_comm_type="a2a")
