"""The launch configuration of each of Mamba-2's scan kernels (`teratron.ssm.ssd_triton`), each timed
alone: how `ssd_triton.LAUNCH` was chosen (docs/hybrid.md).

    python bench/ssd_launch_sweep.py [--batch 4] [--seq-length 2048] [--heads 64] [--groups 8]
                                     [--chunk-size 128]

One GPU, bf16 x, B, C (dt, A, D fp32, as MambaMixer passes them). Runs one forward + backward with
every kernel launch captured (grid and arguments), then replays each launch alone with its current
configuration and with 2-16 warps x 1-4 software-pipelining stages, --iters launches between CUDA
events. Prints one line per launch (its time now and its fastest configuration) and the sums.
"""

import argparse
import itertools

import torch
import torch.nn.functional as F

from teratron.ssm import ssd_triton

WARPS, STAGES = (2, 4, 8, 16), (1, 2, 3, 4)


class Recorder:
    """Stands in for a kernel (`kernel[grid](*args, **kwargs)`): records the launch, then runs it."""

    def __init__(self, name, kernel, launches):
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, self.kernel, grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def record_launches(args):
    """[(kernel name, kernel, grid, args, kwargs)] of one forward + backward at the arguments' shape."""
    launches = []
    names = [name for name in dir(ssd_triton) if name.startswith("_") and name.endswith("_kernel")]
    kernels = {name: getattr(ssd_triton, name) for name in names}
    for name, kernel in kernels.items():
        setattr(ssd_triton, name, Recorder(name, kernel, launches))
    try:
        bf16 = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b, s, h, g = args.batch, args.seq_length, args.heads, args.groups
        x = torch.randn(b, s, h, args.head_dim, **bf16)
        B, C = (torch.randn(b, s, g, args.d_state, **bf16) for _ in range(2))
        dt = F.softplus(torch.randn(b, s, h, device="cuda") - 2).requires_grad_()
        A = (-torch.exp(torch.rand(h, device="cuda") * 2)).requires_grad_()
        D = torch.ones(h, device="cuda", requires_grad=True)
        y, final = ssd_triton.ssd_triton(x, dt, A, B, C, D, chunk_size=args.chunk_size)
        (y.float().square().mean() + final.float().square().mean()).backward()
        torch.cuda.synchronize()
    finally:
        for name, kernel in kernels.items():
            setattr(ssd_triton, name, kernel)
    return launches


def time_launch(launch, iters: int) -> float:
    """µs per call of `launch()` (after one untimed call: compilation)."""
    launch()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        launch()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--d-state", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ssd_launch_sweep: needs a CUDA GPU")
    torch.manual_seed(0)
    total_now = total_best = 0.0
    for name, kernel, grid, kernel_args, kwargs in record_launches(args):
        now = time_launch(lambda: kernel[grid](*kernel_args, **kwargs), args.iters)
        best, best_config = now, "as now"
        for warps, stages in itertools.product(WARPS, STAGES):
            config = dict(kwargs, num_warps=warps, num_stages=stages)
            try:
                us = time_launch(lambda: kernel[grid](*kernel_args, **config), args.iters)
            except Exception:  # noqa: BLE001 - a configuration that does not fit (shared memory, registers)
                continue
            if us < best:
                best, best_config = us, f"{warps} warps, {stages} stages"
        total_now, total_best = total_now + now, total_best + best
        print(f"RESULT {name} grid {grid}: {now:.1f} µs now, fastest {best:.1f} µs ({best_config})", flush=True)
    print(f"RESULT all kernels: {total_now / 1000:.3f} ms now, {total_best / 1000:.3f} ms at each one's fastest",
          flush=True)


if __name__ == "__main__":
    main()
