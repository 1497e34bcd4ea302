"""Inputs for test_gated_delta_rule_triton.py, and the check of the Triton kernels' code on CPU
tensors that it runs in a subprocess (Triton reads TRITON_INTERPRET when kernels are defined):

    PYTHONPATH=tests TRITON_INTERPRET=1 python tests/ssm/gated_delta_rule_triton_cases.py

compares `gated_delta_rule_triton`, run by Triton's interpreter, with `gated_delta_rule_chunked` in
float64 on the same values: outputs, final states and the gradients of every input, for each of
CASES, for 16-bit inputs, for packed documents (seq_idx), through `gated_delta_rule` on strided views (as GatedDeltaNet passes v)
and past the largest key head dim (the PyTorch path), and GatedDeltaNet's layer (forward and
backward, and a state carried across two calls) against the layer on the PyTorch path; prints how
many it checked.
"""

import functools
import os

import torch

from ssm.packed_documents import seq_idx_of

# (b, s, h, dk, dv, chunk_size, with an initial state): ragged last chunks, one short chunk, dk != dv,
# sides that are not powers of 2 (padded tiles), chunks of 16, 32 and 64 (GatedDeltaNet's).
CASES = [
    (2, 37, 2, 16, 8, 16, False),
    (1, 40, 2, 8, 16, 16, True),
    (1, 5, 2, 12, 20, 16, True),
    (1, 70, 1, 16, 16, 32, True),
    (1, 100, 1, 16, 8, 64, True),
]


def make_inputs(b, s, h, dk, dv, with_state=False, seed=0, device="cpu"):
    """q, k, v, g, beta, initial_state in float32 (the state None unless asked for); q and k
    L2-normalised per head, g = -softplus(.) and beta = sigmoid(.), as GatedDeltaNet passes them."""
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q, k = (torch.nn.functional.normalize(randn(b, s, h, dk), dim=-1) for _ in range(2))
    v = randn(b, s, h, dv)
    g = -torch.nn.functional.softplus(randn(b, s, h))
    beta = torch.sigmoid(randn(b, s, h))
    return q, k, v, g, beta, randn(b, h, dv, dk) if with_state else None


def outputs_and_grads(rule, inputs, chunk_size, seed=1):
    """(o, final state, then the gradient of each input that is not None) of a random weighted sum
    of o and the final state, in float64 for comparing."""
    inputs = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    o, final = rule(*inputs, chunk_size=chunk_size)
    gen = torch.Generator(o.device).manual_seed(seed)
    o_weight = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float64)
    final_weight = torch.randn(final.shape, generator=gen, device=o.device, dtype=torch.float64)
    loss = (o.double() * o_weight).sum() + (final.double() * final_weight).sum()
    used = [t for t in inputs if t is not None]
    return [o.detach(), final.detach(), *torch.autograd.grad(loss, used)]


def result_names(with_state=True):
    return ["o", "final state", "dq", "dk", "dv", "dg", "dbeta"] + ["d initial state"] * with_state


def assert_close_to(got, want, names, rtol, what):
    """Each tensor within rtol of the float64 reference, elementwise and relative to its largest entry."""
    assert len(got) == len(want) == len(names)
    for name, a, w in zip(names, got, want):
        torch.testing.assert_close(a.double(), w.double(), rtol=rtol, atol=rtol * w.abs().max().item(),
                                   msg=lambda m: f"{what}, {name}: {m}")


