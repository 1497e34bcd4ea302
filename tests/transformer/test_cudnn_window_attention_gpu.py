"""Causal sliding-window attention on cuDNN's native band (teratron/transformer/cudnn_window_attention.py)
against fp32 attention over the band written out: bf16 inputs, the output and the gradients of q,
k and v compared with the reference at bf16's resolution. Then DotProductAttention on the GPU: a
causal window runs there (eager and compiled) and equals the reference backend (unfused); flash,
a sink, or the frontend missing keep FlexAttention; no CUDA window runs banded."""

import pytest
import torch

from teratron.transformer import banded_attention, cudnn_window_attention, dot_product_attention
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.transformer_config import TransformerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_frontend = pytest.mark.skipif(not cudnn_window_attention.PACKAGE_FOUND,
                                    reason="needs the cuDNN frontend: pip install teratron[cudnn]")


def _band_reference(q, k, v, window, scale):
    """fp32 attention over keys i - window .. i (Megatron's causal window (window, 0))."""
    q, k, v = q.float(), k.float(), v.float()
    heads, s = q.shape[1], q.shape[2]
    k, v = k.repeat_interleave(heads // k.shape[1], 1), v.repeat_interleave(heads // v.shape[1], 1)
    i = torch.arange(s, device=q.device)[:, None]
    j = torch.arange(s, device=q.device)[None, :]
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~((j <= i) & (i - j <= window)), float("-inf"))
    return torch.softmax(scores, -1) @ v


def _close(ours, reference):
    """Equal at bf16's resolution, the absolute tolerance scaled by the tensor's largest entry."""
    reference = reference.float()
    torch.testing.assert_close(ours.float(), reference, rtol=2e-2, atol=2e-2 * max(1.0, reference.abs().max().item()))


def _layer_views(b, heads, s, h, dtype=torch.bfloat16):
    """A leaf [s, b, heads, h] (the layer's layout) and its [b, heads, s, h] view."""
    leaf = torch.randn(s, b, heads, h, device="cuda", dtype=dtype, requires_grad=True)
    return leaf, leaf.permute(1, 2, 0, 3)


@needs_frontend
@pytest.mark.parametrize("s, window, n, g, h", [
    (1000, 128, 8, 2, 64),     # a sequence not a multiple of 128, GQA
    (2048, 1024, 8, 8, 128),   # the benchmark's window
    (1000, 4, 8, 2, 64),       # narrow: one key more or less would show (cuDNN's bound is W + 1)
    (1000, 999, 8, 2, 64),     # W = s - 1: every causal key, no left bound
    (600, 1024, 4, 1, 128),    # W >= s, multi-query
])
def test_cudnn_window_equals_the_band(s, window, n, g, h):
    """Inputs as the layer passes them (views of [s, b, n, h]); batch 2; forward and backward."""
    torch.manual_seed(0)
    b, scale = 2, 0.125
    leaves_views = [_layer_views(b, heads, s, h) for heads in (n, g, g)]
    leaves = [leaf for leaf, _ in leaves_views]
    q, k, v = (view for _, view in leaves_views)
    assert cudnn_window_attention.available(q, k, v, (window, 0), True, 0.0, None)
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]  # fp32 copies: fp32 gradients
    expected = _band_reference(*exact, window, scale)
    dout = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, exact, dout)
    out = cudnn_window_attention.cudnn_window_attention(q, k, v, window, scale)
    assert out.shape == (b, n, s, h) and out.permute(2, 0, 1, 3).is_contiguous()  # laid out [s, b, n, h]
    _close(out, expected)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    for grad, reference in zip(grads, expected_grads, strict=True):
        _close(grad.permute(1, 2, 0, 3), reference)


@needs_frontend
def test_contiguous_inputs_half_precision_and_an_expanded_gradient():
    """[b, n, s, h] contiguous fp16 inputs, and out.sum()'s gradient (expanded: stride 0, copied
    before cuDNN sees it)."""
    torch.manual_seed(0)
    b, n, g, s, h, window, scale = 1, 4, 2, 777, 64, 100, 0.2
    q, k, v = (torch.randn(b, heads, s, h, device="cuda", dtype=torch.float16, requires_grad=True)
               for heads in (n, g, g))
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = _band_reference(*exact, window, scale)
    out = cudnn_window_attention.cudnn_window_attention(q, k, v, window, scale)
    _close(out, expected)
    for grad, reference in zip(torch.autograd.grad(out.sum(), (q, k, v)),
                               torch.autograd.grad(expected.sum(), exact), strict=True):
        _close(grad, reference)


