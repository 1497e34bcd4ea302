"""Mamba-2's chunked scan and Gated DeltaNet's chunked gated delta rule against causal attention:
forward + backward time of the sequence mixing alone (issue 24's targets: each Triton path faster
than causal attention with as many heads of the same size, and at least 5x faster than its
plain-PyTorch path).

    python bench/ssm_bench.py [--seq-length 8192] [--heads 32] [--head-dim 64] [--d-state 128]
                              [--rule-heads 32] [--rule-head-dim 128]

One GPU, bf16 activations. Cases: `ssd_triton` (teratron.ssm.ssd_triton, what MambaMixer runs on
GPUs), `ssd_chunked` (the plain-PyTorch path), and causal SDPA over q, k, v of --heads x
--head-dim pinned to cuDNN's fused kernel and to flash attention; then `gated_delta_rule_triton`
(teratron.ssm.gated_delta_rule_triton, what GatedDeltaNet runs on GPUs), `gated_delta_rule_chunked`
and the same two SDPA kernels, over --rule-heads heads of dk = dv = --rule-head-dim (chunks of 64,
GatedDeltaNet's). The scans take x [b, s, h, p] and B, C [b, s, g, n] in bf16 and dt, A, D in fp32,
as MambaMixer passes them; the delta rules L2-normalised q, k and g in fp32 and v, beta in bf16,
as GatedDeltaNet passes them. Each case runs --warmup steps first (Triton's compilation included),
then --iters timed steps between CUDA events. Prints one RESULT line per case (ms per forward +
backward, peak memory), the largest difference between each Triton path's outputs and its
PyTorch path's, and the ratios against the targets.

Where installed, the reference Triton implementations run beside them on the same inputs, for scale:
Mamba's own SSD (`mamba_chunk_scan_combined` from `mamba_ssm`, dt already through softplus) and
flash-linear-attention's chunked gated delta rule (`chunk_gated_delta_rule` from `fla`, scale 1: teratron's
rule takes q as given). teratron depends on neither; a case prints "not run" without its package.
"""

import argparse
import importlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from teratron.ssm.gated_delta_rule import gated_delta_rule_chunked
from teratron.ssm.gated_delta_rule_triton import gated_delta_rule_triton
from teratron.ssm.ssd import ssd_chunked
from teratron.ssm.ssd_triton import ssd_triton

RULE_CHUNK = 64  # GatedDeltaNet's chunk size (and flash-linear-attention's)
REFERENCE = "(reference)"  # the reference implementations' cases end with it


