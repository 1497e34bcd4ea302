"""Sliding-window attention against full causal attention: forward + backward time of the core
attention alone (issue 20's target: a window of 1,024 at sequence 16,384 takes at most 1/6 of
full causal attention's time; docs/performance.md).

    python bench/sliding_window_bench.py [--seq-length 16384] [--window 1024] [--iters 20] [--skip-flex]

One GPU, bf16, the benchmark model's heads (16 x 128; --groups for GQA). Every case is teratron's
`DotProductAttention` as a training layer builds it: full causal attention runs SDPA (`auto`:
SDPA's own choice, and pinned to `flash` and to cuDNN's `fused` kernel, so the window is compared
with the fastest); the windowed layer runs cuDNN's native band (`cudnn_window_attention`, what a
causal window without sink runs when the cuDNN frontend is installed; "not run (...)" with the
reason otherwise); for comparison the windowed layer on FlexAttention (compiled, a cached block
mask: what windows with sinks, and every window without the frontend, run), with and without
learned sinks, and FlexAttention over the full causal mask (the kernel's own cost, no window).
Each case runs --warmup steps first (compilation included); then --repeats rounds each time every
case once (--iters steps between CUDA events), back to back, so the GPU's speed drifting during
the run weighs on every case alike. Prints one RESULT line per case (the median ms per forward +
backward, peak memory) and the ratio window / full causal: the median over the rounds of the
window's time over that round's fastest full-causal kernel, and against `auto`, next to the ratio
of the key counts.
"""

import argparse
import contextlib
import statistics

import torch

from teratron.transformer import cudnn_window_attention
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.transformer_config import TransformerConfig


def build(args, window=None, softmax_type="vanilla", backend="auto"):
    config = TransformerConfig(
        num_layers=1, hidden_size=args.heads * args.head_dim, num_attention_heads=args.heads,
        num_query_groups=args.groups, kv_channels=args.head_dim, window_size=window, softmax_type=softmax_type,
        attention_backend=backend, attention_dropout=0.0, hidden_dropout=0.0, bf16=True,
        params_dtype=torch.bfloat16)
    return DotProductAttention(config, layer_number=1)


@contextlib.contextmanager
def on_flex_attention():
    """Windows on FlexAttention: cuDNN's native band kept off."""
    saved = cudnn_window_attention.available
    cudnn_window_attention.available = lambda *args: False
    try:
        yield
    finally:
        cudnn_window_attention.available = saved


def cudnn_window_unavailable(args) -> str | None:
    """Why the windowed layer would not run on cuDNN's native band here, or None."""
    if not cudnn_window_attention.PACKAGE_FOUND:
        return "the cuDNN frontend is not installed: pip install teratron[cudnn]"
    shape = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.empty(args.batch, args.heads, args.seq_length, args.head_dim, **shape)
    kv = torch.empty(args.batch, args.groups, args.seq_length, args.head_dim, **shape)
    if not cudnn_window_attention.available(q, kv, kv, (args.window, 0), True, 0.0, None):
        return "cuDNN's fused attention cannot run these inputs on this GPU"
    return None


def make_step(attention, args):
    """One forward + backward of the layer on fresh [s, b, heads, head_dim] inputs (a closure)."""
    s, b = args.seq_length, args.batch
    shape = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(s, b, args.heads, args.head_dim, **shape, requires_grad=True)
    k, v = (torch.randn(s, b, args.groups, args.head_dim, **shape, requires_grad=True) for _ in range(2))
    upstream = torch.randn(s, b, args.heads * args.head_dim, **shape)

    def step():
        attention(q, k, v).backward(upstream)
        for t in (q, k, v, *attention.parameters()):
            t.grad = None

    return step


