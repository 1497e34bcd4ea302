"""Mamba-2's gated norm: its Triton kernels against the PyTorch path (in Triton's interpreter on the
CPU, compiled on a GPU), and GroupGatedRMSNorm's choice of path."""


import pytest
import torch

from ssm.gated_norm_triton_cases import CASES, make_inputs, output_and_grads
from ssm.kernel_tests import gpu_test, run_in_the_interpreter
from teratron.ssm import gated_norm_triton
from teratron.ssm.mamba_mixer import GroupGatedRMSNorm


def test_triton_kernels_in_the_interpreter_match_the_definition():
    assert run_in_the_interpreter("gated_norm_triton_cases.py") == f"checked {len(CASES) + 1} cases on the Triton path"


def test_on_the_cpu_the_pytorch_path_runs(monkeypatch):
    def triton_must_not_run(*args, **kwargs):
        raise AssertionError("GroupGatedRMSNorm took the Triton kernels")

    monkeypatch.setattr(gated_norm_triton, "gated_rmsnorm_triton", triton_must_not_run)
    y, z, weight = make_inputs(2, 5, 16)
    norm = GroupGatedRMSNorm(weight, 2, 1e-5)
    assert torch.equal(norm(y, z), norm.reference(y, z))


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