def reference(module: str, name: str):
    """`name` from `module` of a reference implementation, or the reason it cannot run here."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as error:  # not installed, or an install that fails to import
        return f"{module} not importable: {error}"


def mamba_ssm_scan(x, dt, A, B, C, D, chunk_size):
    """Mamba's Triton SSD on ssd_triton's arguments -> (out, None)."""
    scan = reference("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    return scan(x, dt, A, B, C, chunk_size, D=D), None


def fla_rule(q, k, v, g, beta, chunk_size):
    """flash-linear-attention's chunked gated delta rule (chunks of 64) on gated_delta_rule_triton's
    arguments -> (out, final state)."""
    rule = reference("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    assert chunk_size == RULE_CHUNK
    return rule(q, k, v, g, beta, scale=1.0, output_final_state=True)


def scan_inputs(args):
    """x, dt, A, B, C, D as MambaMixer passes them (dt after softplus, A = -exp(A_log))."""
    b, s, h, g = args.batch, args.seq_length, args.heads, args.groups
    bf16 = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fp32 = dict(device="cuda", dtype=torch.float32)
    x = torch.randn(b, s, h, args.head_dim, **bf16)
    B, C = (torch.randn(b, s, g, args.d_state, **bf16) for _ in range(2))
    dt = F.softplus(torch.randn(b, s, h, **fp32) - 2).requires_grad_()
    A = (-torch.exp(torch.rand(h, **fp32) * 2)).requires_grad_()
    D = torch.ones(h, **fp32, requires_grad=True)
    return x, dt, A, B, C, D


def rule_inputs(args):
    """q, k, v, g, beta as GatedDeltaNet passes them (q, k L2-normalised in fp32 and rounded to bf16,
    g = -exp(A_log) softplus(.) in fp32, v and beta = sigmoid(.) in bf16)."""
    b, s, h, d = args.batch, args.seq_length, args.rule_heads, args.rule_head_dim
    fp32 = dict(device="cuda", dtype=torch.float32)
    q, k = (F.normalize(torch.randn(b, s, h, d, **fp32), dim=-1).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = (-F.softplus(torch.randn(b, s, h, **fp32))).requires_grad_()
    beta = torch.sigmoid(torch.randn(b, s, h, **fp32)).bfloat16().requires_grad_()
    return q, k, v, g, beta


def attention_inputs(args, heads, head_dim):
    shape = (args.batch, heads, args.seq_length, head_dim)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]


def mixing_step(mix, inputs, chunk_size, heads, head_dim, args):
    """One forward + backward of mix(*inputs) -> (out [b, s, heads, head_dim], state)."""
    upstream = torch.randn(args.batch, args.seq_length, heads, head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        out, _ = mix(*inputs, chunk_size=chunk_size)
        out.backward(upstream)
        for t in inputs:
            t.grad = None

    return step


def scan_step(scan, args):
    return mixing_step(scan, scan_inputs(args), args.chunk_size, args.heads, args.head_dim, args)


def rule_step(rule, args):
    return mixing_step(rule, rule_inputs(args), RULE_CHUNK, args.rule_heads, args.rule_head_dim, args)


def attention_step(backend, heads, head_dim, args):
    q, k, v = attention_inputs(args, heads, head_dim)
    upstream = torch.randn_like(q)

    def step():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(upstream)
        for t in (q, k, v):
            t.grad = None

    return step


def time_step(step, args):
    """Milliseconds per call of step, and the peak memory (GiB) of one."""
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / args.iters, torch.cuda.max_memory_allocated() / 2**30


def largest_difference(triton_path, torch_path, inputs, chunk_size) -> float:
    """max |out_triton - out_torch| over max |out_torch|, on one set of inputs."""
    inputs = [t.detach() for t in inputs]
    with torch.no_grad():
        out, _ = triton_path(*inputs, chunk_size=chunk_size)
        out_ref, _ = torch_path(*inputs, chunk_size=chunk_size)
    return ((out.float() - out_ref.float()).abs().max() / out_ref.float().abs().max()).item()


def run_cases(cases, shape, args, missing=None):
    """{name: ms} of the cases that ran, each printed as a RESULT line; `missing`: {name: why not run}."""
    times = {}
    for name, make in cases.items():
        if name in (missing or {}):
            print(f"RESULT {name}: not run ({missing[name]})", flush=True)
            continue
        try:
            ms, peak = time_step(make(), args)
        except (Exception if name.endswith(REFERENCE) else RuntimeError) as error:  # a pinned SDPA kernel that
            # cannot run this shape; a reference implementation failing in any way here
            print(f"RESULT {name}: not run ({str(error).splitlines()[0]})", flush=True)
            continue
        times[name] = ms
        print(f"RESULT {name}: {ms:.3f} ms forward+backward, peak {peak:.2f} GiB ({shape})", flush=True)
    return times


def report_targets(triton_name, torch_name, times):
    """The Triton path against the fastest causal attention (target < 1) and its PyTorch path (>= 5x)."""
    if triton_name not in times:
        return
    attention = {name: ms for name, ms in times.items() if name.startswith("causal attention")}
    if attention:
        fastest = min(attention, key=attention.get)
        print(f"RESULT {triton_name} / causal attention: {times[triton_name] / attention[fastest]:.3f} "
              f"(vs the fastest, {fastest}); target < 1", flush=True)
    if torch_name in times:
        print(f"RESULT {torch_name} / {triton_name}: {times[torch_name] / times[triton_name]:.2f}x; "
              "target >= 5x", flush=True)


def unavailable(references: dict) -> dict:
    """{case: why not run} of the reference cases ({case: (module, name)}) whose package is missing."""
    found = {case: reference(*where) for case, where in references.items()}
    return {case: why for case, why in found.items() if isinstance(why, str)}


def report_reference(triton_name, reference_name, times):
    """teratron's kernels over the reference implementation's, where both ran."""
    if triton_name in times and reference_name in times:
        print(f"RESULT {triton_name} / {reference_name}: {times[triton_name] / times[reference_name]:.3f}",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="Scan heads, and attention heads.")
    parser.add_argument("--head-dim", type=int, default=64, help="The scan's p, and attention's head size.")
    parser.add_argument("--groups", type=int, default=1, help="The scan's B/C groups.")
    parser.add_argument("--d-state", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=128, help="The scan's chunk size.")
    parser.add_argument("--rule-heads", type=int, default=32, help="Delta-rule heads, and attention heads.")
    parser.add_argument("--rule-head-dim", type=int, default=128,
                        help="The delta rule's dk = dv, and attention's head size.")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ssm_bench: needs a CUDA GPU")
    torch.manual_seed(0)
    common = (f"seq {args.seq_length}, batch {args.batch}, bf16, {torch.cuda.get_device_name()}, "
              f"torch {torch.__version__}")

    h, p = args.heads, args.head_dim
    mamba = f"mamba_ssm's mamba_chunk_scan_combined {REFERENCE}"
    missing = unavailable({mamba: ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")})
    times = run_cases({
        "ssd_triton": lambda: scan_step(ssd_triton, args),
        mamba: lambda: scan_step(mamba_ssm_scan, args),
        "ssd_chunked (PyTorch)": lambda: scan_step(ssd_chunked, args),
        "causal attention, SDPA cuDNN": lambda: attention_step(SDPBackend.CUDNN_ATTENTION, h, p, args),
        "causal attention, SDPA flash": lambda: attention_step(SDPBackend.FLASH_ATTENTION, h, p, args),
    }, f"heads {h} x {p}, d_state {args.d_state}, groups {args.groups}, chunk {args.chunk_size}, {common}", args,
        missing)
    scans = {"ssd_triton": ssd_triton, **({mamba: mamba_ssm_scan} if mamba in times else {})}
    for name, scan in scans.items():
        difference = largest_difference(scan, ssd_chunked, scan_inputs(args), args.chunk_size)
        print(f"RESULT {name} vs ssd_chunked: largest output difference {difference:.2e} of the largest output",
              flush=True)
    report_targets("ssd_triton", "ssd_chunked (PyTorch)", times)
    report_reference("ssd_triton", mamba, times)

    h, d = args.rule_heads, args.rule_head_dim
    fla = f"flash-linear-attention's chunk_gated_delta_rule {REFERENCE}"
    missing = unavailable({fla: ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")})
    times = run_cases({
        "gated_delta_rule_triton": lambda: rule_step(gated_delta_rule_triton, args),
        fla: lambda: rule_step(fla_rule, args),
        "gated_delta_rule_chunked (PyTorch)": lambda: rule_step(gated_delta_rule_chunked, args),
        f"causal attention {h} x {d}, SDPA cuDNN": lambda: attention_step(SDPBackend.CUDNN_ATTENTION, h, d, args),
        f"causal attention {h} x {d}, SDPA flash": lambda: attention_step(SDPBackend.FLASH_ATTENTION, h, d, args),
    }, f"heads {h}, dk = dv = {d}, chunk {RULE_CHUNK}, {common}", args, missing)
    rules = {"gated_delta_rule_triton": gated_delta_rule_triton, **({fla: fla_rule} if fla in times else {})}
    for name, rule in rules.items():
        difference = largest_difference(rule, gated_delta_rule_chunked, rule_inputs(args), RULE_CHUNK)
        print(f"RESULT {name} vs gated_delta_rule_chunked: largest output difference {difference:.2e} of the "
              "largest output", flush=True)
    report_targets("gated_delta_rule_triton", "gated_delta_rule_chunked (PyTorch)", times)
    report_reference("gated_delta_rule_triton", fla, times)


if __name__ == "__main__":
    main()