def main() -> None:
    import teratron.ssm.gated_delta_rule as rule_module
    import teratron.ssm.gated_delta_rule_triton as kernels
    from teratron.ssm.gated_delta_rule_triton import gated_delta_rule_triton

    assert os.environ.get("TRITON_INTERPRET") == "1" and kernels.INTERPRETED and kernels.triton, "needs the interpreter"
    chunked = rule_module.gated_delta_rule_chunked
    checked = 0
    for seed, (b, s, h, dk, dv, chunk, with_state) in enumerate(CASES):
        inputs = make_inputs(b, s, h, dk, dv, with_state, seed=seed)
        want = outputs_and_grads(chunked, [t.double() if t is not None else None for t in inputs], chunk)
        got = outputs_and_grads(gated_delta_rule_triton, inputs, chunk)
        assert [t.dtype for t in got] == [torch.float32] * len(got)
        assert_close_to(got, want, result_names(with_state), 1e-5, f"case {seed}")
        checked += 1

    # Tiles of 16 over dk = 40 and dv = 24 (3 and 2 blocks, the last ones partial): every loop over
    # blocks, the state passings' several blocks of dv, and their [block of dv, 64] state tiles.
    default_blocks = kernels.MAX_BLOCK
    kernels.MAX_BLOCK = 16
    inputs = make_inputs(1, 20, 2, 40, 24, True, seed=5)
    want = outputs_and_grads(chunked, [t.double() for t in inputs], 16)
    got = outputs_and_grads(gated_delta_rule_triton, inputs, 16)
    assert_close_to(got, want, result_names(), 1e-5, "blocks of 16")
    kernels.MAX_BLOCK = default_blocks
    checked += 1

    # 16-bit v, beta and state: with fp32 q and k (bf16), and all but g 16-bit, as GatedDeltaNet passes
    # them (bf16, fp16). Results in the inputs' dtypes, within one rounding of gated_delta_rule_chunked's
    # on the same inputs (both compute in fp32; the upstream gradients of 16-bit outputs are 16-bit).
    for dtype, rtol, sixteen_bit_qk in ((torch.bfloat16, 2 ** -7, False), (torch.bfloat16, 2 ** -7, True),
                                        (torch.float16, 2 ** -10, True)):
        q, k, v, g, beta, state = make_inputs(1, 37, 2, 16, 8, True, seed=7)
        qk_dtype = dtype if sixteen_bit_qk else torch.float32
        inputs = [q.to(qk_dtype), k.to(qk_dtype), v.to(dtype), g, beta.to(dtype), state.to(dtype)]
        want = outputs_and_grads(chunked, inputs, 16)
        got = outputs_and_grads(gated_delta_rule_triton, inputs, 16)
        assert [t.dtype for t in got] == [dtype, dtype, qk_dtype, qk_dtype, dtype, torch.float32, dtype, dtype]
        assert_close_to(got, want, result_names(), rtol, str(dtype))
        checked += 1

    # float64 q and k with fp32 v: the kernels take q and k in fp32 (their dot tiles have one 16/32-bit dtype).
    q, k, v, g, beta, state = make_inputs(1, 37, 2, 16, 8, True, seed=8)
    inputs = [q.double(), k.double(), v, g, beta, state]
    want = outputs_and_grads(chunked, [t.double() for t in inputs], 16)
    got = outputs_and_grads(gated_delta_rule_triton, inputs, 16)
    assert (got[2].dtype, got[3].dtype, got[0].dtype) == (torch.float64, torch.float64, torch.float32)
    assert_close_to(got, want, result_names(), 1e-5, "float64 q, k")
    checked += 1

    # Packed documents (seq_idx): a document of 1 token, ones starting on and off chunk boundaries (16),
    # one crossing chunks, with an initial state (the rows' first documents take it).
    seq_idx = seq_idx_of([5, 1, 10, 34], [16, 34])
    inputs = make_inputs(2, 50, 2, 16, 8, True, seed=10)
    want = outputs_and_grads(functools.partial(chunked, seq_idx=seq_idx), [t.double() for t in inputs], 16)
    got = outputs_and_grads(functools.partial(gated_delta_rule_triton, seq_idx=seq_idx), inputs, 16)
    assert_close_to(got, want, result_names(), 1e-5, "packed documents")
    checked += 1

    # `gated_delta_rule` takes the kernels here, also for q, k, v strided views of one [b, s, ...] tensor.
    def chunked_must_not_run(*args, **kwargs):
        raise AssertionError("gated_delta_rule took gated_delta_rule_chunked, not the Triton kernels")

    b, s, h, dk, dv = 1, 37, 2, 16, 8
    q, k, v, g, beta, state = make_inputs(b, s, h, dk, dv, True, seed=9)
    fused = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)

    def on_views(fused, g, beta, state, chunk_size):
        q, k, v = fused.split([h * dk, h * dk, h * dv], dim=-1)
        return rule_module.gated_delta_rule(q.reshape(b, s, h, dk), k.reshape(b, s, h, dk), v.reshape(b, s, h, dv),
                                            g, beta, state, chunk_size=chunk_size)

    want = outputs_and_grads(on_views, [fused.double(), g.double(), beta.double(), state.double()], 16)
    rule_module.gated_delta_rule_chunked = chunked_must_not_run
    got = outputs_and_grads(on_views, [fused, g, beta, state], 16)
    rule_module.gated_delta_rule_chunked = chunked
    assert_close_to(got, want, ["o", "final state", "d fused qkv", "dg", "dbeta", "d initial state"], 1e-5,
                    "strided views")
    checked += 1

    # Key heads over MAX_KEY_DIM take gated_delta_rule_chunked (the kernels' state tile holds dk whole).
    def triton_must_not_run(*args, **kwargs):
        raise AssertionError("gated_delta_rule took the Triton kernels for dk over MAX_KEY_DIM")

    inputs = make_inputs(1, 20, 1, kernels.MAX_KEY_DIM + 8, 8, True, seed=11)
    rule_module.gated_delta_rule_triton = triton_must_not_run
    o, final = rule_module.gated_delta_rule(*inputs, chunk_size=16)
    rule_module.gated_delta_rule_triton = gated_delta_rule_triton
    o_ref, final_ref = chunked(*inputs, chunk_size=16)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
    checked += 1
    check_the_layer(rule_module, chunked_must_not_run)
    checked += 1
    print(f"checked {checked} cases on the Triton path")


