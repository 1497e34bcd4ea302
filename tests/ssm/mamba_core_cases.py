"""The check of Mamba-2's mixer core op (teratron.ssm.mamba_core) on CPU tensors, which
test_mamba_core.py runs in a subprocess (Triton reads TRITON_INTERPRET when kernels are defined):

    TRITON_INTERPRET=1 python tests/ssm/mamba_core_cases.py

compares `mamba_core` (the convolution's, the scan's and the norm's Triton kernels) with MambaMixer's
definition composed of the PyTorch paths (causal_conv1d, ssd_chunked, GroupGatedRMSNorm.reference)
in float64 on the same values: the output and the gradients of the input projection's output (laid
out [s, b], as the mixer passes it) and of every parameter; and that the projection's gradient comes
laid out as the projection's output, with and without packed documents (seq_idx); and that a
MambaMixer takes the op, with the results of the three ops composed. Prints how many cases it checked.
"""

import torch
import torch.nn.functional as F

from ssm.packed_documents import seq_idx_of

# (b, s, heads, head_dim, groups, d_state, chunk): a ragged last chunk, groups of several heads, one group
CASES = [(2, 37, 4, 16, 2, 16, 16), (1, 70, 2, 16, 1, 32, 32)]
EPS = 1e-5


def make_inputs(b, s, heads, head_dim, groups, d_state, seed=0, dtype=torch.float32):
    """projected [b, s, parts] (a view of a [s, b, parts] tensor) and the parameters, as MambaMixer
    holds them (conv_weight [c, k])."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    d, c = heads * head_dim, heads * head_dim + 2 * groups * d_state
    projected = randn(s, b, d + c + heads).transpose(0, 1)
    return (projected, randn(c, 4, scale=0.5), randn(c, scale=0.1), randn(heads) - 1, randn(heads),
            randn(heads), 1 + randn(d, scale=0.1))


def reference(projected, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, head_dim, groups, d_state, chunk,
              seq_idx=None):
    """MambaMixer's definition by the PyTorch paths."""
    from teratron.ssm.causal_conv1d import causal_conv1d
    from teratron.ssm.mamba_core import _scan_inputs, _split
    from teratron.ssm.mamba_mixer import GroupGatedRMSNorm
    from teratron.ssm.ssd import ssd_chunked

    sizes = dt_bias.shape[0], head_dim, groups, d_state
    z, xbc, dt_raw = _split(projected, *sizes)
    xbc_act = F.silu(causal_conv1d(xbc, conv_weight, conv_bias, seq_idx=seq_idx)[0])
    x, B, C = _scan_inputs(xbc_act, *sizes)
    y, _ = ssd_chunked(x, F.softplus(dt_raw + dt_bias), -torch.exp(A_log), B, C, D, chunk_size=chunk, seq_idx=seq_idx)
    return GroupGatedRMSNorm(norm_weight, groups, EPS).reference(y.flatten(-2), z)


