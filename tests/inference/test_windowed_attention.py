"""The inference reference of sliding windows and attention sinks (teratron.inference.
windowed_attention) against a loop over each query's visible keys, for prefill chunks that start
after cached tokens, GQA and padded query rows; and the layer attributes it reads."""

import math

import pytest
import torch

from teratron.inference.windowed_attention import attend, window_mask
from teratron.models.gpt import get_gpt_layer_local_spec
from teratron.transformer.spec_utils import build_module
from teratron.transformer.transformer_config import TransformerConfig


def looped(q, k, v, query_positions, scale, left, sink):
    """Float64: query (r, h, i) at position p sees keys max(0, p - left) .. p of its row."""
    rows, heads, num_queries, _ = q.shape
    per_group = heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r in range(rows):
        for h in range(heads):
            for i in range(num_queries):
                p = int(query_positions[r, i])
                keys = [j for j in range(k.shape[2]) if j <= p and (left < 0 or p - j <= left)]
                logits = torch.stack([q[r, h, i].double() @ k[r, h // per_group, j].double() * scale for j in keys])
                extra = torch.zeros(0, dtype=torch.float64) if sink is None else sink[h:h + 1].double()
                weights = torch.softmax(torch.cat([logits, extra]), 0)[:len(keys)]
                out[r, h, i] = sum(w * v[r, h // per_group, j].double() for w, j in zip(weights, keys))
    return out


@pytest.mark.parametrize("left", [-1, 0, 3])
@pytest.mark.parametrize("with_sink", [False, True])
def test_prefill_batch_with_window_and_sink_equals_the_loop(left, with_sink):
    torch.manual_seed(0)
    rows, heads, groups, num_queries, num_keys, hn = 2, 4, 2, 5, 12, 8
    q = torch.randn(rows, heads, num_queries, hn)
    k, v = torch.randn(rows, groups, num_keys, hn), torch.randn(rows, groups, num_keys, hn)
    # Row 0: a chunk at positions 6..10 after 6 cached tokens; row 1: positions 0..2, then padding
    # queries at position 0 (they see key 0, like the context's padding).
    query_positions = torch.tensor([[6, 7, 8, 9, 10], [0, 1, 2, 0, 0]])
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0]) if with_sink else None
    window = None if left < 0 else (left, 0)
    mask = window_mask(query_positions[:, None, :], torch.arange(num_keys), window)  # [R, 1, Q, K]
    assert mask.shape == (rows, 1, num_queries, num_keys)
    out = attend(q, k, v, mask, 1 / math.sqrt(hn), sink)
    torch.testing.assert_close(out.double(), looped(q, k, v, query_positions, 1 / math.sqrt(hn), left, sink),
                               rtol=1e-5, atol=1e-6)


def test_window_mask_is_the_causal_mask_without_a_window():
    positions = torch.tensor([[3, 4]])
    causal = torch.arange(6)[None, None, :] <= positions[:, :, None]
    assert torch.equal(window_mask(positions, torch.arange(6)), causal)
    assert torch.equal(window_mask(positions, torch.arange(6), (-1, 0)), causal)
    assert window_mask(positions, torch.arange(6), (1, 0))[0].int().tolist() == [[0, 0, 1, 1, 0, 0],
                                                                                  [0, 0, 0, 1, 1, 0]]


def test_the_layer_attributes_the_engine_reads():
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, window_size=(8, 0),
                               window_attn_skip_freq=2, softmax_type="learnable", use_cpu_initialization=True)
    cores = [build_module(get_gpt_layer_local_spec(), config=config, layer_number=n).self_attention.core_attention
             for n in (1, 2)]
    assert [c.window_size for c in cores] == [(8, 0), None]
    assert all(c.softmax_offset.shape == (4,) for c in cores)
