"""Mamba-2's gated norm: its Triton kernels against the PyTorch path (in Triton's interpreter on the
CPU, compiled on a GPU), and GroupGatedRMSNorm's choice of path."""


import pytest
import torch

from kernel_tests import H100_SHARED_MEMORY, compile_for_sm90, gpu_test, run_in_the_interpreter
from ssm.gated_norm_triton_cases import CASES, make_inputs, output_and_grads
from teratron.ssm import gated_norm_triton
from teratron.ssm.mamba_mixer import GroupGatedRMSNorm


def test_triton_kernels_in_the_interpreter_match_the_definition():
    assert run_in_the_interpreter(__file__, "gated_norm_triton_cases.py") == (
        f"checked {len(CASES) + 1} cases on the Triton path")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_kernels_compile_for_an_h100_within_its_shared_memory(dtype):
    """Triton and ptxas compile both kernels for sm_90 without a GPU, at a Mamba layer's groups of 8
    heads x 64 (512 channels), with their rows, tiles and warps."""
    tiles = dict(GROUP=512, BLOCK=512, ROWS=gated_norm_triton.ROWS, TILES=gated_norm_triton.TILES)
    options = dict(num_warps=gated_norm_triton.WARPS)
    forward = compile_for_sm90(gated_norm_triton._forward_kernel, dtype, "y z weight out", "rstd", floats="eps",
                               constexprs=tiles, options=options)
    backward = compile_for_sm90(gated_norm_triton._backward_kernel, dtype, "dout y z weight dy dz",
                                "rstd dweight_parts", constexprs=tiles, options=options)
    for compiled in (forward, backward):
        assert compiled.shared <= H100_SHARED_MEMORY


def test_on_the_cpu_the_pytorch_path_runs(monkeypatch):
    def triton_must_not_run(*args, **kwargs):
        raise AssertionError("GroupGatedRMSNorm took the Triton kernels")

    monkeypatch.setattr(gated_norm_triton, "gated_rmsnorm_triton", triton_must_not_run)
    y, z, weight = make_inputs(2, 5, 16)
    norm = GroupGatedRMSNorm(weight, 2, 1e-5)
    assert torch.equal(norm(y, z), norm.reference(y, z))


def test_what_the_kernels_do_not_take(monkeypatch):
    """float64, mixed dtypes and channels that are not contiguous go to the PyTorch path; groups that
    do not divide the channels are refused with one line."""
    monkeypatch.setattr(gated_norm_triton, "INTERPRETED", True)  # CPU tensors count as the kernels'
    y, z, weight = make_inputs(2, 5, 16)
    assert gated_norm_triton.runs_here(y, z)
    assert not gated_norm_triton.runs_here(y.double(), z.double())
    assert not gated_norm_triton.runs_here(y, z.half())
    assert not gated_norm_triton.runs_here(y, torch.randn(2, 5, 32)[..., ::2])
    for make in (lambda: GroupGatedRMSNorm(weight, 3, 1e-5),
                 lambda: gated_norm_triton.gated_rmsnorm_triton(y, z, weight, 3, 1e-5)):
        with pytest.raises(ValueError, match="16 channels do not split into 3 groups; choose groups dividing") as error:
            make()
        assert "\n" not in str(error.value)


@gpu_test
def test_triton_on_a_gpu_matches_the_pytorch_path_in_bf16():
    """A Mamba layer's shape (4 x 2,048 tokens, 64 heads x 64 in 8 groups): output and gradients within
    one bfloat16 rounding of the PyTorch path in bfloat16 (both compute in fp32 and round once)."""
    y, z, weight = make_inputs(4, 2048, 4096, dtype=torch.bfloat16, device="cuda")
    got = output_and_grads(lambda *t: GroupGatedRMSNorm(t[2], 8, 1e-5)(*t[:2]), y, z, weight)
    want = output_and_grads(lambda *t: GroupGatedRMSNorm(t[2], 8, 1e-5).reference(*t[:2]), y, z, weight)
    eps = torch.finfo(torch.bfloat16).eps
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), w.double(), rtol=eps, atol=eps * w.abs().max().item())


@gpu_test
@pytest.mark.parametrize("case", CASES)
def test_triton_on_a_gpu_matches_the_definition_in_fp32(case):
    b, s, d, groups = case
    y, z, weight = make_inputs(b, s, d, device="cuda")
    got = output_and_grads(lambda *t: gated_norm_triton.gated_rmsnorm_triton(*t, groups, 1e-5), y, z, weight)
    want = output_and_grads(lambda *t: GroupGatedRMSNorm(t[2], groups, 1e-5).reference(*t[:2]),
                            y.double(), z.double(), weight.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