def output_and_grads(core, inputs, sizes, seed=1, seq_idx=None):
    """(out, then the gradient of each input) of a random weighted sum of the output, its gradient
    laid out [s, b] (as the output projection's comes)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = core(*leaves, *sizes, seq_idx=seq_idx)
    b, s, d = out.shape
    upstream = torch.randn(s, b, d, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, upstream.transpose(0, 1))]


def main():
    from teratron.ssm import mamba_core

    names = ("out", "projected", "conv_weight", "conv_bias", "dt_bias", "A_log", "D", "norm_weight")
    checked = 0
    # the last case again with packed documents: each row's lengths, one ending on a chunk boundary
    packed = seq_idx_of([1, 31, 38], [70])
    for seed, ((b, s, heads, head_dim, groups, d_state, chunk), seq_idx) in enumerate(
            [(case, None) for case in CASES] + [((2,) + CASES[-1][1:], packed)]):
        inputs = make_inputs(b, s, heads, head_dim, groups, d_state, seed)
        assert mamba_core.runs_here(inputs[0], inputs[1], chunk), "the op does not take these inputs"
        got = output_and_grads(mamba_core.mamba_core, inputs, (head_dim, groups, d_state, chunk, EPS),
                               seq_idx=seq_idx)
        want = output_and_grads(reference, [t.double() for t in inputs], (head_dim, groups, d_state, chunk),
                                seq_idx=seq_idx)
        for name, g, w in zip(names, got, want):
            # packed documents: 1e-5 of each tensor's largest entry, as the scan's own packed cases (a
            # document's start adds -128 to the running log-decays: docs/hybrid.md)
            atol = 1e-5 * (w.abs().max().item() if seq_idx is not None else 1)
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=atol, msg=lambda m: f"case {seed} {name}: {m}")
        assert got[1].stride() == inputs[0].stride(), "the projection's gradient is laid out as its output"
        assert got[0].stride() == (got[0].shape[2], got[0].shape[0] * got[0].shape[2], 1), "out is laid out [s, b]"
        checked += 1
    checked += check_the_mixer_takes_the_op()
    checked += check_dt_and_A()
    print(f"checked {checked} cases on the Triton path")


def check_the_mixer_takes_the_op() -> int:
    """A MambaMixer's output and gradients by the op equal those by the three ops composed (the
    same kernels; fp32): the mixer passes its parameters and sizes as the op takes them."""
    from unittest import mock

    from teratron.ssm import mamba_core
    from teratron.ssm.mamba_mixer import MambaMixer
    from teratron.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, add_bias_linear=False)
    mixer = MambaMixer(config, d_state=16, head_dim=16, ngroups=2, chunk_size=16)
    hidden = torch.randn(37, 2, 32)
    upstream = torch.randn(37, 2, 32)

    def run():
        mixer.zero_grad()
        leaf = hidden.clone().requires_grad_()
        out, _ = mixer(leaf)
        out.backward(upstream)
        return [out.detach(), leaf.grad] + [p.grad for p in mixer.parameters()]

    with mock.patch.object(mamba_core, "mamba_core", wraps=mamba_core.mamba_core) as core:
        fused = run()
        assert core.call_count == 1, "the mixer did not take the op"
    with mock.patch.object(mamba_core, "runs_here", return_value=False):
        composed = run()
    for i, (f, c) in enumerate(zip(fused, composed)):
        torch.testing.assert_close(f, c, rtol=1e-5, atol=1e-5, msg=lambda m: f"mixer result {i}: {m}")
    return 1


def check_dt_and_A() -> int:
    """The op's dt = softplus(dt_raw + dt_bias) and A = -exp(A_log), and their gradients, against
    the definition in float64, over pre-activations from -40 to 40 (softplus' both tails, torch's
    threshold 20, zero), dt_raw a slice of a wider [s, b] tensor as in the projection."""
    from teratron.ssm import mamba_dt_triton

    b, s, heads = 2, 70, 5
    gen = torch.Generator().manual_seed(3)
    dt_bias, A_log = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    wide = torch.randn(s, b, heads + 3, generator=gen).transpose(0, 1)
    wide[..., 1:heads + 1] = torch.linspace(-40, 40, b * s * heads).reshape(b, s, heads) - dt_bias
    dt_raw = wide[..., 1:heads + 1]
    dt, A = mamba_dt_triton.dt_and_A(dt_raw, dt_bias, A_log)
    leaves = [t.double().requires_grad_() for t in (dt_raw, dt_bias, A_log)]
    want_dt, want_A = F.softplus(leaves[0] + leaves[1]), -torch.exp(leaves[2])
    preactivation = (dt_raw + dt_bias).double()  # rounded to fp32 as the kernel adds them: softplus' own error
    # within 4 fp32 roundings (exp, log, a division and a product; torch's own fp32 softplus is within one)
    ulps = 4 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(dt.double(), F.softplus(preactivation), rtol=ulps, atol=0, msg=lambda m: f"dt: {m}")
    torch.testing.assert_close(A.double(), want_A.detach(), rtol=ulps, atol=0, msg=lambda m: f"A: {m}")

    ddt, dA = torch.randn(b, s, heads, generator=gen), torch.randn(heads, generator=gen)
    want = torch.autograd.grad((want_dt * ddt.double()).sum() + (want_A * dA.double()).sum(), leaves)
    ddt_raw = torch.zeros(s, b, heads + 3).transpose(0, 1)
    ddt_bias, dA_log = mamba_dt_triton.dt_backward_into(ddt_raw[..., 1:heads + 1], ddt, dA, dt_raw, dt_bias, A_log)
    assert ddt_raw[..., 0].eq(0).all() and ddt_raw[..., heads + 1:].eq(0).all(), "wrote outside dt_raw's slice"
    for name, g, w in zip(("dt_raw", "dt_bias", "A_log"), (ddt_raw[..., 1:heads + 1], ddt_bias, dA_log), want):
        torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=1e-6, msg=lambda m: f"d{name}: {m}")
    return 1


if __name__ == "__main__":
    main()
