"""Mamba-2's mixer core as one op (teratron.ssm.mamba_core) against MambaMixer's definition by the
PyTorch paths (in Triton's interpreter on the CPU, compiled on a GPU), and the mixer's choice of path."""

import pytest
import torch

from kernel_tests import H100_SHARED_MEMORY, compile_for_sm90, gpu_test, run_in_the_interpreter
from ssm.mamba_core_cases import CASES, EPS, make_inputs, output_and_grads, reference
from teratron.ssm import mamba_core, mamba_dt_triton
from teratron.ssm.mamba_mixer import MambaMixer
from teratron.transformer.transformer_config import TransformerConfig


def test_the_op_in_the_interpreter_matches_the_definition():
    assert run_in_the_interpreter(__file__, "mamba_core_cases.py") == (
        f"checked {len(CASES) + 3} cases on the Triton path")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_dt_kernels_compile_for_an_h100(dtype):
    """Triton and ptxas compile dt's and A's forward and backward kernels for sm_90 without a GPU, at 64
    heads."""
    constexprs = dict(ROWS=mamba_dt_triton.ROWS, BLOCK_H=64)
    forward = compile_for_sm90(mamba_dt_triton._dt_kernel, dtype, "dt_raw dt_bias A_log", "dt A",
                               constexprs=constexprs)
    backward = compile_for_sm90(mamba_dt_triton._dt_backward_kernel, dtype, "ddt_raw dt_raw dt_bias A_log dA_log",
                                "ddt dA dbias_parts", constexprs=constexprs)
    for compiled in (forward, backward):
        assert compiled.shared <= H100_SHARED_MEMORY


def test_on_the_cpu_the_mixer_composes_the_pytorch_paths(monkeypatch):
    def op_must_not_run(*args, **kwargs):
        raise AssertionError("MambaMixer took the mixer core op on CPU tensors")

    monkeypatch.setattr(mamba_core, "mamba_core", op_must_not_run)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, add_bias_linear=False)
    mixer = MambaMixer(config, d_state=16, head_dim=16, ngroups=2, chunk_size=16)
    out, _ = mixer(torch.randn(20, 2, 32))
    assert out.shape == (20, 2, 32)


@gpu_test
@pytest.mark.parametrize("case", CASES)
def test_on_a_gpu_the_op_matches_the_definition_in_fp32(case):
    b, s, heads, head_dim, groups, d_state, chunk = case
    inputs = [t.cuda() for t in make_inputs(b, s, heads, head_dim, groups, d_state)]
    inputs[0] = inputs[0].transpose(0, 1).contiguous().transpose(0, 1)  # laid out [s, b] on the GPU too
    got = output_and_grads(mamba_core.mamba_core, inputs, (head_dim, groups, d_state, chunk, EPS))
    want = output_and_grads(reference, [t.double() for t in inputs], (head_dim, groups, d_state, chunk))
    for g, w in zip(got, want):  # 1e-4 of each tensor's largest entry, as the scan's own fp32 GPU test
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4 * w.abs().max().item())
    assert got[1].stride() == inputs[0].stride()


@gpu_test
def test_on_a_gpu_the_op_matches_the_three_ops_composed_in_bf16():
    """A Mamba layer's shape (4 x 2,048 tokens, 64 heads x 64 in 8 groups, state 128, chunk 128):
    output and gradients within two bfloat16 roundings of the three ops composed (the same kernels;
    the composition rounds the scan's input gradient once more, in its concatenation's dtype)."""
    b, s, heads, head_dim, groups, d_state, chunk = 4, 2048, 64, 64, 8, 128, 128
    inputs = [t.cuda() for t in make_inputs(b, s, heads, head_dim, groups, d_state, dtype=torch.bfloat16)]
    inputs[0] = inputs[0].transpose(0, 1).contiguous().transpose(0, 1)
    sizes = (head_dim, groups, d_state, chunk, EPS)
    got = output_and_grads(mamba_core.mamba_core, inputs, sizes)
    want = output_and_grads(_composed, inputs, sizes)
    eps = torch.finfo(torch.bfloat16).eps
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.double(), w.double(), rtol=2 * eps, atol=2 * eps * w.abs().max().item())


def _composed(projected, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, head_dim, groups, d_state, chunk, eps,
              seq_idx=None):
    """The mixer's path before the op: the convolution's, the scan's and the norm's custom ops, composed."""
    import torch.nn.functional as F

    from teratron.ssm import causal_conv1d_triton, gated_norm_triton, ssd_triton

    sizes = dt_bias.shape[0], head_dim, groups, d_state
    z, xbc, dt_raw = mamba_core._split(projected, *sizes)
    xbc_act = causal_conv1d_triton.causal_conv1d_silu_triton(xbc, conv_weight, conv_bias, seq_idx)
    x, B, C = mamba_core._scan_inputs(xbc_act, *sizes)
    y, _ = ssd_triton.ssd_triton(x, F.softplus(dt_raw.float() + dt_bias.float()), -torch.exp(A_log.float()), B, C, D,
                                 chunk_size=chunk, seq_idx=seq_idx)
    return gated_norm_triton.gated_rmsnorm_triton(y.flatten(-2), z, norm_weight, groups, eps)
