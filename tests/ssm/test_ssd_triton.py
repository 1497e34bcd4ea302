"""ssd_triton, the Triton kernels of Mamba-2's scan, against ssd_chunked (in Triton's interpreter on
the CPU, compiled on a GPU: outputs, final states and every gradient), and `ssd`'s choice of path."""

import functools
import inspect
import re

import pytest
import torch

import teratron.ssm.ssd as ssd_module
import teratron.ssm.ssd_triton as kernels
from kernel_tests import H100_SHARED_MEMORY, compile_for_sm90, gpu_test, run_in_the_interpreter
from ssm.packed_documents import gpu_documents, seq_idx_of
from ssm.ssd_triton_cases import CASES, assert_close_to, make_inputs, outputs_and_grads, result_names
from teratron.ssm.ssd import ssd_chunked
from teratron.ssm.ssd_triton import ssd_triton


def test_triton_kernels_in_the_interpreter_match_ssd_chunked():
    assert run_in_the_interpreter(__file__, "ssd_triton_cases.py") == (
        f"checked {len(CASES) + 8} cases on the Triton path")


def test_ssd_on_the_cpu_runs_ssd_chunked(monkeypatch):
    """No CUDA and no interpreter here: `ssd` never reaches the kernels."""
    def triton_must_not_run(*args, **kwargs):
        raise AssertionError("ssd took the Triton kernels on CPU tensors")

    monkeypatch.setattr(ssd_module, "ssd_triton", triton_must_not_run)
    inputs = make_inputs(2, 37, 4, 2, 8, 16, with_state=True)
    y, final = ssd_module.ssd(*inputs, chunk_size=16)
    y_ref, final_ref = ssd_chunked(*inputs, chunk_size=16)
    assert torch.equal(y, y_ref) and torch.equal(final, final_ref)


@pytest.mark.parametrize("chunk_size,dtype", [(8, torch.float32), (48, torch.float32), (256, torch.float32),
                                              (64, torch.float64)])
def test_what_the_kernels_cannot_take_raises_one_line(chunk_size, dtype):
    x, dt, A, B, C, D, _ = make_inputs(1, 20, 2, 1, 8, 8)
    with pytest.raises(ValueError, match="^ssd_triton: ") as error:
        ssd_triton(x.to(dtype), dt, A, B, C, D, chunk_size=chunk_size)
    assert "\n" not in str(error.value)


# Each kernel's tensors: those of the activations' dtype (x, B, C, the chunks' states and their
# gradients), the others fp32; and its key in kernels.LAUNCH.
KERNEL_TENSORS = {
    "_chunk_state_kernel": ("u v states", "dt cum", "chunk_state"),
    "_chunk_scores_kernel": ("B C", "scores", "scores"),
    "_chunk_scan_kernel": ("x C states y", "dt D cum scores", "scan"),
    "_chunk_scan_backward_dcb_kernel": ("x dy", "dt cum scores dscores_parts dcum_intra", "dcb"),
    "_chunk_scan_backward_dx_kernel": ("x B dy dstates dx", "dt A D cum scores dlast_parts dcum_intra "
                                       "dcum_earlier_parts ddt_parts dAD_parts", "dx"),
    "_chunk_scan_backward_dbc_kernel": ("x B C dy states dstates dB dC",
                                        "dt cum dscores_parts dlast_parts dcum_earlier_parts", "dbc"),
}


