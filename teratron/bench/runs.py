"""The two measured runs of `teratron bench`, each a subprocess (so each starts with an empty GPU
and its own peak-memory counter): `teratron train` (under torchrun for several GPUs) and the
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
    if nproc_per_node == 1:
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


def run_training(train_argv: list, nproc_per_node: int, metrics_file: str, warmup_iters: int) -> TrainResult:
    _run(train_command(train_argv, nproc_per_node), "teratron train")
    with open(metrics_file) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return summarize(records, warmup_iters)


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
        raise FileNotFoundError(f"--hf-baseline {script}: no such file; copy ../shared/bench/hf_baseline.py "
                                "there, or pass --skip-baseline")
    env = dict(os.environ, COMPILE="1" if compile else "0", MBS=str(micro_batch_size),
               ACC=str(accumulation), STEPS=str(steps))
    return parse_baseline(_run([sys.executable, script], "the HF baseline", env))
