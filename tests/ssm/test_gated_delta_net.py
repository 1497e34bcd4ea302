"""Gated DeltaNet's mixer: one process against its definition written out plainly (projection,
causal convolution, L2 norms, grouped heads, the recurrence token by token, the per-head norm gated
by z), Megatron's parameter names and initialisation, TP 2 (with and without sequence parallelism)
equal to TP 1 built from the same seed (outputs, input and weight grads), packed documents each run
as alone, and the sizes refused."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from dist import run_distributed
from ssm.packed_documents import assert_documents_run_as_alone
from teratron.ssm import GatedDeltaNet, gated_delta_rule_sequential
from teratron.tensor_parallel.utils import shard_tensor
from teratron.transformer.transformer_config import TransformerConfig

S, B, H = 10, 2, 16
DK, DV, NK, NV, KERNEL = 4, 3, 2, 4, 3  # 2 key heads, each serving 2 value heads
QK, V = NK * DK, NV * DV
IN_PARTS = (QK, QK, V, V, NV, NV)  # q k v z b a
CONV_PARTS = (QK, QK, V)


def _config(tp=1, sp=False, **overrides):
    fields = dict(num_layers=1, hidden_size=H, num_attention_heads=2, tensor_model_parallel_size=tp,
                  sequence_parallel=sp, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                  init_method_std=0.2, normalization="RMSNorm", linear_conv_kernel_dim=KERNEL,
                  linear_key_head_dim=DK, linear_value_head_dim=DV, linear_num_key_heads=NK,
                  linear_num_value_heads=NV)
    return TransformerConfig(**{**fields, **overrides})


def _layer(tp=1, sp=False, group=None, **overrides):
    torch.manual_seed(5)
    m = GatedDeltaNet(_config(tp, sp, **overrides), tp_group=group)
    m.chunk_size = 4  # several chunks and a padded end over S tokens
    with torch.no_grad():  # move the initial constants (the same whole values at any TP), so every role is checked
        rank = dist.get_rank(group) if group is not None else 0
        m.dt_bias.copy_(shard_tensor(torch.linspace(-1, 1, NV), 0, 1, rank, tp))
        for p in m.out_norm.parameters():
            p.copy_(torch.linspace(0.5, 1.5, DV))
    return m


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _definition(m, x, layer_norm=False):
    """The mixer spelled out, one process (see the module docstring), on double-precision copies."""
    d = lambda t: t.detach().double()  # noqa: E731
    proj = (x.double() @ d(m.in_proj.weight).t()).transpose(0, 1)  # [b, s, parts]
    qkv, z, b, a = proj.split([2 * QK + V, V, NV, NV], dim=-1)
    padded = F.pad(qkv, (0, 0, KERNEL - 1, 0))
    w = d(m.conv1d.weight)[:, 0].t()  # [kernel, c]
    conv = torch.stack([(padded[:, t:t + KERNEL] * w).sum(1) for t in range(S)], 1)
    q, k, v = F.silu(conv).split([QK, QK, V], dim=-1)

    def unit(t):  # [b, s, nk * dk] -> [b, s, nk, dk], each head of length 1 (up to eps)
        t = t.reshape(B, S, NK, DK)
        return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)

    group_of = [j // (NV // NK) for j in range(NV)]  # value head j reads key head j // 2
    q, k = unit(q)[:, :, group_of] / math.sqrt(DK), unit(k)[:, :, group_of]
    g = -torch.exp(d(m.A_log)) * torch.log1p(torch.exp(a + d(m.dt_bias)))
    o, _ = gated_delta_rule_sequential(q, k, v.reshape(B, S, NV, DV), g, torch.sigmoid(b))  # [b, s, nv, dv]
    if layer_norm:
        centred = o - o.mean(-1, keepdim=True)
        normed = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)
        normed = normed * d(m.out_norm.weight) + d(m.out_norm.bias)
    else:
        normed = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * d(m.out_norm.weight)
    y = normed * F.silu(z.reshape(B, S, NV, DV))
    return y.reshape(B, S, V).transpose(0, 1) @ d(m.out_proj.weight).t()


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_one_process_equals_the_definition(normalization):
    m = _layer(normalization=normalization)
    x, _ = _inputs()
    out, bias = m(x)
    assert bias is None and out.shape == (S, B, H)
    assert_close(out.double(), _definition(m, x, normalization == "LayerNorm"), rtol=1e-5, atol=1e-6)


def test_packed_documents_each_run_as_alone():
    """Rows of packed documents (documents of 1 token, starting on and off the chunks of 4): every
    document's output and gradients equal the layer's on the document alone (float64 parameters and
    inputs; the gates are computed in fp32, hence fp32's tolerance)."""
    assert_documents_run_as_alone(_layer().double(), _inputs()[0].double(), ([3, 1, 6], [4, 2, 4]), tol=1e-6)


def test_bf16_parameters_give_bf16_outputs_and_grads_near_the_definition():
    m = _layer(params_dtype=torch.bfloat16, bf16=True)
    x = _inputs()[0].bfloat16().requires_grad_()
    out, _ = m(x)
    out.float().sum().backward()
    assert out.dtype == x.grad.dtype == torch.bfloat16
    assert all(p.dtype == p.grad.dtype == torch.bfloat16 for p in m.parameters())
    assert_close(out.double(), _definition(m, x.detach()), rtol=1.6e-2, atol=1e-2)  # bf16 steps, fp32 inside


def test_megatron_parameter_names_shapes_and_initialisation():
    torch.manual_seed(0)
    m = GatedDeltaNet(_config())
    shapes = {name: tuple(p.shape) for name, p in m.named_parameters()}
    assert shapes == {"in_proj.weight": (sum(IN_PARTS), H), "conv1d.weight": (sum(CONV_PARTS), 1, KERNEL),
                      "dt_bias": (NV,), "A_log": (NV,), "out_norm.weight": (DV,), "out_proj.weight": (H, V)}
    assert torch.equal(m.dt_bias, torch.ones(NV)) and torch.equal(m.out_norm.weight, torch.ones(DV))
    A = torch.exp(m.A_log.detach())
    assert A.min() >= 1 and A.max() <= 16 and A.std() > 0
    bound = 1 / math.sqrt(KERNEL)  # torch's Conv1d default (Kaiming-uniform) for a depthwise kernel
    conv = m.conv1d.weight.detach()
    assert conv.abs().max() <= bound and conv.abs().max() > 0.8 * bound
    assert abs(m.in_proj.weight.std().item() - 0.2) < 0.03  # init_method: normal(0, init_method_std)
    assert m.out_norm.weight.sequence_parallel  # replicated over TP, its grads summed there


def _run(m, x, grad, r=0, n=1, sp=False):
    x = (x.chunk(n)[r] if sp else x).clone().requires_grad_()
    out, _ = m(x)
    out.backward(grad.chunk(n)[r] if sp else grad)
    return out.detach(), x.grad


def _tp2():
    rank, group = dist.get_rank(), dist.group.WORLD
    x, grad = _inputs()
    ref = _layer()
    ref_out, ref_dx = _run(ref, x, grad)
    sharded = {"in_proj.weight": (0, IN_PARTS), "conv1d.weight": (0, CONV_PARTS), "dt_bias": (0, 1),
               "A_log": (0, 1), "out_proj.weight": (1, 1)}
    for sp in (False, True):
        m = _layer(2, sp, group)
        params, ref_params = dict(m.named_parameters()), dict(ref.named_parameters())
        for name, (dim, stride) in sharded.items():
            want = shard_tensor(ref_params[name].detach(), dim, stride, rank, 2)
            assert torch.equal(params[name].detach(), want), name
        out, dx = _run(m, x, grad, rank, 2, sp)
        assert_close(out, ref_out.chunk(2)[rank] if sp else ref_out, rtol=1e-5, atol=1e-6)
        assert_close(dx, ref_dx.chunk(2)[rank] if sp else ref_dx, rtol=1e-5, atol=1e-6)
        for name, (dim, stride) in sharded.items():
            want = shard_tensor(ref_params[name].grad, dim, stride, rank, 2)
            assert_close(params[name].grad, want, rtol=1e-5, atol=1e-6, msg=name)
        norm_grad = m.out_norm.weight.grad.clone()  # this rank's heads only: summed over TP it is the whole
        dist.all_reduce(norm_grad, group=group)
        assert_close(norm_grad, ref.out_norm.weight.grad, rtol=1e-5, atol=1e-6)
        ref.zero_grad()
        ref_out, ref_dx = _run(ref, x, grad)
    with pytest.raises(ValueError, match=r"^Gated DeltaNet's 3 key heads do not split over tensor-parallel size 2; "
                                         r"choose --linear-num-key-heads divisible by it$"):
        GatedDeltaNet(_config(2, linear_num_key_heads=3, linear_num_value_heads=6), tp_group=group)
    return True


def test_tensor_parallel_equals_one_process():
    assert run_distributed(_tp2, 2) == [True, True]


@pytest.mark.parametrize("field, value, message", [
    ("linear_num_value_heads", 5, r"^linear_num_value_heads \(5\) must be a multiple of linear_num_key_heads \(2\): "
                                  r"each key head serves a group$"),
    ("linear_num_key_heads", 0, r"^linear_num_key_heads must be a positive integer, got 0$"),
    ("linear_key_head_dim", 2.0, r"^linear_key_head_dim must be a positive integer, got 2.0$"),
    ("linear_value_head_dim", None, r"^linear_value_head_dim must be a positive integer, got None$"),
    ("linear_conv_kernel_dim", True, r"^linear_conv_kernel_dim must be a positive integer, got True$"),
])
def test_config_refuses_sizes_gated_deltanet_cannot_use(field, value, message):
    with pytest.raises(ValueError, match=message):
        _config(**{field: value})


def test_config_defaults_are_megatrons():
    c = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2)
    assert (c.linear_conv_kernel_dim, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_key_heads,
            c.linear_num_value_heads) == (4, 128, 128, 16, 32)


def test_it_builds_on_the_meta_device():
    """Under torch.device("meta") (shape checks of an import) the layer builds, every shape as on
    the CPU, and the parameters it draws itself stay there."""
    with torch.device("meta"):
        meta = GatedDeltaNet(_config())
    real = dict(GatedDeltaNet(_config()).named_parameters())
    assert {n: p.shape for n, p in meta.named_parameters()} == {n: p.shape for n, p in real.items()}
    assert all(p.is_meta for n, p in meta.named_parameters() if n in ("conv1d.weight", "dt_bias", "A_log"))
