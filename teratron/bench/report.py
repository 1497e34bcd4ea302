"""The comparison `teratron bench` prints, and the entry it appends to bench/RESULTS.md."""

import os
import subprocess
import time
from typing import Optional

from teratron.bench.runs import BaselineResult, LossComparison, TrainResult


def _row(name, tokens, tflops, mfu, mem):
    mfu = "-" if mfu is None else f"{mfu:.1%}"
    return f"| {name} | {tokens:,.0f} | {tflops:.4g} | {mfu} | {mem:.2f} |"


def comparison(ours: TrainResult, baseline: Optional[BaselineResult], world_size: int,
               estimated_peak_gib: Optional[float], on_gpu: bool, loss: Optional[LossComparison] = None) -> list:
    """Markdown table lines: per-GPU tokens/s, TFLOP/s/GPU, MFU, peak memory (of the reference
    run too, with `loss`); then the ratio, the estimate against the measured peak and the loss
    curve against the reference."""
    lines = ["| system | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB |", "|---|---|---|---|---|",
             _row("teratron", ours.tokens_per_sec / world_size, ours.tflops_per_gpu, ours.mfu, ours.mem_peak_gib)]
    if loss is not None:
        ref = loss.reference
        lines.append(_row(f"teratron reference (`{loss.reference_flags}`)", ref.tokens_per_sec / world_size,
                          ref.tflops_per_gpu, ref.mfu, ref.mem_peak_gib))
    if baseline is not None:
        kind = "torch.compile" if baseline.compile else "eager"
        lines.append(_row(f"HF Llama, SDPA, {kind}", baseline.tokens_per_sec, baseline.tflops, baseline.mfu,
                          baseline.peak_mem_gib))
        ratio = ours.tokens_per_sec / world_size / baseline.tokens_per_sec
        lines += ["", f"teratron / HF tokens/s per GPU: {ratio:.3f}x"]
    measured = "peak allocated" if on_gpu else "peak RSS of the CPU process, not comparable"
    if estimated_peak_gib is None:
        lines += ["", f"`teratron estimate` does not model this run; measured {measured}: {ours.mem_peak_gib:.2f} GiB"]
    else:
        error = (estimated_peak_gib - ours.mem_peak_gib) / ours.mem_peak_gib
        lines += ["", f"`teratron estimate` peak allocated: {estimated_peak_gib:.2f} GiB; measured {measured}: "
                      f"{ours.mem_peak_gib:.2f} GiB ({error:+.1%})"]
    return lines + (loss_curve(loss) if loss is not None else [])


def loss_curve(loss: LossComparison) -> list:
    """The lm-loss curve against the reference run: |delta| over all iterations, then a table of
    the first, every 10th and the last iteration."""
    (i0, ours0, ref0), (i1, ours1, ref1) = loss.first, loss.last
    lines = ["", f"lm loss against the reference (`{loss.reference_flags}`) over {loss.iterations} iterations: "
                 f"max |delta| {loss.max_abs_delta:.3e}, mean |delta| {loss.mean_abs_delta:.3e}; "
                 f"iteration {i0}: {ours0:.6f} vs {ref0:.6f}; iteration {i1}: {ours1:.6f} vs {ref1:.6f}; "
                 f"reference tokens/s: {loss.reference.tokens_per_sec:,.0f}",
             "", "| iteration | teratron lm loss | reference lm loss | delta |", "|---|---|---|---|"]
    lines += [f"| {i} | {ours:.6f} | {ref:.6f} | {ours - ref:+.3e} |" for i, ours, ref in loss.curve]
    return lines


def git_commit() -> str:
    """HEAD (and whether the tree is dirty); a copy without .git (the GPU machine gets one) names its
    commit through TERATRON_COMMIT."""
    if os.environ.get("TERATRON_COMMIT"):
        return os.environ["TERATRON_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" (with uncommitted changes)" if dirty else "")


def results_entry(command: str, hardware: str, details: list, table: list) -> str:
    """A RESULTS.md entry: when, on what, which code and command, more `details` (one bullet
    each: the `teratron train` flags of a training benchmark), then the numbers."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return "\n".join([f"## {stamp} — {hardware}", "",
                      f"- command: `{command}`",
                      f"- commit: {git_commit()}",
                      *(f"- {detail}" for detail in details), "", *table, "", ""])
