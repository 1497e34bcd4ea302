"""Gated Delta Product: the substeps (`gated_delta_product`) against the recurrence written out token by
token and substep by substep; the mixer against its definition written out plainly (projection,
convolution, per-group L2 norms, the recurrence, the per-group gated norm); TP 2 (with and without
sequence parallelism) equal to TP 1 built from the same seed; packed documents each run as alone;
the Triton gated-delta-rule kernels (Triton's interpreter) taking the expanded sequence."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from dist import run_distributed
from kernel_tests import run_in_the_interpreter
from ssm.packed_documents import assert_documents_run_as_alone
from teratron.ssm.gated_delta_product import GatedDeltaProductMixer, gated_delta_product
from teratron.tensor_parallel.utils import shard_tensor
from teratron.transformer.transformer_config import TransformerConfig

S, B, H = 10, 2, 16
M = 3  # substeps a token
SIZES = dict(mamba_state_dim=4, mamba_head_dim=4, mamba_num_groups=2, mamba_num_heads=8, gdp_num_householder=M)


def substeps_one_by_one(q, k, v, g, beta, initial_state=None):
    """The definition: for every token its M rank-one updates in order (the token's decay with the
    first), then its output read from the state. Shapes as `gated_delta_product`'s."""
    b, s, h, n = q.shape
    m = k.shape[1] // s
    state = q.new_zeros(b, h, v.shape[-1], n) if initial_state is None else initial_state.clone()
    outputs = []
    for t in range(s):
        for i in range(m):
            j = t * m + i
            decay = torch.exp(g[:, t]) if i == 0 else torch.ones_like(g[:, t])
            kj = k[:, j]  # [b, h, n]
            removed = torch.einsum("bhpn,bhn->bhp", state, kj)  # S k
            state = decay[..., None, None] * (state - beta[:, j, :, None, None] * removed[..., None] * kj[:, :, None])
            state = state + beta[:, j, :, None, None] * v[:, j, :, :, None] * kj[:, :, None]
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def _rule_inputs(b=2, s=13, h=3, n=5, p=4, m=M, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(rand(b, s, h, n), dim=-1), F.normalize(rand(b, s * m, h, n), dim=-1)
    v, g = rand(b, s * m, h, p), -torch.rand(b, s, h, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, s * m, h, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [4, 16])
def test_substeps_equal_the_recurrence(chunk):
    """Over chunks that cut a token's substeps apart (4) and that hold several tokens (16), from a zero
    state and from a given one: outputs and final state."""
    q, k, v, g, beta = _rule_inputs()
    initial = torch.randn(2, 3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for state in (None, initial):
        o, final = gated_delta_product(q, k, v, g, beta, M, initial_state=state, chunk_size=chunk)
        want, want_final = substeps_one_by_one(q, k, v, g, beta, state)
        assert_close(o, want, rtol=1e-10, atol=1e-10)
        assert_close(final, want_final, rtol=1e-10, atol=1e-10)


def test_one_substep_is_the_gated_delta_rule():
    """With M = 1 every token is one update of the gated delta rule (Gated DeltaNet's recurrence)."""
    from teratron.ssm import gated_delta_rule_sequential

    q, k, v, g, beta = _rule_inputs(m=1)
    assert_close(gated_delta_product(q, k, v, g, beta, 1, chunk_size=4)[0],
                 gated_delta_rule_sequential(q, k, v, g, beta)[0], rtol=1e-10, atol=1e-10)


def _config(tp=1, sp=False, **fields):
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, tensor_model_parallel_size=tp,
                             sequence_parallel=sp, use_cpu_initialization=True, hidden_dropout=0.0,
                             attention_dropout=0.0, init_method_std=0.2, hybrid_layer_pattern="M", gdp_layers=True,
                             **{**SIZES, **fields})


def _mixer(tp=1, sp=False, group=None):
    torch.manual_seed(5)
    m = GatedDeltaProductMixer(_config(tp, sp), tp_group=group)
    m.chunk_size = 4
    return m


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _definition(m, x):
    """The mixer spelled out, one process, on double-precision copies: in_proj's rows [z; V_0 ..;
    K_0 ..; Q; b_0 ..; a], V_i holding every head, K_i and Q every group."""
    d = lambda t: t.detach().double()  # noqa: E731
    heads, groups, n, p = m.nheads, m.ngroups, m.d_state, m.head_dim
    proj = (x.double() @ d(m.in_proj.weight).t()).transpose(0, 1)  # [b, s, c]
    z, vkq, b_, a = proj.split([heads * p, M * heads * p + (M + 1) * groups * n, M * heads, heads], dim=-1)
    weight = d(m.conv1d.weight)[:, 0]  # [c, k]
    taps = weight.shape[-1]
    padded = F.pad(vkq, (0, 0, taps - 1, 0))
    conv = F.silu(torch.stack([(padded[:, t:t + taps] * weight.t()).sum(1) for t in range(S)], 1))
    v, k, q = conv.split([M * heads * p, M * groups * n, groups * n], dim=-1)

    def normed_heads(t):  # [..., groups * n] -> [..., heads, n]: each group's t / sqrt(|t|^2 + 1e-6) (FLA's
        t = t.unflatten(-1, (groups, n))  # l2norm, Megatron's) for its heads
        t = t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)
        return t.repeat_interleave(heads // groups, dim=-2)

    v = v.reshape(B, S, M, heads, p).reshape(B, S * M, heads, p)
    k = normed_heads(k.reshape(B, S, M, groups * n)).reshape(B, S * M, heads, n)
    q = normed_heads(q) / math.sqrt(n)
    beta = torch.sigmoid(b_).reshape(B, S, M, heads).reshape(B, S * M, heads)
    g = -torch.exp(d(m.A_log)) * F.softplus(a + d(m.dt_bias))
    o, _ = substeps_one_by_one(q, k, v, g, beta)  # [b, s, heads, p]
    gated = (o.flatten(2) * F.silu(z)).unflatten(-1, (groups, -1))
    normed = (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2) * d(m.norm.weight)
    return (normed @ d(m.out_proj.weight).t()).transpose(0, 1)


def test_one_process_equals_the_definition():
    m = _mixer()
    x, _ = _inputs()
    out, bias = m(x)
    assert bias is None and out.shape == (S, B, H)
    assert_close(out.double(), _definition(m, x), rtol=1e-4, atol=1e-5)


def test_parameters_are_megatrons():
    """Megatron's names and global shapes, its defaults: no biases, no D, A = exp(A_log) in (0, 16)."""
    m = _mixer()
    rows = 8 * 4 * (1 + M) + 2 * 4 * (1 + M) + 8 * (1 + M)  # z, V_i; K_i, Q; b_i, a
    assert {n: tuple(p.shape) for n, p in m.named_parameters()} == {
        "in_proj.weight": (rows, H), "out_proj.weight": (H, 32), "conv1d.weight": (M * 32 + (M + 1) * 8, 1, 4),
        "dt_bias": (8,), "A_log": (8,), "norm.weight": (32,)}
    assert m.in_proj_part_names == ("z", "V0", "V1", "V2", "K0", "K1", "K2", "Q", "b0", "b1", "b2", "a")
    assert m.conv1d_part_names == ("V0", "V1", "V2", "K0", "K1", "K2", "Q")
    A = GatedDeltaProductMixer(_config(mamba_num_heads=256)).A_log.exp()  # U(0, 16): Mamba-2's is U(1, 16)
    assert 0 < A.min() < 1 and A.max() < 16


def test_packed_documents_each_run_as_alone():
    """Documents of 1 token and documents crossing the rule's chunks of 4 expanded tokens: each as alone
    (float64; the gates in fp32, hence fp32's tolerance)."""
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
    parts, conv_parts = ref.in_proj_parts, ref.conv1d_parts
    for sp in (False, True):
        m = _mixer(2, sp, group)
        assert torch.equal(m.in_proj.weight.detach(), shard_tensor(ref.in_proj.weight.detach(), 0, parts, rank, 2))
        out, dx = _run(m, x, grad, rank, 2, sp)
        assert_close(out, ref_out.chunk(2)[rank] if sp else ref_out, rtol=1e-5, atol=1e-6)
        assert_close(dx, ref_dx.chunk(2)[rank] if sp else ref_dx, rtol=1e-5, atol=1e-6)
        params, ref_params = dict(m.named_parameters()), dict(ref.named_parameters())
        for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight"):
            stride = conv_parts if name.startswith("conv1d.") else 1
            want = shard_tensor(ref_params[name].grad, 0, stride, rank, 2)
            assert_close(params[name].grad, want, rtol=1e-5, atol=1e-6, msg=name)
        assert_close(m.in_proj.weight.grad, shard_tensor(ref.in_proj.weight.grad, 0, parts, rank, 2),
                     rtol=1e-5, atol=1e-6)
        assert_close(m.out_proj.weight.grad, shard_tensor(ref.out_proj.weight.grad, 1, 1, rank, 2),
                     rtol=1e-5, atol=1e-6)
        ref.zero_grad()
        ref_out, ref_dx = _run(ref, x, grad)
    return True


def test_tensor_parallel_equals_one_process():
    assert run_distributed(_tp2, 2) == [True, True]


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"^Gated Delta Product's 8 heads do not split into 3 groups; choose"):
        GatedDeltaProductMixer(_config(mamba_num_groups=3))
    with pytest.raises(ValueError, match=r"^gdp_num_householder must be a positive integer, got 0"):
        _config(gdp_num_householder=0)
    with pytest.raises(ValueError, match=r"^gdp_layers without hybrid_layer_pattern"):
        TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, gdp_layers=True)


def test_it_builds_on_the_meta_device():
    with torch.device("meta"):
        meta = GatedDeltaProductMixer(_config())
    real = dict(_mixer().named_parameters())
    assert {n: p.shape for n, p in meta.named_parameters()} == {n: p.shape for n, p in real.items()}


def test_the_triton_kernels_take_the_expanded_sequence():
    """The mixer on the gated-delta-rule and convolution Triton kernels (Triton's interpreter) against
    its PyTorch path: outputs and gradients."""
    assert run_in_the_interpreter(__file__, "gated_delta_product_cases.py") == "ok"
