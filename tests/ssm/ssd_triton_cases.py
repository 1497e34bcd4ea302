"""Inputs for test_ssd_triton.py, and the check of the Triton kernels' code on CPU tensors that it
runs in a subprocess (Triton reads TRITON_INTERPRET when kernels are defined):

    PYTHONPATH=tests TRITON_INTERPRET=1 python tests/ssm/ssd_triton_cases.py

compares `ssd_triton`, run by Triton's interpreter, with `ssd_chunked` in float64 on the same
values: outputs, final states and the gradients of every input, for each of CASES, for 16-bit
inputs, for packed documents (seq_idx), and through `ssd` on strided views (as MambaMixer passes
them); prints how many it checked.
"""

import functools
import os

import torch

from ssm.packed_documents import seq_idx_of

# (b, s, h, g, p, n, chunk_size, with D, with an initial state): ragged last chunks, one short
# chunk, groups of 1 and 2 heads, sides that are not powers of 2 (padded tiles), chunks of 16 and 32.
CASES = [
    (2, 37, 4, 2, 8, 16, 16, True, False),
    (1, 40, 2, 1, 16, 8, 16, True, True),
    (1, 5, 2, 2, 12, 10, 16, False, False),
    (2, 70, 2, 1, 8, 8, 32, True, True),
]


def make_inputs(b, s, h, g, p, n, with_D=True, with_state=False, seed=0, device="cpu"):
    """x, dt, A, B, C, D, initial_state in float32 (D and the state None unless asked for); dt
    after softplus and A = -exp(.) as the mixer passes them."""
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    x, B, C = randn(b, s, h, p), randn(b, s, g, n), randn(b, s, g, n)
    dt = torch.nn.functional.softplus(randn(b, s, h) - 1)
    A = -torch.exp(randn(h))
    return x, dt, A, B, C, randn(h) if with_D else None, randn(b, h, p, n) if with_state else None


def outputs_and_grads(scan, inputs, chunk_size, seed=1):
    """(y, final state, then the gradient of each input that is not None) of a random weighted
    sum of y and the final state, in float64 for comparing."""
    inputs = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    y, final = scan(*inputs, chunk_size=chunk_size)
    gen = torch.Generator(y.device).manual_seed(seed)
    y_weight = torch.randn(y.shape, generator=gen, device=y.device, dtype=torch.float64)
    final_weight = torch.randn(final.shape, generator=gen, device=y.device, dtype=torch.float64)
    loss = (y.double() * y_weight).sum() + (final.double() * final_weight).sum()
    used = [t for t in inputs if t is not None]
    return [y.detach(), final.detach(), *torch.autograd.grad(loss, used)]


def result_names(with_D=True, with_state=True):
    return ["y", "final state", "dx", "ddt", "dA", "dB", "dC"] + ["dD"] * with_D + ["d initial state"] * with_state


def assert_close_to(got, want, names, rtol, what):
    """Each tensor within rtol of the float64 reference, elementwise and relative to its largest entry."""
    assert len(got) == len(want) == len(names)
    for name, a, w in zip(names, got, want):
        torch.testing.assert_close(a.double(), w.double(), rtol=rtol, atol=rtol * w.abs().max().item(),
                                   msg=lambda m: f"{what}, {name}: {m}")


