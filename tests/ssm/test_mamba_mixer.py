"""Mamba-2's mixer: one process against its definition written out plainly (projection, causal
convolution, the recurrence step by step, the per-group gated norm), and TP 2 (with and without
sequence parallelism) equal to TP 1 built from the same seed: outputs, input and weight grads; packed
documents each run as alone."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from dist import run_distributed
from ssm.packed_documents import assert_documents_run_as_alone
from teratron.ssm import ssd_sequential
from teratron.ssm.mamba_mixer import MambaMixer
from teratron.tensor_parallel.utils import shard_tensor
from teratron.transformer.transformer_config import TransformerConfig

S, B, H = 10, 2, 16
KW = dict(d_state=4, head_dim=4, ngroups=2, chunk_size=4)  # 8 heads of 4 channels in 2 groups


def _config(tp=1, sp=False):
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, tensor_model_parallel_size=tp,
                             sequence_parallel=sp, use_cpu_initialization=True, hidden_dropout=0.0,
                             attention_dropout=0.0, init_method_std=0.2)


def _mixer(tp=1, sp=False, group=None):
    torch.manual_seed(5)
    return MambaMixer(_config(tp, sp), tp_group=group, **KW)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _definition(m, x):
    """The mixer spelled out, one process (see the module docstring), on double-precision copies."""
    d = lambda t: t.detach().double()  # noqa: E731
    proj = x.double() @ d(m.in_proj.weight).t()
    z, xbc, dt = proj.split([m.d_inner, m.d_inner + 2 * m.ngroups * m.d_state, m.nheads], dim=-1)
    xbc = xbc.transpose(0, 1)  # [b, s, c]
    weight = d(m.conv1d.weight)[:, 0]  # [c, k]
    k = weight.shape[-1]
    padded = F.pad(xbc, (0, 0, k - 1, 0))
    conv = torch.stack([(padded[:, t:t + k] * weight.t()).sum(1) for t in range(S)], 1) + d(m.conv1d.bias)
    xs, Bs, Cs = F.silu(conv).split([m.d_inner, m.ngroups * m.d_state, m.ngroups * m.d_state], -1)
    dt = F.softplus(dt.transpose(0, 1) + d(m.dt_bias))
    y, _ = ssd_sequential(xs.reshape(B, S, m.nheads, m.head_dim), dt, -torch.exp(d(m.A_log)),
                          Bs.reshape(B, S, m.ngroups, m.d_state), Cs.reshape(B, S, m.ngroups, m.d_state), d(m.D))
    gated = (y.reshape(B, S, m.d_inner).transpose(0, 1) * F.silu(z)).unflatten(-1, (m.ngroups, -1))
    normed = (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2) * d(m.norm.weight)
    return normed @ d(m.out_proj.weight).t()


def test_one_process_equals_the_definition():
    m = _mixer()
    x, _ = _inputs()
    out, bias = m(x)
    assert bias is None and out.shape == (S, B, H)
    assert_close(out.double(), _definition(m, x), rtol=1e-4, atol=1e-5)


def test_packed_documents_each_run_as_alone():
    """Rows of packed documents (documents of 1 token, starting on and off the chunks of 4): every
    document's output and gradients equal the mixer's on the document alone (float64 parameters and
    inputs; the gates are computed in fp32, hence fp32's tolerance)."""
    assert_documents_run_as_alone(_mixer().double(), _inputs()[0].double(), ([3, 1, 6], [4, 2, 4]), tol=1e-6)


def _run(m, x, grad, r=0, n=1, sp=False):
    x = (x.chunk(n)[r] if sp else x).clone().requires_grad_()
    out, _ = m(x)
    out.backward(grad.chunk(n)[r] if sp else grad)
    return out.detach(), x.grad


def _tp2():
    rank, group = dist.get_rank(), dist.group.WORLD
    x, grad = _inputs()
    ref = _mixer()
    ref_out, ref_dx = _run(ref, x, grad)
    for sp in (False, True):
        m = _mixer(2, sp, group)
        parts = (m.d_inner, m.d_inner, 8, 8, m.nheads)
        assert torch.equal(m.in_proj.weight.detach(), shard_tensor(ref.in_proj.weight.detach(), 0, parts, rank, 2))
        out, dx = _run(m, x, grad, rank, 2, sp)
        assert_close(out, ref_out.chunk(2)[rank] if sp else ref_out, rtol=1e-5, atol=1e-6)
        assert_close(dx, ref_dx.chunk(2)[rank] if sp else ref_dx, rtol=1e-5, atol=1e-6)
        params, ref_params = dict(m.named_parameters()), dict(ref.named_parameters())
        for name in ("conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight"):
            stride = (m.d_inner, 8, 8) if name.startswith("conv1d.") else 1
            want = shard_tensor(ref_params[name].grad, 0, stride, rank, 2)
            assert_close(params[name].grad, want, rtol=1e-5, atol=1e-6, msg=name)
        assert_close(m.in_proj.weight.grad, shard_tensor(ref.in_proj.weight.grad, 0, parts, rank, 2),
                     rtol=1e-5, atol=1e-6)
        ref.zero_grad()
        ref_out, ref_dx = _run(ref, x, grad)
    return True


def test_tensor_parallel_equals_one_process():
    assert run_distributed(_tp2, 2) == [True, True]


def test_sizes_that_do_not_split_are_refused():
    import pytest

    with pytest.raises(ValueError, match="do not split into 3 groups"):
        MambaMixer(_config(), d_state=4, head_dim=4, ngroups=3)


def test_it_builds_on_the_meta_device():
    """Shape checks (the Hugging Face import's) build models under torch.device("meta"): the
    mixer's own parameters stay there (no data), every shape as on the CPU."""
    with torch.device("meta"):
        meta = MambaMixer(_config(), **KW)
    real = dict(_mixer().named_parameters())
    assert {n: p.shape for n, p in meta.named_parameters()} == {n: p.shape for n, p in real.items()}
    assert all(p.is_meta for n, p in meta.named_parameters() if not n.startswith(("in_proj", "out_proj")))
