"""The launch configuration of each kernel of a Triton scan, each timed alone: Mamba-2's
(`--scan ssd`, teratron.ssm.ssd_triton: how its LAUNCH table was chosen, docs/hybrid.md) or Gated
DeltaNet's gated delta rule (`--scan rule`, teratron.ssm.gated_delta_rule_triton).

    python bench/scan_launch_sweep.py --scan ssd   [--batch 4] [--seq-length 2048] [--heads 64]
                                                   [--groups 8] [--chunk-size 128]
    python bench/scan_launch_sweep.py --scan rule  [--batch 1] [--seq-length 8192] [--rule-heads 32]
    ... [--module FILE]   (another version of the scan's kernel module, e.g. from `git show`)

One GPU, the inputs bench/ssm_bench.py builds (as the mixers pass them); defaults: the hybrid
benchmark model's Mamba layer (4 x 2,048 tokens, 64 heads x 64, 8 groups, state 128, chunk 128) and
ssm_bench's gated delta rule (1 x 8,192 tokens, 32 heads x 128, chunk 64). Runs one forward +
backward with every kernel launch captured (grid and arguments), then replays each launch alone with
its current configuration and with 2-16 warps x 1-4 software-pipelining stages, --iters launches
between CUDA events (the current configuration timed again after the others, the faster of its two
timings kept: a kernel's first timing can run slow). Prints one line per launch (its time now and its
fastest configuration) and the sums.
"""

import argparse
import itertools

import torch

from ssm_bench import RULE_CHUNK, rule_inputs, scan_inputs
from ssm_profile import load_module
from teratron.ssm import gated_delta_rule_triton, ssd_triton

SCANS = {  # --scan: (kernel module, entry point, inputs, its default shape)
    "ssd": (ssd_triton, ssd_triton.ssd_triton, scan_inputs,
            dict(batch=4, seq_length=2048, heads=64, head_dim=64, groups=8, d_state=128, chunk_size=128)),
    "rule": (gated_delta_rule_triton, gated_delta_rule_triton.gated_delta_rule_triton, rule_inputs,
             dict(batch=1, seq_length=8192, rule_heads=32, rule_head_dim=128, chunk_size=RULE_CHUNK)),
}

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
    module, scan, make_inputs, _ = SCANS[args.scan]
    if args.module:
        module = load_module(args.module, f"{args.scan}_sweep_module")
        scan = getattr(module, scan.__name__)
    launches = []
    names = [name for name in dir(module) if name.startswith("_") and name.endswith("_kernel")]
    kernels = {name: getattr(module, name) for name in names}
    for name, kernel in kernels.items():
        setattr(module, name, Recorder(name, kernel, launches))
    try:
        out, final = scan(*make_inputs(args), chunk_size=args.chunk_size)
        (out.float().square().mean() + final.float().square().mean()).backward()
        torch.cuda.synchronize()
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
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
    parser.add_argument("--scan", choices=sorted(SCANS), default="ssd")
    for flag in ("batch", "seq-length", "heads", "head-dim", "groups", "d-state", "rule-heads", "rule-head-dim",
                 "chunk-size"):
        parser.add_argument(f"--{flag}", type=int, help="default: the scan's shape (the module docstring)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--module", metavar="FILE", help="Another version of the scan's kernel module to sweep.")
    args = parser.parse_args()
    for name, value in SCANS[args.scan][3].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not torch.cuda.is_available():
        raise SystemExit("scan_launch_sweep: needs a CUDA GPU")
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
        now = min(now, time_launch(lambda: kernel[grid](*kernel_args, **kwargs), args.iters))
        best = min(best, now)
        best_config = "as now" if best == now else best_config
        total_now, total_best = total_now + now, total_best + best
        print(f"RESULT {name} grid {grid}: {now:.1f} µs now, fastest {best:.1f} µs ({best_config})", flush=True)
    print(f"RESULT all kernels: {total_now / 1000:.3f} ms now, {total_best / 1000:.3f} ms at each one's fastest",
          flush=True)


if __name__ == "__main__":
    main()
