"""paged_attention: the plain-PyTorch reference against a per-query loop, the Triton kernel (in
Triton's interpreter on the CPU, compiled on a GPU) against the reference, and CUDA-graph replay."""

import pytest
import torch

from inference.paged_attention_cases import CASES, lengths_for, make_case
from kernel_tests import gpu_test, run_in_the_interpreter
from teratron.inference.kernels.paged_attention import (paged_attention, paged_attention_reference,
                                                        paged_attention_triton)


def loop_attention(case, window_left=-1, sinks=None) -> torch.Tensor:
    """softmax(q k^T * scale) v over each query's first kv_lengths keys (its last window_left + 1
    of them with a window; with sinks, exp(sink) added to each head's denominator), one query head
    at a time, in fp64; [n, np, hn]."""
    n, heads, head_dim = case.query.shape
    block_size, groups = case.key_cache.shape[1:3]
    output = torch.empty(n, heads, head_dim, dtype=torch.float64)
    for i in range(n):
        length = int(case.kv_lengths[i])
        positions = torch.arange(max(0, length - 1 - window_left) if window_left >= 0 else 0, length)
        blocks = case.block_table[i, positions // block_size].long()
        keys = case.key_cache[blocks, positions % block_size].double()  # [L, ng, hn]
        values = case.value_cache[blocks, positions % block_size].double()
        for head in range(heads):
            group = head // (heads // groups)
            scores = keys[:, group] @ case.query[i, head].double() * case.softmax_scale
            exp = torch.exp(scores - scores.max())
            denominator = exp.sum() + (0 if sinks is None else torch.exp(sinks[head].double() - scores.max()))
            output[i, head] = (exp / denominator) @ values[:, group]
    return output


@pytest.mark.parametrize("heads,groups,head_dim,block_size", CASES)
def test_reference_matches_a_loop_over_queries(heads, groups, head_dim, block_size):
    case = make_case(heads, groups, head_dim, block_size, lengths_for(block_size), seed=heads + head_dim + block_size)
    output = paged_attention(*case.args())  # on the CPU without TRITON_INTERPRET: the reference
    assert output.dtype == torch.float32 and output.shape == case.query.shape
    torch.testing.assert_close(output, loop_attention(case).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window_left", [-1, 0, 5, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_with_windows_and_sinks_matches_a_loop(window_left, with_sinks):
    case = make_case(8, 2, 64, 4, lengths_for(4), seed=11 + window_left)
    sinks = torch.linspace(-2.0, 3.0, 8) if with_sinks else None
    output = paged_attention(*case.args(), window_left=window_left, sinks=sinks)
    torch.testing.assert_close(output, loop_attention(case, window_left, sinks).float(), atol=1e-5, rtol=1e-5)


def test_reference_returns_the_query_dtype():
    case = make_case(8, 2, 64, 4, lengths_for(4), dtype=torch.bfloat16, seed=5)
    output = paged_attention_reference(*case.args())
    assert output.dtype == torch.bfloat16
    # Computed in fp32 and rounded once: within one bf16 rounding of the exact result.
    torch.testing.assert_close(output.float(), loop_attention(case).float(), atol=1e-5, rtol=2 ** -7)


def test_triton_kernel_in_the_interpreter_matches_the_reference():
    assert run_in_the_interpreter(__file__, "paged_attention_cases.py") == (
        f"checked {len(CASES) + 2 + 4} cases on the Triton path")


@pytest.mark.parametrize("problem", [
    dict(heads=4, groups=3, cache=(8, 4, 3, 16)),
    dict(cache=(8, 4, 2, 32)),
    dict(table_dtype=torch.int64),
    dict(table_rows=3),
])
def test_bad_shapes_raise_one_line(problem):
    query = torch.zeros(2, problem.get("heads", 4), 16)
    cache = torch.zeros(problem.get("cache", (8, 4, 2, 16)))
    table = torch.zeros(problem.get("table_rows", 2), 3, dtype=problem.get("table_dtype", torch.int32))
    with pytest.raises(ValueError, match="^paged_attention: ") as error:
        paged_attention(query, cache, cache, table, torch.ones(2, dtype=torch.int32), 0.25)
    assert "\n" not in str(error.value)


def random_lengths(n: int, longest: int, seed: int) -> list[int]:
    """n lengths in 1 .. longest, both ends included."""
    lengths = torch.randint(1, longest + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [1, longest, *lengths[2:]][:n] if n > 1 else [longest]


# The benchmark shape (np = ng = 16, hn = 128), batch 256 and batch 1 (split contexts); GQA and MQA.
GPU_SHAPES = [(256, 16, 16, 128), (1, 16, 16, 128), (64, 32, 4, 128), (8, 8, 1, 80)]
# 16-bit outputs: within one rounding of the output (2 ** -8 relative for bf16) and a little more.
GPU_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-3, rtol=2 ** -7),
                 torch.float16: dict(atol=1e-3, rtol=2 ** -10)}


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,heads,groups,head_dim", GPU_SHAPES)
def test_triton_kernel_on_gpu_matches_the_reference(n, heads, groups, head_dim, dtype):
    case = make_case(heads, groups, head_dim, 16, random_lengths(n, 2048, seed=n), dtype=dtype, device="cuda")
    expected = paged_attention_reference(*case.args())
    for output in (paged_attention(*case.args()), paged_attention_triton(*case.args(), num_splits=1),
                   paged_attention_triton(*case.args(), num_splits=7)):
        assert output.dtype == dtype
        torch.testing.assert_close(output, expected, **GPU_TOLERANCE[dtype])


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window_left,with_sinks", [(127, False), (1023, True), (-1, True), (0, True)])
def test_triton_kernel_on_gpu_with_windows_and_sinks_matches_the_reference(window_left, with_sinks, dtype):
    """gpt-oss's layers: a window of 128 keys without sinks and of 1,024 with learned sinks, and full
    attention with sinks, at the lengths where splitting applies (batch 4, up to 2,048 keys)."""
    case = make_case(16, 4, 64, 16, random_lengths(4, 2048, seed=3), dtype=dtype, device="cuda", seed=3)
    sinks = torch.linspace(-2.0, 3.0, 16, device="cuda") if with_sinks else None
    options = dict(window_left=window_left, sinks=sinks)
    expected = paged_attention_reference(*case.args(), **options)
    for output in (paged_attention(*case.args(), **options),
                   paged_attention_triton(*case.args(), num_splits=1, **options),
                   paged_attention_triton(*case.args(), num_splits=7, **options)):
        torch.testing.assert_close(output, expected, **GPU_TOLERANCE[dtype])


@gpu_test
@pytest.mark.parametrize("attention", [paged_attention, paged_attention_reference])
@pytest.mark.parametrize("n", [256, 1])
def test_paged_attention_replays_in_a_cuda_graph(attention, n):
    shapes = dict(max_blocks=130, num_blocks=130 * n + 3)
    case = make_case(16, 16, 128, 16, random_lengths(n, 2048, seed=1), torch.bfloat16, "cuda", seed=1, **shapes)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention(*case.args())  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = attention(*case.args())
    before = output.clone()
    new = make_case(16, 16, 128, 16, random_lengths(n, 2000, seed=2), torch.bfloat16, "cuda", seed=2, **shapes)
    for static, value in zip(case.args()[:5], new.args()[:5]):
        static.copy_(value)
    graph.replay()
    assert not torch.equal(output, before)
    assert torch.equal(output, attention(*new.args()))
