"""The check of Mamba-2's gated norm Triton kernels on CPU tensors, which test_gated_norm_triton.py runs
in a subprocess (Triton reads TRITON_INTERPRET when kernels are defined):

    TRITON_INTERPRET=1 python tests/ssm/gated_norm_triton_cases.py

compares `gated_rmsnorm_triton` with GroupGatedRMSNorm's PyTorch path in float64 on the same values
(the output and the gradients of y, z and the weight; z a slice of a wider tensor laid out [s, b] and
the output's gradient laid out [s, b], as the mixer passes them), and with the PyTorch path in float16;
prints how many it checked.
"""

import torch

# (b, s, d, groups): tokens not a multiple of a program's tiles, two groups and one, a group size that is
# not a power of 2 (a padded tile)
CASES = [(2, 37, 32, 2), (1, 70, 24, 2), (3, 5, 16, 1)]


def make_inputs(b, s, d, seed=0, dtype=torch.float32, device="cpu"):
    """y [b, s, d] contiguous, z a slice of a [s, b, d + 5] tensor (as in the input projection), weight."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(b, s, d, generator=gen)
    wide = torch.randn(s, b, d + 5, generator=gen).to(device, dtype)
    weight = 1 + 0.1 * torch.randn(d, generator=gen)
    return y.to(device, dtype), wide.transpose(0, 1)[..., 3:3 + d], weight.to(device, dtype)


def output_and_grads(norm, y, z, weight, seed=1):
    """(out, dy, dz, dweight) of a random weighted sum of the output, its gradient laid out [s, b]."""
    leaves = [t.detach().requires_grad_() for t in (y, z, weight)]
    out = norm(*leaves)
    b, s, d = out.shape
    upstream = torch.randn(s, b, d, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    upstream = upstream.transpose(0, 1)
    grads = torch.autograd.grad(out, leaves, upstream)
    return [out.detach(), *grads]


def main():
    from teratron.ssm import gated_norm_triton as kernels
    from teratron.ssm.mamba_mixer import GroupGatedRMSNorm

    def reference(groups, dtype=torch.float64):
        def norm(y, z, weight):
            return GroupGatedRMSNorm(weight, groups, 1e-5).reference(y.to(dtype), z.to(dtype)).to(y.dtype)
        return norm

    def triton_path(groups):
        def norm(y, z, weight):
            assert kernels.runs_here(y, z), "the kernels do not take these inputs"
            return kernels.gated_rmsnorm_triton(y, z, weight, groups, 1e-5)
        return norm

    checked = 0
    for seed, (b, s, d, groups) in enumerate(CASES):
        inputs = make_inputs(b, s, d, seed)
        got = output_and_grads(triton_path(groups), *inputs)
        want = output_and_grads(reference(groups), *[t.double() for t in inputs])
        for name, g, w in zip(("out", "dy", "dz", "dweight"), got, want):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=lambda m: f"case {seed} {name}: {m}")
        assert got[0].stride() == (d, b * d, 1), "the output is laid out [s, b, d]"
        checked += 1
    # float16 against the PyTorch path in float16 (fp32 inside both): within one rounding of each
    # result's largest entry
    b, s, d, groups = CASES[0]
    inputs = make_inputs(b, s, d, 7, torch.float16)
    got = output_and_grads(triton_path(groups), *inputs)
    want = output_and_grads(reference(groups, torch.float32), *inputs)
    for name, g, w in zip(("out", "dy", "dz", "dweight"), got, want):
        assert g.dtype == torch.float16
        eps = torch.finfo(torch.float16).eps
        torch.testing.assert_close(g.double(), w.double(), rtol=eps, atol=eps * w.abs().max().item(),
                                   msg=lambda m: f"float16 {name}: {m}")
    checked += 1
    print(f"checked {checked} cases on the Triton path")


if __name__ == "__main__":
    main()
