"""Random paged KV caches for test_paged_attention.py, and the check of the Triton kernel's code on
CPU tensors that it runs in a subprocess (Triton reads TRITON_INTERPRET when kernels are defined):

    TRITON_INTERPRET=1 python tests/inference/paged_attention_cases.py

compares the kernel, run by Triton's interpreter, with the plain-PyTorch reference on every case
of CASES (with 1 split of each context, and 3 for half of them), and prints how many it checked.
"""

import os
from dataclasses import dataclass

import torch

# (np, ng, hn, block_size): MHA, GQA, MQA; a power-of-2 head size and one that is not (80).
CASES = [(heads, groups, head_dim, block_size) for heads, groups in ((4, 4), (8, 2), (4, 1))
         for head_dim in (64, 80) for block_size in (16, 4)]


def lengths_for(block_size: int) -> list[int]:
    """One key; a partial first block; exactly two blocks; two and a bit; many blocks."""
    return [1, block_size - 1, 2 * block_size, 2 * block_size + 3, 150]


@dataclass
class PagedCase:
    query: torch.Tensor        # [n, np, hn]
    key_cache: torch.Tensor    # [num_blocks, block_size, ng, hn]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [n, max_blocks]
    kv_lengths: torch.Tensor   # int32 [n]
    softmax_scale: float

    def args(self):
        return self.query, self.key_cache, self.value_cache, self.block_table, self.kv_lengths, self.softmax_scale


def make_case(heads: int, groups: int, head_dim: int, block_size: int, lengths: list[int], dtype=torch.float32,
              device="cpu", seed: int = 0, max_blocks: int | None = None, num_blocks: int | None = None) -> PagedCase:
    """Each request's blocks are distinct and shuffled over the cache; table entries past a
    request's blocks are random block ids, and every cache slot no query attends to is NaN (a
    kernel that reads past kv_lengths returns NaN)."""
    generator = torch.Generator().manual_seed(seed)  # the tables; the values are drawn on `device`
    used = [-(-length // block_size) for length in lengths]
    max_blocks = max_blocks or max(used) + 2
    num_blocks = num_blocks or sum(used) + 3
    order = torch.randperm(num_blocks, generator=generator)
    table = torch.randint(num_blocks, (len(lengths), max_blocks), generator=generator)
    attended = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    first = 0
    for row, (length, count) in enumerate(zip(lengths, used)):
        table[row, :count] = order[first:first + count]
        first += count
        positions = torch.arange(length)
        attended[table[row, positions // block_size], positions % block_size] = True
    draw = dict(generator=torch.Generator(device).manual_seed(seed), device=device)
    caches = torch.randn(2, num_blocks, block_size, groups, head_dim, **draw)
    caches[:, ~attended.to(device)] = float("nan")
    query = torch.randn(len(lengths), heads, head_dim, **draw)
    return PagedCase(query.to(dtype), caches[0].to(dtype), caches[1].to(dtype), table.to(device, torch.int32),
                     torch.tensor(lengths, dtype=torch.int32, device=device), head_dim ** -0.5)


def main() -> None:
    import teratron.inference.kernels.paged_attention as module

    assert os.environ.get("TRITON_INTERPRET") == "1" and module.triton is not None, "needs Triton's interpreter"
    reference = module.paged_attention_reference

    def reference_must_not_run(*args):
        raise AssertionError("paged_attention took the reference path, not the Triton kernel")

    module.paged_attention_reference = reference_must_not_run
    checked = 0
    for seed, (heads, groups, head_dim, block_size) in enumerate(CASES):
        case = make_case(heads, groups, head_dim, block_size, lengths_for(block_size), seed=seed)
        expected = reference(*case.args())
        torch.testing.assert_close(module.paged_attention(*case.args()), expected, atol=1e-5, rtol=1e-5)
        if seed == 0:  # a query that is a strided view (as a slice of fused QKV would be)
            case.query = torch.cat([case.query, case.query], dim=-1)[..., :head_dim]
            torch.testing.assert_close(module.paged_attention(*case.args()), expected, atol=1e-5, rtol=1e-5)
        if block_size == 4:  # the interpreter is slow: split half of the cases
            torch.testing.assert_close(module.paged_attention_triton(*case.args(), num_splits=3), expected,
                                       atol=1e-5, rtol=1e-5)
        checked += 1
    # 16-bit inputs: the same to within one rounding of the output.
    for dtype in (torch.bfloat16, torch.float16):
        case = make_case(8, 2, 64, 4, lengths_for(4), dtype=dtype, seed=99)
        output = module.paged_attention(*case.args())
        assert output.dtype == dtype
        torch.testing.assert_close(output.float(), reference(*case.args()).float(), atol=1e-3, rtol=2 ** -7)
        checked += 1
    # Sliding windows and attention sinks, in one program per query and split over 3.
    sinks = torch.linspace(-2.0, 3.0, 8)
    for window_left, with_sinks in ((5, False), (0, True), (40, True), (-1, True)):
        case = make_case(8, 2, 64, 4, lengths_for(4), seed=40 + window_left)
        options = dict(window_left=window_left, sinks=sinks if with_sinks else None)
        expected = reference(*case.args(), **options)
        torch.testing.assert_close(module.paged_attention(*case.args(), **options), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(module.paged_attention_triton(*case.args(), **options, num_splits=3), expected,
                                   atol=1e-5, rtol=1e-5)
        checked += 1
    print(f"checked {checked} cases on the Triton path")


if __name__ == "__main__":
    main()
