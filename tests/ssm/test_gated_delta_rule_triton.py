"""gated_delta_rule_triton, the Triton kernels of Gated DeltaNet's chunked gated delta rule, against
gated_delta_rule_chunked (in Triton's interpreter on the CPU, compiled on a GPU: outputs, final
states and every gradient), and `gated_delta_rule`'s choice of path."""

import functools
import inspect
import re

import pytest
import torch

import teratron.ssm.gated_delta_rule as rule_module
import teratron.ssm.gated_delta_rule_triton as kernels
from kernel_tests import H100_SHARED_MEMORY, compile_for_sm90, gpu_test, run_in_the_interpreter
from ssm.gated_delta_rule_triton_cases import CASES, assert_close_to, make_inputs, outputs_and_grads, result_names
from ssm.packed_documents import gpu_documents, seq_idx_of
from teratron.ssm.gated_delta_rule import gated_delta_rule_chunked
from teratron.ssm.gated_delta_rule_triton import gated_delta_rule_triton


def test_triton_kernels_in_the_interpreter_match_gated_delta_rule_chunked():
    assert run_in_the_interpreter(__file__, "gated_delta_rule_triton_cases.py") == (
        f"checked {len(CASES) + 9} cases on the Triton path")


def test_gated_delta_rule_on_the_cpu_runs_gated_delta_rule_chunked(monkeypatch):
    """No CUDA and no interpreter here: `gated_delta_rule` never reaches the kernels."""
    def triton_must_not_run(*args, **kwargs):
        raise AssertionError("gated_delta_rule took the Triton kernels on CPU tensors")

    monkeypatch.setattr(rule_module, "gated_delta_rule_triton", triton_must_not_run)
    inputs = make_inputs(2, 37, 2, 16, 8, with_state=True)
    o, final = rule_module.gated_delta_rule(*inputs, chunk_size=16)
    o_ref, final_ref = gated_delta_rule_chunked(*inputs, chunk_size=16)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


@pytest.mark.parametrize("chunk_size,dtype,dk", [(8, torch.float32, 16), (48, torch.float32, 16),
                                                 (128, torch.float32, 16), (64, torch.float64, 16),
                                                 (64, torch.float32, 256)])
def test_what_the_kernels_cannot_take_raises_one_line(chunk_size, dtype, dk):
    q, k, v, g, beta, _ = make_inputs(1, 20, 2, dk, 8)
    with pytest.raises(ValueError, match="^gated_delta_rule_triton: ") as error:
        gated_delta_rule_triton(q, k, v.to(dtype), g, beta, chunk_size=chunk_size)
    assert "\n" not in str(error.value)


# Each kernel's tensors: those of the inputs' dtype (q, k, v, beta, dO, their gradients and the buffers W, U,
# the states and their gradients, kept in v's dtype), the others fp32.
KERNEL_TENSORS = {
    "_chunk_solve_kernel": ("k v beta w u", "g cum solve"),
    "_state_passing_kernel": ("k w u states", "cum initial final"),
    "_chunk_output_kernel": ("q k o u states", "cum"),
    "_chunk_output_backward_kernel": ("q k do", "cum du"),
    "_state_passing_backward_kernel": ("q k beta do dstates", "cum solve drhs dfinal dinitial"),
    "_chunk_backward_kernel": ("q k v beta do dq dk_out dv_out dbeta u states dstates", "cum drhs dg"),
}
# Each kernel's key in kernels.LAUNCH (the solve's second use, rebuilding W and U from T: "solved").
KERNEL_LAUNCH = {"_chunk_solve_kernel": "solve", "_state_passing_kernel": "state_passing",
                 "_chunk_output_kernel": "output", "_chunk_output_backward_kernel": "output_backward",
                 "_state_passing_backward_kernel": "state_passing_backward", "_chunk_backward_kernel": "backward"}