def time_steps(step, iters: int) -> float:
    """Milliseconds per step over `iters` steps between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_cases(steps: dict, args) -> dict:
    """{name: [ms of each repeat]}: every case warmed up (compilation included), then --repeats rounds,
    each timing every case once, back to back (so a drift of the GPU's speed during the run weighs
    on all cases alike, and each round's ratios compare neighbours)."""
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    torch.cuda.synchronize()
    timings = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            timings[name].append(time_steps(step, args.iters))
    return timings


def peak_memory(step) -> float:
    """GiB allocated at the peak of one step."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def visible_keys_ratio(seq_length: int, window: int) -> float:
    """Keys the windowed queries see over the keys causal queries see."""
    causal = seq_length * (seq_length + 1) // 2
    windowed = sum(min(i, window) + 1 for i in range(seq_length))
    return windowed / causal


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024, help="Keys before each query (window (W, 0)).")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=16, help="Key/value heads (GQA when fewer than --heads).")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="Steps per timing.")
    parser.add_argument("--repeats", type=int, default=9, help="Rounds of timings; medians are reported.")
    parser.add_argument("--skip-flex", action="store_true", help="No FlexAttention cases (minutes of compilation).")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sliding_window_bench: needs a CUDA GPU")
    torch.manual_seed(0)
    window = (args.window, 0)
    flex = on_flex_attention
    plain = contextlib.nullcontext
    sinks = f"window {args.window} + learned sinks"
    cases = {  # name: (layer, the context it runs in); FlexAttention's last (its compilation is slow)
        "full causal, SDPA auto": (lambda: build(args), plain),
        "full causal, SDPA flash": (lambda: build(args, backend="flash"), plain),
        "full causal, SDPA cuDNN (fused)": (lambda: build(args, backend="fused"), plain),
    }
    skipped = {}  # name: why it is not run
    cudnn_name = f"window {args.window}, cuDNN native band"
    cases[cudnn_name] = (lambda: build(args, window=window), plain)
    reason = cudnn_window_unavailable(args)
    if reason:
        skipped[cudnn_name] = reason
    if not args.skip_flex:
        cases.update({
            "full causal, FlexAttention": (lambda: build(args, window=(args.seq_length, 0)), flex),
            f"window {args.window}, FlexAttention": (lambda: build(args, window=window), flex),
            f"{sinks}, FlexAttention": (lambda: build(args, window, "learnable"), flex),
        })
    shape = (f"seq {args.seq_length}, batch {args.batch}, heads {args.heads} (kv {args.groups}) x {args.head_dim}, "
             f"bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    steps, peaks = {}, {}
    for name, (make, context) in cases.items():
        if name in skipped:
            print(f"RESULT {name}: not run ({skipped[name]})", flush=True)
            continue
        with context():
            step = make_step(make().cuda(), args)
            try:
                peaks[name] = peak_memory(step)
            except RuntimeError as error:  # a pinned SDPA kernel that cannot run this shape
                print(f"RESULT {name}: not run ({str(error).splitlines()[0]})", flush=True)
                continue
        steps[name] = in_context(step, context)
    timings = time_cases(steps, args)
    times = {name: statistics.median(ms) for name, ms in timings.items()}
    for name, ms in times.items():
        print(f"RESULT {name}: {ms:.3f} ms forward+backward, peak {peaks[name]:.2f} GiB ({shape})", flush=True)
    full = [name for name in times if name.startswith("full causal, SDPA")]
    fastest = min(full, key=times.get)
    keys = visible_keys_ratio(args.seq_length, args.window)
    for name in times:
        if name.startswith(f"window {args.window}"):
            # each round's window time over that round's fastest full causal; their median
            rounds = [ms / min(timings[f][r] for f in full) for r, ms in enumerate(timings[name])]
            print(f"RESULT {name} / full causal: {statistics.median(rounds):.3f} (median over {args.repeats} rounds "
                  f"of the ratio to that round's fastest, {min(rounds):.3f}-{max(rounds):.3f}; {fastest} fastest "
                  f"overall); {times[name] / times['full causal, SDPA auto']:.3f} (vs SDPA auto); target <= "
                  f"{1 / 6:.3f}; visible keys {keys:.3f}", flush=True)


def in_context(step, context):
    """step, run inside `context()` each time (FlexAttention's cases keep cuDNN's band off)."""
    def run():
        with context():
            step()
    return run


if __name__ == "__main__":
    main()
