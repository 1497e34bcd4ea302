"""The banded sliding window's CUDA kernels (aten's flash and cuDNN's fused attention, both with
log-sum-exp, and their backward given the merged output) against fp32 attention over the band:
bf16 inputs, each result compared with the fp32 reference at bf16's resolution. Then
DotProductAttention on the GPU: which kernel each attention_backend picks, and the banded
layer against the reference backend (unfused)."""

import pytest
import torch

from teratron.transformer import banded_attention
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.enums import AttnBackend
from teratron.transformer.transformer_config import TransformerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _band_reference(q, k, v, window, scale, sink=None):
    """fp32 attention over keys i - window .. i, the sink as one more logit."""
    q, k, v = q.float(), k.float(), v.float()
    heads, s = q.shape[1], q.shape[2]
    k, v = k.repeat_interleave(heads // k.shape[1], 1), v.repeat_interleave(heads // v.shape[1], 1)
    i = torch.arange(s, device=q.device)[:, None]
    j = torch.arange(s, device=q.device)[None, :]
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~((j <= i) & (i - j <= window)), float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    return (torch.softmax(scores, -1)[..., :s]) @ v


def _close(ours, reference):
    """Equal at bf16's resolution. Each block's gradient leaves its kernel in bf16 before the two
    are summed, so an entry's error follows the size of its parts, not of their sum: the absolute
    tolerance scales with the tensor's largest entry."""
    reference = reference.float()
    torch.testing.assert_close(ours.float(), reference, rtol=2e-2, atol=2e-2 * max(1.0, reference.abs().max().item()))


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("with_sink", [False, True])
def test_banded_kernels_on_cuda(kernel, with_sink):
    """1,000 tokens (not a multiple of the window), window 256, batch 2, GQA 8 / 2 heads of 64."""
    torch.manual_seed(0)
    b, n, g, s, h, window, scale = 2, 8, 2, 1000, 64, 256, 0.125
    q, k, v = (torch.randn(b, heads, s, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (n, g, g))
    sink = torch.linspace(-2, 2, n, device="cuda", requires_grad=True) if with_sink else None
    leaves = [q, k, v] + ([sink] if with_sink else [])
    exact = [t.detach().float().requires_grad_() for t in leaves]  # fp32 copies: fp32 gradients
    expected = _band_reference(*exact[:3], window, scale, exact[3] if with_sink else None)
    dout = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, exact, dout)
    out = banded_attention.banded_attention(q, k, v, window, scale, sink, kernel)
    _close(out, expected)
    for grad, reference in zip(torch.autograd.grad(out, leaves, dout.to(out.dtype)), expected_grads, strict=True):
        _close(grad, reference)


def test_attention_backend_picks_the_kernel():
    """flash pins aten's flash kernel; fused and auto take cuDNN's (expected to run on Hopper)."""
    q = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    assert banded_attention.cuda_kernel(AttnBackend.flash, q, q) == "flash"
    assert banded_attention.cuda_kernel(AttnBackend.fused, q, q) == "cudnn"
    assert banded_attention.cuda_kernel(AttnBackend.auto, q, q) == "cudnn"


@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_banded_layer_matches_the_reference_backend(backend, monkeypatch):
    """DotProductAttention, bf16, window (512, 0), learned sinks: banded (backend's kernel) against
    the unfused reference layer in fp32 on the same values, outputs and the gradients of q, k, v
    and the sink."""
    kernels = []
    run = banded_attention.banded_attention

    def counted(*args, **kwargs):
        kernels.append(args[-1])
        return run(*args, **kwargs)
    monkeypatch.setattr(banded_attention, "banded_attention", counted)
    torch.manual_seed(0)
    s, b, n, g, hn = 1500, 2, 8, 2, 64
    q = torch.randn(s, b, n, hn, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(s, b, g, hn, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    upstream = torch.randn(s, b, n * hn, device="cuda", dtype=torch.bfloat16)
    results = []
    for layer_backend, dtype in ((backend, torch.bfloat16), ("unfused", torch.float32)):
        config = TransformerConfig(num_layers=1, hidden_size=n * hn, num_attention_heads=n, num_query_groups=g,
                                   window_size=(512, 0), softmax_type="learnable", attention_backend=layer_backend,
                                   attention_dropout=0.0, hidden_dropout=0.0, params_dtype=dtype,
                                   bf16=dtype == torch.bfloat16)
        attention = DotProductAttention(config, layer_number=1)
        with torch.no_grad():
            attention.softmax_offset.copy_(torch.linspace(-3, 3, n).bfloat16())
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention(*leaves)
        (out * upstream.to(dtype)).sum().backward()
        results.append([out] + [t.grad for t in leaves] + [attention.softmax_offset.grad])
    assert kernels == ["cudnn" if backend == "auto" else "flash"]
    for ours, reference in zip(*results, strict=True):
        _close(ours, reference)
