"""The check of the causal convolution's Triton kernels on CPU tensors, which
test_causal_conv1d_triton.py runs in a subprocess (Triton reads TRITON_INTERPRET when kernels are
defined):

    PYTHONPATH=tests TRITON_INTERPRET=1 python tests/ssm/causal_conv1d_triton_cases.py

compares `causal_conv1d_silu` on the Triton path with silu(causal_conv1d) computed in float64 on the
same values: the output, the final state and the gradients of x, the weight and the bias, for each of CASES (x as a
strided slice of a wider tensor, as the mixers pass it) and of DOCUMENT_CASES (packed documents, seq_idx),
and with the PyTorch path for float16 inputs; prints how many it checked.
"""

from functools import partial

import torch
import torch.nn.functional as F

from ssm.packed_documents import seq_idx_of

# (b, s, c, k, with bias, transposed: x a [s, b] tensor seen as [b, s]): walks cut mid-sequence and
# channel blocks mid-channels, a sequence shorter than the kernel, kernels of 2 and 4 taps.
CASES = [
    (2, 37, 10, 4, True, False),
    (1, 130, 70, 4, False, True),
    (2, 2, 9, 4, True, True),
    (1, 65, 66, 2, True, False),
]

# (a case as above, each row's document lengths): packed documents against the walks' ends (WALKS:
# 16, 32 and 64 tokens; 4 in the short-walk runs): documents across 32, 64 and 96 and starting at 32 or
# 64, of length 1 (first, mid-row, last, two in a row) and 2, a row of one document; kernels of 4, 3 and
# 2 taps.
DOCUMENT_CASES = [
    ((2, 130, 10, 4, True, False), [[1, 31, 33, 1, 2, 62], [64, 1, 1, 3, 61]]),
    ((2, 100, 70, 3, False, True), [[2, 30, 1, 67], [100]]),
    ((1, 70, 9, 2, True, True), [[32, 1, 31, 5, 1]]),
]


def make_inputs(b, s, c, k, with_bias, transposed, seed=0, dtype=torch.float32, device="cpu"):
    """x [b, s, c] (a slice of a wider tensor, [s, b] in memory when transposed), weight [c, k], bias;
    the wide tensor made on `device` in `dtype` before slicing (moving or casting a slice copies it
    contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(s, b, c + 3, generator=gen) if transposed else torch.randn(b, s, c + 3, generator=gen)
    wide = wide.to(device, dtype)
    x = (wide.transpose(0, 1) if transposed else wide)[..., 2:2 + c]
    weight, bias = torch.randn(c, k, generator=gen) / k, torch.randn(c, generator=gen)
    return x, weight.to(device, dtype), bias.to(device, dtype) if with_bias else None


def output_and_grads(conv, x, weight, bias, seed=1):
    """(y, dx, dweight, dbias or None) of a random weighted sum of conv(x, weight, bias)'s output."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    y = conv(*leaves)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.device, y.dtype)
    grads = torch.autograd.grad(y, [t for t in leaves if t is not None], upstream)
    return [y.detach(), *grads] + ([None] if bias is None else [])


def reference(x, weight, bias, seq_idx=None):
    """silu(causal_conv1d) in float64, back in x's dtype."""
    from teratron.ssm.causal_conv1d import causal_conv1d
    y, _ = causal_conv1d(x.double(), weight.double(), bias.double() if bias is not None else None, seq_idx=seq_idx)
    return F.silu(y).to(x.dtype)


def assert_within_one_rounding(got, want):
    """Elementwise within one rounding of got's dtype, relative to want's largest entry."""
    rtol = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=rtol * want.abs().max().item())


def pytorch_path(x, weight, bias, seq_idx=None):
    from teratron.ssm.causal_conv1d import causal_conv1d
    return F.silu(causal_conv1d(x, weight, bias, seq_idx=seq_idx)[0])


def main():
    from teratron.ssm import causal_conv1d_triton as kernels
    from teratron.ssm.causal_conv1d import causal_conv1d, causal_conv1d_silu
    from teratron.ssm.causal_conv1d_triton import runs_here

    def triton_path(x, weight, bias, seq_idx=None):
        assert runs_here(x, weight, None), "the kernels do not take these inputs"
        y, _ = causal_conv1d_silu(x, weight, bias, seq_idx=seq_idx)
        return y

    x, weight, _ = make_inputs(1, 8, 4, 4, False, False)
    assert not runs_here(x, weight, torch.zeros(1, 4, 3)), "a decoding step's state takes the PyTorch path"
    assert not runs_here(x, torch.zeros(4, 5), None), "a kernel of more than MAX_TAPS takes the PyTorch path"
    checked = 0
    walks = kernels.WALKS
    short = {name: (4, 16, 1) for name in walks}  # walks of 4 tokens, blocks of 16 channels
    wide = kernels._wide
    # the CASES, then the second with walks of 4 tokens (several programs a sequence, the rows before
    # and after a walk carried in from the next programs' tokens, the weight and bias gradients summed
    # over programs), then the first with offsets computed in int64 (what sequences past 2**31 elements
    # take); then the DOCUMENT_CASES (seq_idx of int64, int32 and uint8), the first again with walks of 4
    # tokens and with int64 offsets
    def int64_offsets(t) -> bool:
        return True

    runs = [(case, None, walks, wide) for case in CASES] + [(CASES[1], None, short, wide),
                                                            (CASES[0], None, walks, int64_offsets)]
    runs += [(case, lengths, walks, wide) for case, lengths in DOCUMENT_CASES]
    runs += [(*DOCUMENT_CASES[0], short, wide), (*DOCUMENT_CASES[0], walks, int64_offsets)]
    index_dtypes = [torch.int64, torch.int32, torch.uint8]
    for run, (case, lengths, kernels.WALKS, kernels._wide) in enumerate(runs):
        inputs = make_inputs(*case)
        seq_idx = seq_idx_of(*lengths, dtype=index_dtypes[run % 3]) if lengths is not None else None
        got_all = output_and_grads(partial(triton_path, seq_idx=seq_idx), *inputs)
        for got, want in zip(got_all, output_and_grads(partial(reference, seq_idx=seq_idx), *inputs)):
            if want is None:
                assert got is None
                continue
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the final state (the last k - 1 inputs, of the last document alone), what a decoding step continues from
        torch.testing.assert_close(causal_conv1d_silu(*inputs, seq_idx=seq_idx)[1],
                                   causal_conv1d(*inputs, seq_idx=seq_idx)[1], rtol=0, atol=0)
        checked += 1
    kernels.WALKS, kernels._wide = walks, wide
    # float16 inputs against the PyTorch path in float16 (the pre-activation rounded to float16 in both):
    # within one rounding, relative to each result's largest entry. (bfloat16 is checked on a GPU: the
    # interpreter truncates to bfloat16 where GPUs round to nearest.)
    inputs = make_inputs(2, 37, 10, 4, True, True, dtype=torch.float16)
    for got, want in zip(output_and_grads(triton_path, *inputs), output_and_grads(pytorch_path, *inputs)):
        assert got.dtype == torch.float16
        assert_within_one_rounding(got, want)
    checked += 1
    print(f"checked {checked} cases on the Triton path")


if __name__ == "__main__":
    main()
