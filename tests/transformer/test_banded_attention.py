"""Causal sliding-window attention on the dense causal kernels (teratron/transformer/banded_attention.py)
against the band written out: scores of every (query, key) pair in float64, masked to keys j with
i - W <= j <= i, softmax (with the sink's logit as one more column), times the values; gradients
by autograd through that formula. Then DotProductAttention on the CPU (CUDA windows run cuDNN's
native band or FlexAttention, never banded: test_cudnn_window_attention_gpu.py): which windows
take the banded path, and that its output, gradients and QK-clip record equal the reference
backend's (unfused)."""

import pytest
import torch

from teratron.tensor_parallel.random import model_parallel_cuda_manual_seed
from teratron.transformer import banded_attention
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.enums import AttnMaskType
from teratron.transformer.transformer_config import TransformerConfig


def band_attention(q, k, v, window, scale, sink=None):
    """q [b, n, s, hq], k [b, g, s, hq], v [b, g, s, hv] -> [b, n, s, hv] in float64."""
    q, k, v = q.double(), k.double(), v.double()
    heads, groups, s = q.shape[1], k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(heads // groups, 1), v.repeat_interleave(heads // groups, 1)
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~((j <= i) & (i - j <= window)), float("-inf"))
    if sink is None:
        return torch.softmax(scores, -1) @ v
    sink_column = sink.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat([scores, sink_column], -1), -1)[..., :-1] @ v


def _inputs(b, heads, groups, s, hq, hv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, s, hq, generator=g, requires_grad=True),
            torch.randn(b, groups, s, hq, generator=g, requires_grad=True),
            torch.randn(b, groups, s, hv, generator=g, requires_grad=True))


@pytest.mark.parametrize("s, window", [(12, 4), (14, 4), (13, 5), (9, 16), (8, 8), (8, 7)])
@pytest.mark.parametrize("groups", [4, 2])
@pytest.mark.parametrize("with_sink", [False, True])
def test_banded_attention_equals_the_band(s, window, groups, with_sink):
    """Sequences a multiple of W and not, W >= s (one chunk), W = s - 1; GQA; a learned sink;
    batch 2: the output and the gradients of q, k, v and the sink equal the band's."""
    q, k, v = _inputs(2, 4, groups, s, 8, 8)
    sink = torch.tensor([1.5, -2.0, 0.3, 3.0], requires_grad=True) if with_sink else None
    leaves = [q, k, v] + ([sink] if with_sink else [])
    out = banded_attention.banded_attention(q, k, v, window, 0.3, sink)
    expected = band_attention(q, k, v, window, 0.3, sink)
    torch.testing.assert_close(out, expected.float())
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, leaves, dout)
    expected_grads = torch.autograd.grad(expected, leaves, dout.double())
    for grad, reference in zip(grads, expected_grads):
        torch.testing.assert_close(grad, reference.float())


def test_value_heads_narrower_than_query_heads():
    """MLA's shapes (values narrower than queries and keys): the kernels pad the heads."""
    q, k, v = _inputs(1, 2, 2, 11, 8, 6)
    out = banded_attention.banded_attention(q, k, v, 3, 0.5)
    expected = band_attention(q, k, v, 3, 0.5)
    torch.testing.assert_close(out, expected.float())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for grad, reference in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
        torch.testing.assert_close(grad, reference.float())


def _config(**overrides):
    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                  attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
    return TransformerConfig(**{**kwargs, **overrides})


@pytest.fixture
def banded_calls(monkeypatch):
    """How often DotProductAttention called banded_attention."""
    calls = []
    run = banded_attention.banded_attention

    def counted(*args, **kwargs):
        calls.append(args[3])  # the window
        return run(*args, **kwargs)
    monkeypatch.setattr(banded_attention, "banded_attention", counted)
    return calls


def _layer(backend, window, softmax_type="vanilla", **overrides):
    attention = DotProductAttention(_config(window_size=window, softmax_type=softmax_type, attention_backend=backend,
                                            **overrides), layer_number=1)
    if softmax_type == "learnable":
        with torch.no_grad():
            attention.softmax_offset.copy_(torch.tensor([1.5, -2.0, 0.3, 3.0]))
    return attention


def _forward_backward(attention, s, b=2):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(s, b, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    out = attention(q, k, v)
    out.backward(torch.randn(out.shape, generator=g))
    sink = [attention.softmax_offset.grad] if isinstance(attention.softmax_offset, torch.nn.Parameter) else []
    return [out, q.grad, k.grad, v.grad] + sink


@pytest.mark.parametrize("window, softmax_type", [((256, 0), "vanilla"), ((300, 0), "learnable"),
                                                  ((256, -1), "off-by-one")])
def test_layer_runs_a_wide_causal_window_banded(banded_calls, window, softmax_type):
    """Windows of at least MIN_WINDOW keys on a causal layer (the right side hidden by causality)
    run banded on the CPU, and equal the reference backend: 700 tokens, batch 2, GQA."""
    ours = _forward_backward(_layer("auto", window, softmax_type), 700)
    assert banded_calls == [window[0]]
    reference = _forward_backward(_layer("unfused", window, softmax_type), 700)
    assert banded_calls == [window[0]]
    for got, expected in zip(ours, reference, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["narrow window", "dropout", "unfused", "not causal", "no window"])
def test_other_layers_keep_their_paths(banded_calls, case):
    window = (255, 0) if case == "narrow window" else None if case == "no window" else (256, 0)
    overrides = {"dropout": dict(attention_dropout=0.1), "unfused": dict(attention_backend="unfused")}.get(case, {})
    mask_type = AttnMaskType.no_mask if case == "not causal" else AttnMaskType.causal
    config = _config(window_size=window, **{"attention_backend": "auto", **overrides})
    attention = DotProductAttention(config, layer_number=1, attn_mask_type=mask_type)
    q, k, v = torch.randn(300, 1, 4, 16), torch.randn(300, 1, 2, 16), torch.randn(300, 1, 2, 16)
    model_parallel_cuda_manual_seed(0)  # attention dropout draws from the tensor-parallel tracker
    attention(q, k, v)
    assert banded_calls == []
    if case == "dropout":  # not in training: no dropout, banded
        attention.eval()
        attention(q, k, v)
        assert banded_calls == [256]


def test_banded_layer_records_the_max_logit():
    """QK-clip's record is taken before the kernel runs: banded and reference layers record alike."""
    records = []
    for backend in ("auto", "unfused"):
        attention = _layer(backend, (256, 0), log_max_attention_logit=True)
        _forward_backward(attention, 600)
        records.append(attention.current_max_attn_logits)
    assert torch.isfinite(records[0]).all()
    torch.testing.assert_close(records[0], records[1], rtol=1e-6, atol=0)


def test_compiled_banded_layer_equals_eager(banded_calls):
    """A layer compiled whole (--torch-compile) runs the banded autograd function inside its graph."""
    attention = _layer("auto", (256, 0), "learnable")
    eager = _forward_backward(attention, 600)
    attention.softmax_offset.grad = None
    compiled = _forward_backward(torch.compile(attention), 600)
    assert banded_calls  # traced through at least once
    for got, expected in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
