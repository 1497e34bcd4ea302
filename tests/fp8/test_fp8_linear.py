"""The FP8 GEMM of a linear layer against a plain reference written here: quantise-dequantise in
fp32 with the scale fp8_max / (amax * 2**margin), fp32 matmul. With fp32 inputs the FP8 path
returns fp32, so forward and both gradients must match to fp32 accumulation noise; with bf16
inputs to one bf16 rounding."""

import math

import pytest
import torch

from teratron.fp8 import Fp8Gemm, Fp8Recipe
from teratron.fp8.scaling import compute_scale, quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def assert_fp32_close(got, ref, what):
    """fp32 accumulation noise: max error within 1e-5 of the largest magnitude."""
    err, bound = (got.float() - ref).abs().max().item(), 1e-5 * ref.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.2e} > {bound:.2e}"


def assert_one_bf16_rounding(got, ref, what):
    """A bf16 result of the fp32 reference: each element within half a bf16 ulp (2**-8 relative)
    plus fp32 noise."""
    bound = 2**-8 * ref.abs() + 1e-5 * ref.abs().max()
    assert ((got.float() - ref).abs() <= bound).all(), f"{what}: beyond one bf16 rounding"


def ref_dequant(x, dtype, margin=0):
    """x rounded to `dtype` with a per-tensor scale from its own amax, back in fp32."""
    x = x.float()
    fmax = torch.finfo(dtype).max
    amax = x.abs().max().item()
    scale = fmax / (amax * 2.0**margin) if amax > 0 else 1.0
    return (x * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def ref_linear(x, w, dy, fmt="hybrid", margin=0, fp8_wgrad=True):
    """(y, dx, dw) of y = x @ w^T with FP8 operands, in fp32 (x [t, in], w [out, in], dy [t, out])."""
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    xq, wq, gq = ref_dequant(x, E4M3, margin), ref_dequant(w, E4M3, margin), ref_dequant(dy, grad_dtype, margin)
    dw = gq.t() @ xq if fp8_wgrad else dy.float().t() @ x.float()
    return xq @ wq.t(), gq @ wq, dw


def run_gemm(x, w, dy, **recipe):
    gemm = Fp8Gemm(Fp8Recipe(recipe="tensorwise", **recipe), w.shape[1], w.shape[0], name="test")
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemm(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def data(tokens, n_in, n_out, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n_in, generator=g).to(dtype)
    w = (0.05 * torch.randn(n_out, n_in, generator=g)).to(dtype)
    dy = (1e-3 * torch.randn(tokens, n_out, generator=g)).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("tokens", [32, 21])  # 21: the wgrad's reduced dimension is zero-padded to 32
@pytest.mark.parametrize("margin", [0, 2])
def test_forward_and_gradients_equal_the_reference_fp32(fmt, tokens, margin):
    x, w, dy = data(tokens, 64, 48)
    y, dx, dw = run_gemm(x, w, dy, format=fmt, margin=margin)
    ref_y, ref_dx, ref_dw = ref_linear(x, w, dy, fmt, margin)
    for name, got, ref in (("y", y, ref_y), ("dx", dx, ref_dx), ("dw", dw, ref_dw)):
        assert got.dtype == torch.float32, name
        assert_fp32_close(got, ref, name)


def test_bf16_inputs_give_bf16_within_one_rounding():
    x, w, dy = data(2 * 16, 64, 32, torch.bfloat16)
    y, dx, dw = run_gemm(x.view(2, 16, 64), w, dy.view(2, 16, 32))  # [s, b, h] inputs
    ref_y, ref_dx, ref_dw = ref_linear(x, w, dy)
    for name, got, ref in (("y", y.view(32, 32), ref_y), ("dx", dx.view(32, 64), ref_dx), ("dw", dw, ref_dw)):
        assert got.dtype == torch.bfloat16, name
        assert_one_bf16_rounding(got, ref, name)


def test_hybrid_gradients_are_coarser_than_e4m3():
    """e5m2 keeps 2 mantissa bits, e4m3 3: hybrid's gradients are further from the exact ones;
    the forward (e4m3 in both) is the same."""
    x, w, dy = data(64, 64, 64)
    exact_dx = dy @ w
    results = {fmt: run_gemm(x, w, dy, format=fmt) for fmt in ("hybrid", "e4m3")}
    assert torch.equal(results["hybrid"][0], results["e4m3"][0])
    error = {fmt: ((r[1] - exact_dx).norm() / exact_dx.norm()).item() for fmt, r in results.items()}
    assert error["e4m3"] < error["hybrid"] < 2 * 2**-2, error
    assert not torch.equal(results["hybrid"][2], results["e4m3"][2])


def test_no_fp8_wgrad_gives_the_high_precision_weight_gradient():
    for dtype, check in ((torch.float32, assert_fp32_close), (torch.bfloat16, assert_one_bf16_rounding)):
        x, w, dy = data(32, 64, 32, dtype)
        y, dx, dw = run_gemm(x, w, dy, wgrad=False)
        ref_y, ref_dx, ref_dw = ref_linear(x, w, dy, fp8_wgrad=False)
        assert dw.dtype == dtype
        check(dw, ref_dw, f"{dtype} dw")
        check(dx, ref_dx, f"{dtype} dx")  # the dgrad stays FP8


def test_scale_formula_and_saturation():
    amax = torch.tensor([0.0, 2.0, 1e-45])
    scale = compute_scale(amax, E4M3, margin=1)
    assert scale[0] == 1.0  # amax 0 -> 1
    assert scale[1] == 448.0 / (2.0 * 2)
    assert torch.isfinite(scale[2])
    q = quantize(torch.tensor([1.0, -1e6]), torch.tensor(1000.0), E4M3)
    assert q.float().tolist() == [448.0, -448.0]  # saturated, not NaN
    q = quantize(torch.tensor([1e9, math.inf]), torch.tensor(1.0), E5M2)
    assert q.float()[0] == torch.finfo(E5M2).max and q.float()[1].isnan()  # an overflow stays visible
    q = quantize(torch.tensor([1.0, math.inf]), compute_scale(torch.tensor(math.inf), E4M3, 0), E4M3)
    assert q.float().isnan()[1]  # current scaling of a tensor holding inf


def test_gemm_sizes_must_be_multiples_of_16():
    with pytest.raises(ValueError, match=r"fp8: layer 3 mlp.linear_fc1 multiplies \[40 x 64\] per TP rank"):
        Fp8Gemm(Fp8Recipe(), 64, 40, name="layer 3 mlp.linear_fc1")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with FP8 (sm89+)")
def test_cuda_matches_the_reference():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm89+")
    # Hopper's FP8 tensor cores accumulate with about 14 mantissa bits, not fp32 (DeepSeek-V3
    # report, section 3.3.2): each product may lose 2**-13 of its magnitude in the sum, so the
    # bound adds 2**-13 * (|A| @ |B|) of the dequantised operands to one bf16 rounding.
    for fmt in ("hybrid", "e4m3"):
        x, w, dy = data(4096 + 8, 1024, 512, torch.bfloat16)
        y, dx, dw = run_gemm(x.cuda(), w.cuda(), dy.cuda(), format=fmt)
        grad_dtype = E5M2 if fmt == "hybrid" else E4M3
        xq, wq, gq = ref_dequant(x, E4M3), ref_dequant(w, E4M3), ref_dequant(dy, grad_dtype)
        for name, got, a, b in (("y", y, xq, wq.t()), ("dx", dx, gq, wq), ("dw", dw, gq.t(), xq)):
            ref, magnitude = a @ b, a.abs() @ b.abs()
            bound = 2**-8 * ref.abs() + 2**-13 * magnitude + 1e-5 * ref.abs().max()
            assert ((got.cpu().float() - ref).abs() <= bound).all(), f"cuda {fmt} {name}: beyond the bound"
