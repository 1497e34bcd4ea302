"""`teratron bench`: teratron's training throughput next to the Hugging Face baseline.

    teratron bench                       # benchmark shape, 1 GPU, HF baseline with torch.compile
    teratron bench --nproc-per-node 2 --tensor-model-parallel-size 2
    teratron bench --tiny                # CPU smoke test (no baseline)
    teratron bench --reference-flags "--attention-backend unfused"   # + the loss curve against it

Runs `teratron train` (same code path, as a subprocess; torchrun for several GPUs) on mock data
at the benchmark shape with bf16 params, fp32 master weights and grads, Adam and clipping, for
--warmup-iters + --iters iterations; then the HF baseline script on the same GPU; prints
tokens/s, TFLOP/s, MFU and peak memory of both, their ratio, and `teratron estimate`'s peak next
to the measured one. With --reference-flags it trains once more with those flags appended (the
reference path: same iterations and seed) and compares the two per-iteration lm-loss curves.
Any other flag goes to `teratron train` and overrides the defaults.
Nothing is written unless --results-md PATH is given (then an entry is appended to it).
"""

import json
import os
import shlex
import sys
import tempfile
from dataclasses import asdict

from teratron.training.arguments import ArgumentParser

DEFAULT_BASELINE = os.path.join("bench", "hf_baseline.py")
# Flags the harness sets itself: it times iterations from the per-iteration metrics file.
_OWNED_FLAGS = {"--train-iters": "--iters and --warmup-iters", "--metrics-file": "the harness (a temporary file)",
                "--log-interval": "the harness (1, to time every iteration)"}


def add_arguments(parser):
    g = parser.add_argument_group("bench")
    g.add_argument("--tiny", action="store_true",
                   help="A tiny shape for a CPU smoke test (implies --skip-baseline: the baseline's shape is fixed).")
    g.add_argument("--iters", type=int, default=10, help="Timed iterations.")
    g.add_argument("--warmup-iters", type=int, default=3, help="Iterations run before timing.")
    g.add_argument("--nproc-per-node", type=int, default=1, help="GPUs (torchrun processes) for teratron.")
    g.add_argument("--hf-baseline", default=DEFAULT_BASELINE, help="Path of the HF baseline script.")
    g.add_argument("--baseline-eager", action="store_true", help="Run the baseline without torch.compile.")
    g.add_argument("--skip-baseline", action="store_true", help="Do not run the HF baseline.")
    g.add_argument("--reference-flags", default=None, metavar="FLAGS",
                   help="Train again with these `teratron train` flags appended (one quoted string) and compare "
                        "the lm-loss curves.")
    g.add_argument("--results-md", default=None, help="Append a markdown entry with the results here.")
    g.add_argument("--json", action="store_true", help="Print the results as JSON instead of a table.")
    return parser


def parse_args(argv):
    """The bench's own flags; everything else is kept as `teratron train` flags."""
    argv = list(argv)
    parser = add_arguments(ArgumentParser(prog="teratron bench", allow_abbrev=False,
                                          description="Benchmark teratron training against the HF baseline; "
                                                      "other flags go to `teratron train`."))
    args, train_flags = parser.parse_known_args(argv)
    try:
        args.reference = None if args.reference_flags is None else shlex.split(args.reference_flags)
    except ValueError as e:
        raise ValueError(f"--reference-flags {args.reference_flags!r}: {e}; pass the flags as one quoted string") \
            from None
    for flag in train_flags + (args.reference or []):
        owner = _OWNED_FLAGS.get(flag.split("=")[0])
        if owner:
            raise ValueError(f"{flag} is set by teratron bench ({owner}); drop it")
    if args.iters < 1 or args.warmup_iters < 0 or args.nproc_per_node < 1:
        raise ValueError("--iters and --nproc-per-node must be >= 1 and --warmup-iters >= 0")
    args.train_flags, args.argv = train_flags, argv
    return args


