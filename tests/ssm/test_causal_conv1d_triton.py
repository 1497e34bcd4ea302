"""The causal convolution + SiLU's Triton kernels against the PyTorch path (in Triton's interpreter on
the CPU, compiled on a GPU), and `causal_conv1d_silu`'s choice of path."""

import importlib
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from kernel_tests import H100_SHARED_MEMORY, compile_for_sm90, gpu_test, run_in_the_interpreter
from ssm.causal_conv1d_triton_cases import (CASES, DOCUMENT_CASES, assert_within_one_rounding, make_inputs,
                                            output_and_grads, pytorch_path, reference)
from ssm.packed_documents import seq_idx_of
from teratron.ssm.causal_conv1d import causal_conv1d, causal_conv1d_silu


def test_triton_kernels_in_the_interpreter_match_the_definition():
    assert run_in_the_interpreter(__file__, "causal_conv1d_triton_cases.py") == (
        f"checked {len(CASES) + len(DOCUMENT_CASES) + 5} cases on the Triton path")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_the_kernels_compile_for_an_h100_within_its_shared_memory(dtype, wide, packed):
    """Triton and ptxas compile the three passes for sm_90 without a GPU, with their walks and warps, 4
    taps, in the int32 and the int64 (WIDE) offsets, with and without packed documents (HAS_SEQ_IDX)."""
    import teratron.ssm.causal_conv1d_triton as kernels

    taps = dict(WIDE=wide, HAS_BIAS=True, HAS_SEQ_IDX=packed, K=kernels.MAX_TAPS)
    for kernel, activations, fp32, name in [
        (kernels._forward_kernel, "x weight bias y", "", "forward"),
        (kernels._gate_kernel, "x weight bias dy gate", "parts", "gate"),
        (kernels._dx_kernel, "weight gate dx", "", "dx"),
    ]:
        walk, block_c, warps = kernels.WALKS[name]
        compiled = compile_for_sm90(kernel, dtype, activations, fp32, constexprs=dict(taps, WALK=walk, BLOCK_C=block_c),
                                    options=dict(num_warps=warps), ints="seq_idx")
        assert compiled.shared <= H100_SHARED_MEMORY, (kernel.fn.__name__, compiled.shared)


def test_on_the_cpu_and_from_a_state_the_pytorch_path_runs(monkeypatch):
    """No CUDA and no interpreter here, and a decoding step's state: never the kernels (packed
    documents too)."""
    def triton_must_not_run(*args, **kwargs):
        raise AssertionError("causal_conv1d_silu took the Triton kernels")

    module = importlib.import_module("teratron.ssm.causal_conv1d")  # the package exports its function by that name
    monkeypatch.setattr(module, "causal_conv1d_silu_triton", triton_must_not_run)
    x, weight, bias = make_inputs(2, 9, 6, 4, True, False)
    state, seq_idx = torch.randn(2, 6, 3), seq_idx_of([2, 1, 6], [9])
    for initial, documents in ((None, None), (state, None), (None, seq_idx), (state, seq_idx)):
        y, final = causal_conv1d_silu(x, weight, bias, initial, documents)
        y_ref, final_ref = causal_conv1d(x, weight, bias, initial, documents)
        assert torch.equal(y, F.silu(y_ref)) and torch.equal(final, final_ref)


# Packed documents of a Mamba layer's 4 x 2,048 tokens: lengths 1 and 2, documents across tiles and
# starting at their boundaries, a row of one document.
GPU_DOCUMENTS = [[1, 63, 1000, 984], [2048], [511, 1, 1, 2, 1533], [64, 64, 1920]]


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_triton_on_a_gpu_matches_the_pytorch_path(dtype, transposed, packed):
    """A Mamba layer's shape (4 x 2,048 tokens, 6,144 channels; x a slice of a wider [s, b] or [b, s]
    tensor), one sequence a row or packed documents (GPU_DOCUMENTS, the same seq_idx on both paths).
    bfloat16: output and gradients within one rounding of the PyTorch path in bfloat16 (both round the
    pre-activation and the gate's gradient to bfloat16). float32: within the fp32 rounding of a sum of
    k + 1 terms (k taps and the bias) of the definition in float64, as each path sums in its own order."""
    k = 4
    x, weight, bias = make_inputs(4, 2048, 6144, k, True, transposed, dtype=dtype, device="cuda")
    assert x.stride(-2) > x.shape[-1], "x is a slice of a wider tensor"
    seq_idx = seq_idx_of(*GPU_DOCUMENTS).cuda() if packed else None

    def triton_path(*inputs):
        return causal_conv1d_silu(*inputs, seq_idx=seq_idx)[0]

    results = output_and_grads(triton_path, x, weight, bias)
    if dtype == torch.bfloat16:
        for got, want in zip(results, output_and_grads(partial(pytorch_path, seq_idx=seq_idx), x, weight, bias)):
            assert got.dtype == want.dtype == dtype
            assert_within_one_rounding(got, want)
        return
    for got, want in zip(results, output_and_grads(partial(reference, seq_idx=seq_idx),
                                                   *(t.double() for t in (x, weight, bias)))):
        rtol = (k + 1) * torch.finfo(torch.float32).eps
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())
