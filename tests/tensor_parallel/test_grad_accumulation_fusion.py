"""Gradient-accumulation fusion: the weight-gradient GEMM adds into main_grad.

References are plain autograd (dW = g^T x, added up by hand); under DDP the fused layers give the
main_grads the unfused layers give, also compiled (no graph break) and over several micro-batches.
The multi-rank cases (DP=2 with the distributed optimizer and compiled layers, TP=2 + SP) are in
tests/distributed/test_gpt_distributed_optimizer.py.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig
from teratron.fp8.recipe import Fp8Recipe
from teratron.model_parallel_config import ModelParallelConfig
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from teratron.tensor_parallel.grad_accumulation_fusion import linear_with_grad_accumulation

S, B, H, F_ = 8, 2, 16, 32


def _config(fusion, dtype=torch.float32):
    return ModelParallelConfig(gradient_accumulation_fusion=fusion, params_dtype=dtype)


class _Mlp(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        torch.manual_seed(0)
        init = torch.nn.init.normal_
        self.fc1 = ColumnParallelLinear(H, F_, config=config, init_method=init, bias=True)
        self.fc2 = RowParallelLinear(F_, H, config=config, init_method=init, bias=False,
                                     input_is_parallel=True, skip_bias_add=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)[0]))[0]


class _DdpConfig:
    calculate_per_token_loss = False


def _main_grads(model, inputs, overlap=False, warm_up=False):
    """main_grads after the micro-batches `inputs`; asserts how often the fused GEMM ran
    (counted after a warm-up step when compiling: tracing calls the op too)."""
    ddp = DistributedDataParallel(_DdpConfig(), DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, grad_reduce_in_fp32=True), model)
    if warm_up:
        ddp(inputs[0]).sum().backward()
        ddp.finish_grad_sync()
        ddp.zero_grad_buffer()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with ddp.no_sync():
            for x in inputs[:-1]:
                ddp(x).square().sum().backward()
        ddp(inputs[-1]).square().sum().backward()
    ddp.finish_grad_sync()
    fused_calls = sum(e.count for e in prof.key_averages() if e.key == "teratron::wgrad_into_main_grad")
    assert fused_calls == (2 * len(inputs) if model.fc1.config.gradient_accumulation_fusion else 0)
    assert all(p.grad is None for p in model.parameters())
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}


def _inputs(n=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(S, B, H, generator=g).to(dtype) for _ in range(n)]


def test_fused_wgrad_accumulates_the_plain_weight_gradient_in_fp32():
    """bf16 weight and inputs, fp32 main_grad: main_grad = sum over micro-batches of g^T x taken
    in fp32 from the bf16 operands (never rounded to bf16); dx is F.linear's."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(F_, H).bfloat16())
    weight.main_grad = torch.zeros(F_, H)
    expected = torch.zeros(F_, H, dtype=torch.float64)
    for x, grad in zip(_inputs(2, torch.bfloat16), _inputs(2, torch.bfloat16)):
        grad = grad.repeat(1, 1, 2)  # [s, b, F_]
        x = x.requires_grad_()
        linear_with_grad_accumulation(x, weight).backward(grad)
        x_ref = x.detach().clone().requires_grad_()
        F.linear(x_ref, weight.detach()).backward(grad)
        assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
        expected += grad.reshape(-1, F_).double().t() @ x.detach().reshape(-1, H).double()
    assert weight.grad is not None and weight.grad.shape == weight.shape  # the placeholder
    # fp32 accumulation of 16-term dot products of bf16 values: error ~ 16 * 2^-24 relative
    assert_close(weight.main_grad.double(), expected, rtol=16 * 2 ** -24, atol=1e-6)


@pytest.mark.parametrize("overlap", [False, True])
def test_fused_layers_under_ddp_give_the_unfused_main_grads(overlap):
    inputs = _inputs()
    fused = _main_grads(_Mlp(_config(True)), inputs, overlap)
    plain = _main_grads(_Mlp(_config(False)), inputs, overlap)
    assert fused.keys() == plain.keys()
    for name in plain:
        assert_close(fused[name], plain[name], msg=lambda m: f"{name}: {m}")


def test_fused_layers_compile_without_graph_breaks():
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    inputs = _inputs()
    model = _Mlp(_config(True))
    model.compile()
    fused = _main_grads(model, inputs, overlap=True, warm_up=True)
    assert not torch._dynamo.utils.counters["graph_break"]
    plain = _main_grads(_Mlp(_config(False)), inputs, overlap=True)
    for name in plain:
        assert_close(fused[name], plain[name], msg=lambda m: f"{name}: {m}")


def test_without_main_grad_or_with_fp8_the_layer_uses_plain_autograd():
    layer = _Mlp(_config(True)).fc1
    assert layer.weight.fuse_wgrad_accumulation
    layer(_inputs(1)[0])[0].sum().backward()  # no DDP: no main_grad, an ordinary .grad
    assert layer.weight.grad is not None and torch.count_nonzero(layer.weight.grad) > 0
    layer.enable_fp8(Fp8Recipe(format="e4m3"), "fc1")
    assert not layer.weight.fuse_wgrad_accumulation


def test_a_marked_weight_used_outside_its_layer_still_gets_its_gradient():
    """DDP drops .grad only after the fused GEMM ran for the weight in that backward: the fused
    cross entropy, say, takes the output layer's weight directly and returns a real dW."""
    model = _Mlp(_config(True))
    ddp = DistributedDataParallel(_DdpConfig(), DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    x = _inputs(1)[0]
    F.linear(x, model.fc1.weight).sum().backward()   # not through fc1's GEMM
    assert_close(model.fc1.weight.main_grad, torch.ones(S * B, F_).t() @ x.reshape(-1, H))
    ddp.zero_grad_buffer()
    model(x).sum().backward()                        # through it: the placeholder is dropped
    assert not model.fc1.weight.grad_added_to_main_grad  # cleared by the hook
    ref = _Mlp(_config(False))
    ref(x).sum().backward()
    assert_close(model.fc1.weight.main_grad, ref.fc1.weight.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLAS bf16 GEMM into fp32)")
def test_cuda_fused_wgrad_matches_fp32_product():
    g = torch.Generator(device="cuda").manual_seed(0)
    t, n_out, n_in = 4096, 1024, 512
    x = torch.randn(t, n_in, device="cuda", generator=g).bfloat16()
    grad = torch.randn(t, n_out, device="cuda", generator=g).bfloat16()
    weight = torch.nn.Parameter(torch.randn(n_out, n_in, device="cuda", generator=g).bfloat16())
    start = torch.randn(n_out, n_in, device="cuda", generator=g)
    weight.main_grad = start.clone()
    linear_with_grad_accumulation(x.requires_grad_(), weight).backward(grad)
    expected = start.double() + grad.double().t() @ x.detach().double()
    # fp32 accumulation over t = 4096 products of bf16 values, |g x| ~ 1: error <~ t * 2^-24 * sqrt(t)
    assert_close(weight.main_grad.double(), expected, rtol=0, atol=t * 2 ** -24 * t ** 0.5)
    assert_close(x.grad, grad @ weight.detach(), rtol=0, atol=0)