def test_every_kernel_launch_has_its_configuration_and_every_configuration_is_used():
    """The keys the module's launches name (`shape.launch(key)`, `shape.meta(dtype, key)`) are
    exactly LAUNCH's, each a (warps, stages) pair Triton takes."""
    source = inspect.getsource(kernels)
    named = set(re.findall(r'\.launch\("(\w+)"\)', source)) | set(re.findall(r'\.meta\([^()]*, "(\w+)"\)', source))
    assert named == set(kernels.LAUNCH)
    for warps, stages in kernels.LAUNCH.values():
        assert warps in (1, 2, 4, 8, 16, 32) and stages >= 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_tile_kernels_compile_for_an_h100_within_its_shared_memory(dtype):
    """Triton and ptxas compile for sm_90 without a GPU: the kernels with [L, L] tiles at the
    largest chunk size, in the 16-bit (tf32) and the fp32 ("ieee") variants, each with its launch
    configuration (warps, stages)."""
    chunk = max(kernels.CHUNK_SIZES)
    shape = kernels._Shape(batch=1, seq=chunk, heads=1, head_dim=kernels.MAX_BLOCK, groups=1,
                           d_state=kernels.MAX_BLOCK, chunk=chunk, chunks=1)
    for name, (activations, fp32, launch) in KERNEL_TENSORS.items():
        block_p, block_n = shape.blocks
        constexprs = dict(L=chunk, BLOCK_P=block_p, BLOCK_N=block_n,
                          PRECISION="ieee" if dtype == "fp32" else "tf32", FROM_START=False, HAS_D=True,
                          HEADS_PER_SPLIT=4, SPLITS=2, N_PARTS=shape.n_blocks)
        compiled = compile_for_sm90(getattr(kernels, name), dtype, activations, fp32, constexprs=constexprs,
                                    options=shape.launch(launch))
        assert 0 < compiled.shared <= H100_SHARED_MEMORY, (name, compiled.shared)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_the_cumsum_kernel_compiles_for_an_h100(packed):
    """The one kernel that reads seq_idx (int32; packed documents), with and without it."""
    chunk = max(kernels.CHUNK_SIZES)
    shape = kernels._Shape(batch=1, seq=chunk, heads=1, head_dim=1, groups=1, d_state=1, chunk=chunk, chunks=1)
    constexprs = dict(START_LOG_DECAY=kernels.DOCUMENT_START_LOG_DECAY, HAS_SEQ_IDX=packed, L=chunk)
    compile_for_sm90(kernels._chunk_cumsum_kernel, "fp32", "", "dt A cum", ints="seq_idx", constexprs=constexprs,
                     options=shape.launch("cumsum"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("given", [False, True])
def test_the_state_passing_kernels_compile_for_an_h100(dtype, given):
    """The state passings forward and backward, with and without an initial state / a final state's
    gradient (HAS_INITIAL, HAS_DFINAL: the mixer core discards the final state)."""
    chunk = max(kernels.CHUNK_SIZES)
    shape = kernels._Shape(batch=1, seq=chunk, heads=1, head_dim=1, groups=1, d_state=1, chunk=chunk, chunks=1)
    sizes = dict(L=chunk, BLOCK=kernels.STATE_BLOCK)
    compile_for_sm90(kernels._state_passing_kernel, dtype, "states", "cum initial final",
                     constexprs=dict(sizes, HAS_INITIAL=given), options=shape.launch("state_passing"))
    compile_for_sm90(kernels._state_passing_backward_kernel, dtype, "dstates", "cum dfinal dinitial",
                     constexprs=dict(sizes, HAS_DFINAL=given), options=shape.launch("state_passing_backward"))


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq,chunk_size", [(1000, 32), (1000, 64), (4096, 128)])
@pytest.mark.parametrize("packed", [False, True])
def test_triton_on_a_gpu_matches_ssd_chunked(seq, chunk_size, dtype, packed, monkeypatch):
    """A Mamba-2 layer's head shape (p 64, n 128; 8 heads in 2 groups), a ragged last chunk at
    1,000 tokens; packed: the rows' documents of gpu_documents. fp32: against the float64 scan, to
    1e-4 of each tensor's largest entry (the sums run over thousands of terms); bf16 x, B, C and
    state: against ssd_chunked on the same inputs (fp32 there, tf32 products here), to a bf16
    rounding."""
    x, dt, A, B, C, D, state = make_inputs(2, seq, 8, 2, 64, 128, True, True, seed=seq, device="cuda")
    inputs = [x.to(dtype), dt, A, B.to(dtype), C.to(dtype), D, state.to(dtype)]
    seq_idx = seq_idx_of(*gpu_documents(seq)).cuda() if packed else None
    chunked = functools.partial(ssd_chunked, seq_idx=seq_idx)
    if dtype == torch.float32:
        want, rtol = outputs_and_grads(chunked, [t.double() for t in inputs], chunk_size), 1e-4
    else:
        want, rtol = outputs_and_grads(chunked, inputs, chunk_size), 2 ** -7

    def chunked_must_not_run(*args, **kwargs):
        raise AssertionError("ssd took ssd_chunked on CUDA tensors")

    monkeypatch.setattr(ssd_module, "ssd_chunked", chunked_must_not_run)
    got = outputs_and_grads(functools.partial(ssd_module.ssd, seq_idx=seq_idx), inputs, chunk_size)
    assert got[0].dtype == dtype and got[0].is_cuda
    assert_close_to(got, want, result_names(), rtol, f"seq {seq}, {dtype}, packed {packed}")


@gpu_test
def test_triton_gradients_on_a_gpu_are_reproducible():
    """No atomics: two runs give the same bits (docs/design.md)."""
    x, dt, A, B, C, D, state = make_inputs(1, 2000, 8, 2, 64, 128, True, True, seed=3, device="cuda")
    inputs = [x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), D, state]
    first, second = (outputs_and_grads(ssd_triton, inputs, 128) for _ in range(2))
    for name, a, b in zip(result_names(), first, second):
        assert torch.equal(a, b), name