def check_the_layer(rule_module, chunked_must_not_run):
    """GatedDeltaNet (2 key heads of 16, 4 value heads of 8, chunks of 16) on the kernels equals a
    float64 copy of it on gated_delta_rule_chunked: output and every gradient over 40 tokens, the
    output and x's gradient on rows of packed documents, and the output and states of 15 more tokens
    that continue from the first 25's state (the inference path)."""
    import copy

    from teratron.packed_seq_params import PackedSeqParams, cu_seqlens_from_documents

    from teratron.ssm import GatedDeltaNet
    from teratron.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                               linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
                               linear_num_key_heads=2, linear_num_value_heads=4)
    torch.manual_seed(0)
    layer = GatedDeltaNet(config)
    layer.chunk_size = 16
    x = torch.randn(40, 2, 32)  # [s, b, h]
    out_weight = torch.randn(40, 2, 32, dtype=torch.float64)

    cu = cu_seqlens_from_documents(seq_idx_of([7, 1, 8, 24], [40]))
    packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu)

    def run(layer, x):
        x = x.clone().requires_grad_()
        out = layer(x)[0]
        grads = torch.autograd.grad((out.double() * out_weight).sum(), [x, *layer.parameters()])
        out_packed = layer(x, attention_mask=packed)[0]
        dx_packed = torch.autograd.grad((out_packed.double() * out_weight).sum(), x)[0]
        with torch.no_grad():
            projected = layer.in_proj(x)[0].transpose(0, 1)  # [b, s, parts]
            _, state = layer._mix(projected[:, :25], None)
            y, (conv_state, rule_state) = layer._mix(projected[:, 25:], state)
        return [out.detach(), *grads, out_packed.detach(), dx_packed, y, conv_state, rule_state]

    want = run(copy.deepcopy(layer).double(), x.double())  # float64: gated_delta_rule_chunked
    rule_module.gated_delta_rule_chunked, chunked = chunked_must_not_run, rule_module.gated_delta_rule_chunked
    got = run(layer, x)
    rule_module.gated_delta_rule_chunked = chunked
    names = ["out", "dx", *(f"d {name}" for name, _ in layer.named_parameters()), "packed out", "packed dx",
             "continued out", "conv state", "rule state"]
    assert_close_to(got, want, names, 1e-5, "GatedDeltaNet")


if __name__ == "__main__":
    main()
