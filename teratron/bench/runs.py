"""The measured runs of `teratron bench`, each a subprocess (so each starts with an empty GPU and
its own peak-memory counter): `teratron train` (under torchrun for several GPUs), optionally again
with --reference-flags appended (the reference path, whose loss curve it must match), and the
Hugging Face baseline script."""

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainResult:
    """teratron's numbers over the timed iterations (`--metrics-file` records after warm-up)."""

    iterations: int
    tokens_per_sec: float        # whole job
    tflops_per_gpu: float
    mfu: Optional[float]         # None off a listed GPU
    mem_peak_gib: float          # torch.cuda.max_memory_allocated (CPU: peak RSS) of the logging rank
    lm_loss: Optional[float]


@dataclass
class BaselineResult:
    compile: bool
    tokens_per_sec: float
    tflops: float
    mfu: float
    peak_mem_gib: float


def train_command(train_argv: list, nproc_per_node: int) -> list:
    """`teratron train` as one process, or under torchrun (several processes, or FSDP, which needs
    torch.distributed even on one GPU)."""
    fsdp = any(flag in train_argv for flag in ("--use-torch-fsdp2", "--use-megatron-fsdp"))
    if nproc_per_node == 1 and not fsdp:
        return [sys.executable, "-m", "teratron", "train", *train_argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}",
            "-m", "teratron", "train", *train_argv]


def _run(command: list, what: str, env=None) -> str:
    """Run `command`, its output streaming to ours; returns stdout."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    if proc.wait():
        raise ChildProcessError(f"{what} failed with exit status {proc.returncode}: {' '.join(command)}")
    return "".join(lines)


def run_training(train_argv: list, nproc_per_node: int, metrics_file: str) -> list:
    """Run `teratron train`; returns its metrics records."""
    _run(train_command(train_argv, nproc_per_node), "teratron train")
    with open(metrics_file) as f:
        return [json.loads(line) for line in f if line.strip()]


def _harmonic_mean(values):
    # Every iteration moves the same tokens and FLOPs, so rates combine by total time.
    return len(values) / sum(1.0 / v for v in values)


def summarize(records: list, warmup_iters: int) -> TrainResult:
    """Rates over the iterations after `warmup_iters` (one record per iteration)."""
    records = [r for r in records if "lr" in r]  # training records; evaluation ones have no lr
    timed = [r for r in records if r["iteration"] > warmup_iters and not r["skipped"]]
    if not timed:
        raise ChildProcessError(f"teratron train logged no iteration after the {warmup_iters} warm-up ones; "
                                "raise --iters")
    mfu = [r["mfu"] for r in timed if r["mfu"] is not None]
    return TrainResult(
        iterations=len(timed),
        tokens_per_sec=_harmonic_mean([r["tokens_per_sec"] for r in timed]),
        tflops_per_gpu=_harmonic_mean([r["tflops_per_gpu"] for r in timed]),
        mfu=_harmonic_mean(mfu) if len(mfu) == len(timed) else None,
        mem_peak_gib=max(r["mem_peak_gib"] for r in records),
        lm_loss=timed[-1]["lm_loss"],
    )


@dataclass
class LossComparison:
    """teratron's per-iteration lm loss against the reference run's (same flags and seed, plus
    `reference_flags`), over every iteration both logged a loss for, warm-up included."""

    reference_flags: str
    reference: TrainResult       # the reference run's own rates
    iterations: int
    max_abs_delta: float
    mean_abs_delta: float
    first: tuple                 # (iteration, teratron loss, reference loss)
    last: tuple
    curve: list                  # (iteration, teratron, reference): first, every 10th, last


def _losses(records: list) -> dict:
    return {r["iteration"]: r["lm_loss"] for r in records if "lr" in r and r["lm_loss"] is not None}


def compare_losses(records: list, reference_records: list, reference_flags: str, warmup_iters: int) -> LossComparison:
    ours, ref = _losses(records), _losses(reference_records)
    common = sorted(ours.keys() & ref.keys())
    if not common:
        raise ChildProcessError("the run and the reference run logged no lm loss at a common iteration")
    deltas = [abs(ours[i] - ref[i]) for i in common]
    shown = [i for i in common if i == common[0] or i % 10 == 0 or i == common[-1]]
    return LossComparison(
        reference_flags=reference_flags,
        reference=summarize(reference_records, warmup_iters),
        iterations=len(common),
        max_abs_delta=max(deltas),
        mean_abs_delta=sum(deltas) / len(deltas),
        first=(common[0], ours[common[0]], ref[common[0]]),
        last=(common[-1], ours[common[-1]], ref[common[-1]]),
        curve=[(i, ours[i], ref[i]) for i in shown],
    )


_BASELINE_LINE = re.compile(r"hf_baseline compile=(\w+) tokens/s=([\d.]+) TFLOP/s=([\d.]+) MFU=([\d.]+) "
                            r"peak_mem_GiB=([\d.]+)")


def parse_baseline(output: str) -> BaselineResult:
    match = _BASELINE_LINE.search(output)
    if match is None:
        raise ChildProcessError("the HF baseline printed no 'hf_baseline compile=... tokens/s=...' line")
    compiled, tokens, tflops, mfu, mem = match.groups()
    return BaselineResult(compile=compiled == "True", tokens_per_sec=float(tokens), tflops=float(tflops),
                          mfu=float(mfu), peak_mem_gib=float(mem))


def run_baseline(script: str, compile: bool, micro_batch_size: int, accumulation: int, steps: int) -> BaselineResult:
    """The HF Llama baseline at its fixed (benchmark) shape, on one GPU, with our batch layout."""
    if not os.path.isfile(script):
        raise FileNotFoundError(f"--hf-baseline {script}: no such file; pass the path of the repository's "
                                "bench/hf_baseline.py, or pass --skip-baseline")
    env = dict(os.environ, COMPILE="1" if compile else "0", MBS=str(micro_batch_size),
               ACC=str(accumulation), STEPS=str(steps))
    return parse_baseline(_run([sys.executable, script], "the HF baseline", env))