@needs_frontend
def test_mla_head_sizes_run_where_cudnn_supports_them():
    """Queries and keys of 192 channels, values of 128 (MLA): cuDNN runs them on Hopper; elsewhere
    `available` says no."""
    torch.manual_seed(0)
    q, k = (torch.randn(1, 4, 512, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 4, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert cudnn_window_attention.available(q, k, v, (64, 0), True, 0.0, None) == hopper
    if not hopper:
        return
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = _band_reference(*exact, 64, 0.1)
    out = cudnn_window_attention.cudnn_window_attention(q, k, v, 64, 0.1)
    _close(out, expected)
    dout = torch.randn_like(expected)
    for grad, reference in zip(torch.autograd.grad(out, (q, k, v), dout.to(out.dtype)),
                               torch.autograd.grad(expected, exact, dout), strict=True):
        _close(grad, reference)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Which windowed kernel DotProductAttention called: 'cudnn', 'flex' or 'banded'."""
    calls = []

    def counted(name, module, attribute):
        run = getattr(module, attribute)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return run(*args, **kwargs)
        monkeypatch.setattr(module, attribute, wrapper)
    counted("cudnn", cudnn_window_attention, "cudnn_window_attention")
    counted("flex", dot_product_attention, "flex_attention_with_sink")
    counted("banded", banded_attention, "banded_attention")
    return calls


def _layer_against_reference(backend, softmax_type="vanilla", compiled=False):
    """DotProductAttention, bf16, window (512, 0), 1,500 tokens, batch 2, GQA 8 / 2 heads of 64,
    against the unfused reference layer in fp32 on the same values: the output and the gradients
    of q, k, v (and of the learned sink)."""
    torch.manual_seed(0)
    s, b, n, g, hn = 1500, 2, 8, 2, 64
    q = torch.randn(s, b, n, hn, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(s, b, g, hn, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    upstream = torch.randn(s, b, n * hn, device="cuda", dtype=torch.bfloat16)
    results = []
    for layer_backend, dtype in ((backend, torch.bfloat16), ("unfused", torch.float32)):
        config = TransformerConfig(num_layers=1, hidden_size=n * hn, num_attention_heads=n, num_query_groups=g,
                                   window_size=(512, 0), softmax_type=softmax_type, attention_backend=layer_backend,
                                   attention_dropout=0.0, hidden_dropout=0.0, params_dtype=dtype,
                                   bf16=dtype == torch.bfloat16)
        attention = DotProductAttention(config, layer_number=1)
        if softmax_type == "learnable":
            with torch.no_grad():
                attention.softmax_offset.copy_(torch.linspace(-3, 3, n))
        run = torch.compile(attention) if compiled and layer_backend == backend else attention
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        (out * upstream.to(dtype)).sum().backward()
        sink = [attention.softmax_offset.grad] if softmax_type == "learnable" else []
        results.append([out] + [t.grad for t in leaves] + sink)
    for ours, reference in zip(*results, strict=True):
        _close(ours, reference)


@needs_frontend
@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_layer_runs_a_causal_window_on_cudnn(kernel_calls, backend):
    _layer_against_reference(backend)
    assert kernel_calls == ["cudnn"]


@needs_frontend
def test_compiled_layer_traces_through_the_cudnn_ops(kernel_calls):
    """A layer compiled whole (--torch-compile): the custom ops run inside its graph, no graph
    break needed, and the result equals the reference."""
    _layer_against_reference("auto", compiled=True)
    assert "cudnn" in kernel_calls and set(kernel_calls) == {"cudnn"}


@pytest.mark.parametrize("case", ["flash backend", "learned sink", "frontend missing"])
def test_other_cuda_windows_run_flex_attention(kernel_calls, monkeypatch, case):
    """attention_backend flash keeps windows off cuDNN; the frontend has no sink input; without
    the frontend every CUDA window runs FlexAttention. None runs banded on CUDA."""
    if case == "frontend missing":
        monkeypatch.setattr(cudnn_window_attention, "PACKAGE_FOUND", False)
    _layer_against_reference("flash" if case == "flash backend" else "auto",
                             "learnable" if case == "learned sink" else "vanilla")
    assert kernel_calls == ["flex"]
