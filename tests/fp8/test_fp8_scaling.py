"""Delayed scaling: the amax history rolls, 'max' vs 'most_recent', the margin, and the scale used
at call n comes from the amaxes of calls < n (the first call from its own amax); checked against
a plain list-based history kept in the test."""

import math

import pytest
import torch

from teratron.fp8 import Fp8Gemm, Fp8Recipe
from teratron.fp8.scaling import DelayedScaling, quantize

E4M3 = torch.float8_e4m3fn
FMAX = 448.0
AMAXES = [2.0, 8.0, 0.5, 1.0, 4.0, 0.25]


def tensor_with_amax(amax):
    return torch.tensor([amax * 0.3, -amax, amax * 0.7, 0.0])


def expected_scale(history, algo, margin):
    """The scale for the next call, from the amaxes seen so far (most recent first)."""
    amax = max(history) if algo == "max" else history[0]
    return 1.0 if amax == 0 else FMAX / (amax * 2.0**margin)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
def test_history_and_the_scale_of_each_call(algo, margin):
    length = 3
    scaler = DelayedScaling(E4M3, margin, length, algo)
    history = [0.0] * length
    for n, amax in enumerate(AMAXES):
        x = tensor_with_amax(amax)
        used = FMAX / (amax * 2.0**margin) if n == 0 else expected_scale(history, algo, margin)
        scale = scaler.scale_for(x)
        assert scale.item() == pytest.approx(used, rel=1e-6), n
        expected_fp8 = (x * used).clamp(-FMAX, FMAX).to(E4M3)  # saturates when x outgrew the scale
        assert torch.equal(quantize(x, scale, E4M3).float(), expected_fp8.float()), n
        history = [amax] + history[:-1]
        assert scaler.amax_history.tolist() == history, n
        assert scaler.scale.item() == pytest.approx(expected_scale(history, algo, margin), rel=1e-6), n


def test_max_and_most_recent_differ():
    scales = {}
    for algo in ("max", "most_recent"):
        scaler = DelayedScaling(E4M3, 0, 4, algo)
        for amax in (8.0, 1.0):
            scaler.scale_for(tensor_with_amax(amax))
        scales[algo] = scaler.scale.item()
    assert scales == {"max": FMAX / 8.0, "most_recent": FMAX / 1.0}


def test_without_update_the_history_stays_and_non_finite_amaxes_are_skipped():
    scaler = DelayedScaling(E4M3, 0, 2, "max")
    scaler.scale_for(tensor_with_amax(2.0))
    assert scaler.scale_for(tensor_with_amax(64.0), update=False).item() == FMAX / 2.0  # eval: not recorded
    assert scaler.amax_history.tolist() == [2.0, 0.0]
    x = torch.tensor([1.0, math.inf])  # an fp16 overflow: the history is kept, the NaN shows
    x_fp8 = quantize(x, scaler.scale_for(x), E4M3)
    assert scaler.amax_history.tolist() == [2.0, 0.0] and scaler.scale.item() == FMAX / 2.0
    assert x_fp8.float()[0] == FMAX / 2.0 and x_fp8.float()[1].isnan()


def test_a_linear_layer_uses_the_previous_steps_scales():
    """Through Fp8Gemm: step n's forward output equals the reference GEMM with the input and
    weight scales of step n - 1's amaxes (history length 1, most recent)."""
    recipe = Fp8Recipe(format="hybrid", recipe="delayed", amax_history_len=1)
    gemm = Fp8Gemm(recipe, 32, 16, name="test")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=g).requires_grad_()
    previous = None
    for step in range(3):
        x = (step + 1.0) * torch.randn(16, 32, generator=g)
        y = gemm(x, w)
        y.sum().backward()
        amaxes = (x.abs().max().item(), w.abs().max().item())
        sx, sw = (FMAX / a for a in (previous or amaxes))
        ref = (((x * sx).clamp(-FMAX, FMAX).to(E4M3).float() / sx)
               @ ((w.detach() * sw).clamp(-FMAX, FMAX).to(E4M3).float() / sw).t())
        assert (y.detach() - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32 accumulation noise
        assert gemm.grad_output_scaler.amax_history.tolist() == [1.0]  # d(sum)/dy = 1
        previous = amaxes


def test_delayed_scaling_under_torch_compile_matches_eager():
    """--torch-compile compiles the layers: the histories (forward and backward) must advance as
    in eager mode and give the same results."""
    def run(compiled):
        recipe = Fp8Recipe(recipe="delayed", amax_history_len=3, amax_compute_algo="max")
        gemm = Fp8Gemm(recipe, 32, 16, name="test")
        w = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
        fn = torch.compile(gemm) if compiled else gemm
        g = torch.Generator().manual_seed(1)
        results = []
        for step in range(4):
            x = ((step + 1) * torch.randn(16, 32, generator=g)).bfloat16().requires_grad_()
            y = fn(x, w)
            (y.float() * (step + 1)).sum().backward()
            results.append((y.detach(), x.grad))
        scalers = (gemm.input_scaler, gemm.weight_scaler, gemm.grad_output_scaler)
        return results, [s.amax_history.tolist() for s in scalers]

    eager, eager_history = run(False)
    compiled, compiled_history = run(True)
    assert compiled_history == eager_history
    for (y, dx), (ref_y, ref_dx) in zip(compiled, eager):
        assert torch.equal(y, ref_y) and torch.equal(dx, ref_dx)
