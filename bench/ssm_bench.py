"""Mamba-2's chunked scan against causal attention: forward + backward time of the sequence mixing
alone (issue 24's targets: the Triton scan faster than causal attention with as many heads of the
same size, and at least 5x faster than the plain-PyTorch scan).

    python bench/ssm_bench.py [--seq-length 8192] [--heads 32] [--head-dim 64] [--d-state 128]

One GPU, bf16 activations. Cases: `ssd_triton` (teratron.ssm.ssd_triton, what MambaMixer runs on
GPUs), `ssd_chunked` (the plain-PyTorch path), and causal SDPA over q, k, v of --heads x
--head-dim pinned to cuDNN's fused kernel and to flash attention. The scans take x [b, s, h, p]
and B, C [b, s, g, n] in bf16 and dt, A, D in fp32, as MambaMixer passes them. Each case runs
--warmup steps first (Triton's compilation included), then --iters timed steps between CUDA
events. Prints one RESULT line per case (ms per forward + backward, peak memory), the largest
difference between the two scans' outputs, and the ratios against the targets.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from teratron.ssm.ssd import ssd_chunked
from teratron.ssm.ssd_triton import ssd_triton


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


def attention_inputs(args):
    shape = (args.batch, args.heads, args.seq_length, args.head_dim)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]


def scan_step(scan, args):
    inputs = scan_inputs(args)
    upstream = torch.randn(args.batch, args.seq_length, args.heads, args.head_dim, device="cuda",
                           dtype=torch.bfloat16)

    def step():
        y, _ = scan(*inputs, chunk_size=args.chunk_size)
        y.backward(upstream)
        for t in inputs:
            t.grad = None

    return step


def attention_step(backend, args):
    q, k, v = attention_inputs(args)
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


def largest_difference(args) -> float:
    """max |y_triton - y_chunked| over max |y_chunked|, on one set of inputs."""
    inputs = [t.detach() for t in scan_inputs(args)]
    with torch.no_grad():
        y, _ = ssd_triton(*inputs, chunk_size=args.chunk_size)
        y_ref, _ = ssd_chunked(*inputs, chunk_size=args.chunk_size)
    return ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="Scan heads, and attention heads.")
    parser.add_argument("--head-dim", type=int, default=64, help="The scan's p, and attention's head size.")
    parser.add_argument("--groups", type=int, default=1, help="The scan's B/C groups.")
    parser.add_argument("--d-state", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ssm_bench: needs a CUDA GPU")
    torch.manual_seed(0)
    cases = {
        "ssd_triton": lambda: scan_step(ssd_triton, args),
        "ssd_chunked (PyTorch)": lambda: scan_step(ssd_chunked, args),
        "causal attention, SDPA cuDNN": lambda: attention_step(SDPBackend.CUDNN_ATTENTION, args),
        "causal attention, SDPA flash": lambda: attention_step(SDPBackend.FLASH_ATTENTION, args),
    }
    shape = (f"seq {args.seq_length}, batch {args.batch}, heads {args.heads} x {args.head_dim}, d_state "
             f"{args.d_state}, groups {args.groups}, chunk {args.chunk_size}, bf16, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}")
    times = {}
    for name, make in cases.items():
        try:
            ms, peak = time_step(make(), args)
        except RuntimeError as error:  # a pinned SDPA kernel that cannot run this shape
            print(f"RESULT {name}: not run ({str(error).splitlines()[0]})", flush=True)
            continue
        times[name] = ms
        print(f"RESULT {name}: {ms:.3f} ms forward+backward, peak {peak:.2f} GiB ({shape})", flush=True)
    print(f"RESULT ssd_triton vs ssd_chunked: largest output difference {largest_difference(args):.2e} "
          "of the largest output", flush=True)
    if "ssd_triton" not in times:
        return
    attention = {name: ms for name, ms in times.items() if name.startswith("causal attention")}
    if attention:
        fastest = min(attention, key=attention.get)
        print(f"RESULT ssd_triton / causal attention: {times['ssd_triton'] / attention[fastest]:.3f} "
              f"(vs the fastest, {fastest}); target < 1", flush=True)
    if "ssd_chunked (PyTorch)" in times:
        print(f"RESULT ssd_chunked / ssd_triton: {times['ssd_chunked (PyTorch)'] / times['ssd_triton']:.2f}x; "
              "target >= 5x", flush=True)


if __name__ == "__main__":
    main()