def main() -> None:
    import teratron.ssm.ssd as ssd_module
    import teratron.ssm.ssd_triton as kernels
    from teratron.ssm.ssd_triton import ssd_triton

    assert os.environ.get("TRITON_INTERPRET") == "1" and kernels.INTERPRETED and kernels.triton, "needs the interpreter"
    ssd_chunked = ssd_module.ssd_chunked
    checked = 0
    for seed, (b, s, h, g, p, n, chunk, with_D, with_state) in enumerate(CASES):
        inputs = make_inputs(b, s, h, g, p, n, with_D, with_state, seed=seed)
        want = outputs_and_grads(ssd_chunked, [t.double() if t is not None else None for t in inputs], chunk)
        got = outputs_and_grads(ssd_triton, inputs, chunk)
        assert [t.dtype for t in got] == [torch.float32] * len(got)
        assert_close_to(got, want, result_names(with_D, with_state), 1e-5, f"case {seed}")
        checked += 1

    # Tiles of 16 over p = 40 and n = 24 (3 and 2 blocks, the last ones partial), 2 heads a group:
    # every loop over blocks, and the sums of the p blocks' shares of ddt, dA and dD.
    default_blocks = kernels.MAX_BLOCK
    kernels.MAX_BLOCK = 16
    inputs = make_inputs(1, 20, 4, 2, 40, 24, True, True, seed=5)
    want = outputs_and_grads(ssd_chunked, [t.double() for t in inputs], 16)
    got = outputs_and_grads(ssd_triton, inputs, 16)
    assert_close_to(got, want, result_names(), 1e-5, "blocks of 16")
    kernels.MAX_BLOCK = default_blocks
    checked += 1

    # 5 heads a group, the backward's dCB sum split over programs of 2, 2 and 1 heads (few
    # (batch, chunk, group) programs split it), and over programs of 1 head each.
    default_programs = kernels.DCB_PROGRAMS
    inputs = make_inputs(1, 40, 10, 2, 8, 16, True, True, seed=6)
    want = outputs_and_grads(ssd_chunked, [t.double() for t in inputs], 16)
    for programs, heads_per_split in ((18, 2), (10 ** 6, 1)):
        kernels.DCB_PROGRAMS = programs
        shape = kernels._Shape.of(inputs[0], inputs[3], 16)
        assert (shape.heads_per_split, shape.splits) == (heads_per_split, -(-5 // heads_per_split))
        got = outputs_and_grads(ssd_triton, inputs, 16)
        assert_close_to(got, want, result_names(), 1e-5, f"dCB over programs of {heads_per_split} heads")
        checked += 1
    kernels.DCB_PROGRAMS = default_programs

    # 16-bit x, B, C and state (dt, A, D in fp32, as the mixer passes them): results in the inputs'
    # dtypes, within one rounding of ssd_chunked's on the same inputs (both compute in fp32; the
    # upstream gradients of 16-bit outputs are 16-bit for both).
    for dtype, rtol in ((torch.bfloat16, 2 ** -7), (torch.float16, 2 ** -10)):
        x, dt, A, B, C, D, state = make_inputs(1, 37, 2, 2, 8, 16, True, True, seed=7)
        inputs = [x.to(dtype), dt, A, B.to(dtype), C.to(dtype), D, state.to(dtype)]
        want = outputs_and_grads(ssd_chunked, inputs, 16)
        got = outputs_and_grads(ssd_triton, inputs, 16)
        assert [t.dtype for t in got] == [dtype, dtype, dtype, torch.float32, torch.float32, dtype, dtype,
                                          torch.float32, dtype]
        assert_close_to(got, want, result_names(), rtol, str(dtype))
        checked += 1

    # Packed documents (seq_idx): a document of 1 token, ones starting on and off chunk boundaries (16, 32),
    # one crossing chunks; chunks of 16 and 32, with an initial state (the rows' first documents take it).
    seq_idx = seq_idx_of([5, 1, 10, 27, 27], [32, 38])
    inputs = make_inputs(2, 70, 4, 2, 8, 16, True, True, seed=8)
    for chunk in (16, 32):
        want = outputs_and_grads(functools.partial(ssd_chunked, seq_idx=seq_idx), [t.double() for t in inputs], chunk)
        got = outputs_and_grads(functools.partial(ssd_triton, seq_idx=seq_idx), inputs, chunk)
        assert_close_to(got, want, result_names(), 1e-5, f"packed documents, chunks of {chunk}")
        checked += 1

    # `ssd` takes the kernels here, also for strided views of one [b, s, h * p + 2 * g * n] tensor laid
    # out [s, b] in memory (the kernels read x, B and C by their strides, as MambaMixer passes them),
    # with the output's gradient laid out [s, b] too.
    def chunked_must_not_run(*args, **kwargs):
        raise AssertionError("ssd took ssd_chunked, not the Triton kernels")

    class GradientLaidOutSB(torch.autograd.Function):
        """The identity, whose backward hands on the gradient laid out [s, b] in memory."""
        @staticmethod
        def forward(ctx, y):
            return y.clone()

        @staticmethod
        def backward(ctx, dy):
            return dy.transpose(0, 1).contiguous().transpose(0, 1)

    b, s, h, g, p, n = 2, 37, 4, 2, 8, 16
    x, dt, A, B, C, D, _ = make_inputs(b, s, h, g, p, n, seed=9)
    fused = torch.cat([x.flatten(2), B.flatten(2), C.flatten(2)], dim=-1).transpose(0, 1).contiguous().transpose(0, 1)

    def on_views(fused, dt, A, D, chunk_size):
        x, B, C = fused.split([h * p, g * n, g * n], dim=-1)
        y, final = ssd_module.ssd(x.reshape(b, s, h, p), dt, A, B.reshape(b, s, g, n), C.reshape(b, s, g, n), D,
                                  chunk_size=chunk_size)
        return GradientLaidOutSB.apply(y), final

    want = outputs_and_grads(on_views, [fused.double(), dt.double(), A.double(), D.double()], 16)
    ssd_module.ssd_chunked = chunked_must_not_run
    got = outputs_and_grads(on_views, [fused, dt, A, D], 16)
    ssd_module.ssd_chunked = ssd_chunked
    assert_close_to(got, want, ["y", "final state", "d fused xBC", "ddt", "dA", "dD"], 1e-5, "strided views")
    checked += 1
    print(f"checked {checked} cases on the Triton path")


if __name__ == "__main__":
    main()