def test_every_kernel_launch_has_its_configuration_and_every_configuration_is_used():
    """The keys the module's launches name (`shape.meta(dtype, key)`, `shape.state_meta(dtype, key)`)
    are exactly LAUNCH's, each a (warps, stages) pair Triton takes."""
    source = inspect.getsource(kernels)
    named = {key for call in re.findall(r"\.(?:state_)?meta\(v\.dtype, ([^)]*)\)", source)
             for key in re.findall(r'"(\w+)"', call)}
    assert named == set(kernels.LAUNCH) == {*KERNEL_LAUNCH.values(), "solved"}
    for warps, stages in kernels.LAUNCH.values():
        assert warps in (1, 2, 4, 8, 16, 32) and stages >= 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_kernels_compile_for_an_h100_within_its_shared_memory(dtype):
    """Triton and ptxas compile for sm_90 without a GPU: the six kernels at GatedDeltaNet's chunk of
    64 and the largest dk, in the 16-bit (tf32) and the fp32 ("ieee") variants, each with its launch
    configuration (warps, stages)."""
    chunk = max(kernels.CHUNK_SIZES)
    for name, (activations, fp32) in KERNEL_TENSORS.items():
        kernel = getattr(kernels, name)
        shape = kernels._Shape(batch=1, seq=chunk, heads=1, key_dim=kernels.MAX_KEY_DIM, value_dim=kernels.MAX_KEY_DIM,
                               chunk=chunk, chunks=1)
        for solved in (False, True) if "SOLVED" in kernel.arg_names else (False,):  # the solve's two uses
            launch = "solved" if solved else KERNEL_LAUNCH[name]
            block = shape.block(kernels.MAX_KEY_DIM, launch)
            constexprs = dict(L=chunk, BLOCK_K=block, BLOCK_V=block,
                              KEY_TILE=kernels.MAX_KEY_DIM, STATE_ROWS=kernels.STATE_ROWS,
                              PRECISION="ieee" if dtype == "fp32" else "tf32", HAS_INITIAL=True, SOLVED=solved)
            compiled = compile_for_sm90(kernel, dtype, activations, fp32, constexprs=constexprs,
                                        options=shape.launch(launch))
            assert 0 < compiled.shared <= H100_SHARED_MEMORY, (name, solved, compiled.shared)


@gpu_test
@pytest.mark.parametrize("dtype,qk_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("seq", [1000, 4096])
@pytest.mark.parametrize("packed", [False, True])
def test_triton_on_a_gpu_matches_gated_delta_rule_chunked(seq, dtype, qk_dtype, packed, monkeypatch):
    """A Gated DeltaNet layer's head shape (dk = dv = 128, 8 heads, chunk 64), a ragged last chunk
    at 1,000 tokens; packed: the rows' documents of gpu_documents. fp32: against the float64 rule,
    to 1e-4 of each tensor's largest entry (the sums run over thousands of terms); bf16 v, beta and
    state (fp32 g; q and k in bf16 as GatedDeltaNet passes them, or fp32): against
    gated_delta_rule_chunked on the same inputs (fp32 there, tf32 and bf16 products here), to a
    bf16 rounding."""
    q, k, v, g, beta, state = make_inputs(2, seq, 8, 128, 128, True, seed=seq, device="cuda")
    inputs = [q.to(qk_dtype), k.to(qk_dtype), v.to(dtype), g, beta.to(dtype), state.to(dtype)]
    seq_idx = seq_idx_of(*gpu_documents(seq)).cuda() if packed else None
    chunked = functools.partial(gated_delta_rule_chunked, seq_idx=seq_idx)
    if dtype == torch.float32:
        want, rtol = outputs_and_grads(chunked, [t.double() for t in inputs], 64), 1e-4
    else:
        want, rtol = outputs_and_grads(chunked, inputs, 64), 2 ** -7

    def chunked_must_not_run(*args, **kwargs):
        raise AssertionError("gated_delta_rule took gated_delta_rule_chunked on CUDA tensors")

    monkeypatch.setattr(rule_module, "gated_delta_rule_chunked", chunked_must_not_run)
    got = outputs_and_grads(functools.partial(rule_module.gated_delta_rule, seq_idx=seq_idx), inputs, 64)
    assert got[0].dtype == dtype and got[0].is_cuda
    assert_close_to(got, want, result_names(), rtol, f"seq {seq}, {dtype}, packed {packed}")


@gpu_test
def test_triton_gradients_on_a_gpu_are_reproducible():
    """No atomics: two runs give the same bits (docs/design.md)."""
    q, k, v, g, beta, state = make_inputs(1, 2000, 8, 128, 128, True, seed=3, device="cuda")
    inputs = [q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state]  # as GatedDeltaNet passes them
    first, second = (outputs_and_grads(gated_delta_rule_triton, inputs, 64) for _ in range(2))
    for name, a, b in zip(result_names(), first, second):
        assert torch.equal(a, b), name
