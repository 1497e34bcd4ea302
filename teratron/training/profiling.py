"""`teratron train --profile`: profile iterations [--profile-step-start, --profile-step-end)
(1-based) on the ranks of --profile-ranks, with Megatron's flags.

- `--use-pytorch-profiler`: torch.profiler records CPU ops (and CUDA kernels when a GPU is
  present) and, when the range ends (or training does), writes to --profile-dir
  `trace_rank{r}.json` (a chrome trace: Perfetto or chrome://tracing) and `kernels_rank{r}.txt`:
  the time per kernel category as a fraction of the profiled wall time; on a GPU, the device's
  busy time, the NCCL time no compute kernel hides and the largest idle gaps; then
  `key_averages` sorted by total device time (CPU time without a GPU), top 60 rows.
- otherwise (Megatron's nsys mode): `torch.cuda.profiler.start/stop` (cudaProfilerStart/Stop) and
  NVTX ranges per op bracket the range, for
  `nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop ...`.
"""

import os
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd import DeviceType

TABLE_ROWS = 60
# Kernel categories, matched in this order on the lower-cased name (attention before GEMM: the
# memory-efficient attention kernels are named fmha_cutlass*). The aten names are the CPU ops.
CATEGORIES = (
    ("NCCL", ("nccl", "gloo")),
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "scaled_dot_product")),
    ("GEMM", ("gemm", "cutlass", "sm90_xmma", "nvjet", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
)
OTHER = "elementwise/reduction/other"


def kernel_category(name: str) -> str:
    lowered = name.lower()
    return next((category for category, patterns in CATEGORIES if any(p in lowered for p in patterns)), OTHER)


def category_times(kernels) -> dict:
    """{category: total microseconds} of (name, microseconds) pairs, every category present."""
    totals = {category: 0.0 for category, _ in CATEGORIES}
    totals[OTHER] = 0.0
    for name, us in kernels:
        totals[kernel_category(name)] += us
    return totals


def summary_lines(totals: dict, wall_us: float, what: str) -> list:
    return [f"{category:<28} {us / 1e3:12.3f} ms  {us / wall_us:7.1%} of wall time ({what})"
            for category, us in totals.items()]


def _merge(intervals) -> list:
    """Sorted, non-overlapping [start, end] covering the (start, end) pairs."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(merged) -> float:
    return sum(end - start for start, end in merged)


def _overlap(a, b) -> float:
    """Total length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline_lines(kernels, wall_us: float, top: int = 8) -> list:
    """What the device timeline says beyond kernel totals: kernels are (name, start_us, end_us).

    Busy is the union of all kernels; NCCL not hidden is collective time with no compute kernel
    running beside it (the communication a step waits for); the largest idle gaps, with the
    kernels around them, point at host syncs and launch-bound code."""
    if not kernels:
        return []
    spans = []  # [start, end, first kernel, kernel ending last] of each busy stretch
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if spans and start <= spans[-1][1]:
            if end >= spans[-1][1]:
                spans[-1][1], spans[-1][3] = end, name
        else:
            spans.append([start, end, name, name])
    busy = [span[:2] for span in spans]
    nccl = _merge((start, end) for name, start, end in kernels if kernel_category(name) == "NCCL")
    compute = _merge((start, end) for name, start, end in kernels if kernel_category(name) != "NCCL")
    idle = [(nxt[0] - cur[1], cur[1] - spans[0][0], cur[3], nxt[2]) for cur, nxt in zip(spans, spans[1:])]
    hidden = _overlap(nccl, compute)
    lines = [f"{'device busy (union of kernels)':<28} {_length(busy) / 1e3:12.3f} ms  {_length(busy) / wall_us:7.1%} of wall time",
             f"{'NCCL not hidden by compute':<28} {(_length(nccl) - hidden) / 1e3:12.3f} ms",
             "largest idle gaps, ms (at ms after the first kernel: last kernel before -> next kernel):"]
    for gap, at, before, after in sorted(idle, reverse=True)[:top]:
        lines.append(f"  {gap / 1e3:8.3f} at {at / 1e3:10.3f}: {before[:60]} -> {after[:60]}")
    return lines


class Profiler:
    """Starts before iteration `start` runs and stops before iteration `end` (or at the end of
    training); `step(iteration)` is called before each iteration."""

    def __init__(self, config, rank: int, device: torch.device):
        self.start, self.end, self.rank = config.profile_step_start, config.profile_step_end, rank
        self.use_pytorch_profiler = config.use_pytorch_profiler
        self.profile_dir = config.profile_dir
        self.on_cuda = device.type == "cuda"
        if not self.use_pytorch_profiler and not self.on_cuda:
            raise ValueError("--profile without --use-pytorch-profiler drives nsys (cudaProfilerStart) and needs "
                             "a CUDA GPU; add --use-pytorch-profiler")
        self.session = None
        self.first = None
        self.started_at = 0.0

    def step(self, iteration: int) -> None:
        if self.session is not None and iteration == self.end:
            self.stop(iteration - 1)
        if iteration == self.start:
            self._begin(iteration)

    def _sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize()

    def _begin(self, iteration: int) -> None:
        self._sync()
        if self.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.on_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.session = torch.profiler.profile(activities=activities, record_shapes=True)
            self.session.start()
        else:
            torch.cuda.profiler.start()
            self.session = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.session.__enter__()
        self.first, self.started_at = iteration, time.perf_counter()

    def stop(self, last_iteration: int) -> None:
        """End the range after `last_iteration`; writes the files in torch.profiler mode."""
        if self.session is None:
            return
        self._sync()
        wall_us = (time.perf_counter() - self.started_at) * 1e6
        session, self.session = self.session, None
        if not self.use_pytorch_profiler:
            session.__exit__(None, None, None)
            torch.cuda.profiler.stop()
            return
        session.stop()
        os.makedirs(self.profile_dir, exist_ok=True)
        trace = os.path.join(self.profile_dir, f"trace_rank{self.rank}.json")
        table = os.path.join(self.profile_dir, f"kernels_rank{self.rank}.txt")
        session.export_chrome_trace(trace)
        with open(table, "w") as f:
            f.write(self._report(session, wall_us, last_iteration))
        print(f"profile of iterations {self.first}-{last_iteration} (rank {self.rank}): {trace}, {table}", flush=True)

    def _report(self, session, wall_us: float, last_iteration: int) -> str:
        averages, timeline = session.key_averages(), []
        if self.on_cuda:
            # Device events only, without the annotations mirrored on the device timeline
            # (record_function ranges such as compiled graphs' "## Call ..."), which hold kernels.
            kernels = [(e.key, e.self_device_time_total) for e in averages
                       if e.device_type != DeviceType.CPU and not e.is_user_annotation]
            what, sort_by = "CUDA kernel time", "device_time_total"
            timeline = timeline_lines([(e.name, e.time_range.start, e.time_range.end) for e in session.events()
                                       if e.device_type != DeviceType.CPU and not e.is_user_annotation], wall_us)
        else:
            # No GPU: the ops' own CPU time (threads add up, so the sum can pass 100 %).
            kernels = [(e.key, e.self_cpu_time_total) for e in averages if e.device_type == DeviceType.CPU]
            what, sort_by = "self CPU time of ops, no GPU", "cpu_time_total"
        count = last_iteration - self.first + 1
        header = (f"rank {self.rank}, iterations {self.first}-{last_iteration} ({count}), "
                  f"wall time {wall_us / 1e3:.3f} ms ({wall_us / 1e3 / count:.3f} ms per iteration)")
        return "\n".join([header, "", *summary_lines(category_times(kernels), wall_us, what), *timeline, "",
                          averages.table(sort_by=sort_by, row_limit=TABLE_ROWS), ""])


def build_profiler(config, device: torch.device) -> Optional[Profiler]:
    """A Profiler when --profile is on and this rank is in --profile-ranks (a ProfilingConfig),
    else None."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not config.profile or rank not in config.profile_ranks:
        return None
    return Profiler(config, rank, device)