def _estimate(train_argv, world_size, device_type):
    """`teratron estimate`'s peak allocated GiB of the last rank (which logs mem_peak_gib), or
    None for a run the estimate does not model."""
    from teratron.estimate.activations import NotModelled
    from teratron.estimate.report import estimate_from_args
    from teratron.training.arguments import parse_train_args

    try:
        estimate = estimate_from_args(parse_train_args(train_argv), world_size, device_type)
    except NotModelled:
        return None
    return estimate.stages[-1].memory.peak_allocated / 2**30


def _reference_overrides(reference: list, checked) -> list:
    """The reference run's extra flags; a torch.profiler trace of it goes to <profile-dir>/reference
    unless the flags name a directory, so it does not overwrite the measured run's (`checked` is
    the measured run's RunConfig)."""
    profiling = checked.profiling
    if profiling.profile and profiling.use_pytorch_profiler and not any(
            f.split("=")[0] == "--profile-dir" for f in reference):
        return reference + ["--profile-dir", os.path.join(profiling.profile_dir, "reference")]
    return reference


def run(args) -> int:
    import torch

    from teratron.bench import runs
    from teratron.bench.report import comparison, results_entry
    from teratron.bench.shapes import train_argv
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import build_run_config

    on_gpu = torch.cuda.is_available()
    skip_baseline = args.skip_baseline or args.tiny
    if not skip_baseline and not on_gpu:
        raise ValueError("the HF baseline needs a CUDA GPU; pass --skip-baseline (or --tiny) on CPU")
    with tempfile.TemporaryDirectory(prefix="teratron-bench-") as tmp:
        metrics, ref_metrics = os.path.join(tmp, "metrics.jsonl"), os.path.join(tmp, "reference.jsonl")
        argv = train_argv(args.tiny, args.warmup_iters, args.iters, args.train_flags, metrics)
        checked = build_run_config(parse_train_args(argv), args.nproc_per_node)  # bad flags fail before any run
        if args.reference is not None:
            ref_argv = train_argv(args.tiny, args.warmup_iters, args.iters,
                                  args.train_flags + _reference_overrides(args.reference, checked), ref_metrics)
            build_run_config(parse_train_args(ref_argv), args.nproc_per_node)
        records = runs.run_training(argv, args.nproc_per_node, metrics)
        ours = runs.summarize(records, args.warmup_iters)
        loss = None
        if args.reference is not None:
            ref_records = runs.run_training(ref_argv, args.nproc_per_node, ref_metrics)
            loss = runs.compare_losses(records, ref_records, shlex.join(args.reference), args.warmup_iters)
    baseline = None
    if not skip_baseline:
        training = checked.training
        accumulation = training.global_batch_size // (training.micro_batch_size
                                                      * checked.distributed.data_parallel_size)
        baseline = runs.run_baseline(args.hf_baseline, not args.baseline_eager, training.micro_batch_size,
                                     accumulation, args.iters)
    shown = [a for a in argv if a != metrics and a != "--metrics-file"]
    estimated = _estimate(shown, args.nproc_per_node, "cuda" if on_gpu else "cpu")
    table = comparison(ours, baseline, args.nproc_per_node, estimated, on_gpu, loss)
    if args.json:
        print(json.dumps({"teratron": vars(ours), "baseline": None if baseline is None else vars(baseline),
                          "reference": None if loss is None else asdict(loss),
                          "world_size": args.nproc_per_node, "estimated_peak_gib": estimated}))
    else:
        print("\n".join(table))
    if args.results_md:
        hardware = (f"{torch.cuda.get_device_name()} x {args.nproc_per_node}" if on_gpu
                    else f"CPU ({os.cpu_count()} cores)")
        with open(args.results_md, "a") as f:
            f.write(results_entry("teratron bench " + shlex.join(args.argv), hardware,
                                  [f"teratron train flags: `{' '.join(shown)}`"], table))
    return 0


def main(argv=None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
