"""The straggler report (Megatron's `--log-straggler`, `--straggler-minmax-count`): every log
interval, each rank's mean step time is gathered and the slowest and fastest ranks are named.

A rank's step time runs from the start of its step until it reaches the gradient reduction
(`finalize_model_grads`): its own forward and backward. The whole step would not do: the
reduction makes every rank wait for the slowest, so all step times come out equal. Under TP,
CP, EP or PP the forward and backward hold collectives of their own, so the ranks of one model
replica wait for each other too and the report names the slow data-parallel replica (with all
its ranks near the top). On CUDA the times are measured with CUDA events (device time, read
once the step's losses have reached the host); on CPU with the host clock.
"""

import time

import torch
import torch.distributed as dist


class _HostClock:
    def __init__(self):
        self.start = self.reached = None

    def mark_start(self):
        self.start = time.perf_counter()

    def mark_reduction(self):
        self.reached = time.perf_counter()

    def seconds(self) -> float:
        return self.reached - self.start


class _DeviceClock:
    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.reached = torch.cuda.Event(enable_timing=True)

    def mark_start(self):
        self.start.record()

    def mark_reduction(self):
        self.reached.record()

    def seconds(self) -> float:
        self.reached.synchronize()
        return self.start.elapsed_time(self.reached) / 1000


class StragglerReport:
    """Wraps the model config's `finalize_model_grads_func` to time each step up to it."""

    def __init__(self, config, device, minmax_count: int = 1):
        self.device = device
        self.minmax_count = minmax_count
        self.clock = _DeviceClock() if device.type == "cuda" else _HostClock()
        self.total_s, self.steps = 0.0, 0
        self.reached = False  # this step reached the gradient reduction
        finalize = config.finalize_model_grads_func

        def timed_finalize(*args, **kwargs):
            self.clock.mark_reduction()
            self.reached = True
            return finalize(*args, **kwargs)

        config.finalize_model_grads_func = timed_finalize

    def step_started(self) -> None:
        self.reached = False
        self.clock.mark_start()

    def step_ended(self) -> None:
        if self.reached:
            self.total_s += self.clock.seconds()
            self.steps += 1

    def gather(self) -> list:
        """Every rank's mean step time (seconds) since the last gather, by rank (a collective)."""
        mean = torch.tensor([self.total_s / max(self.steps, 1)], dtype=torch.float64, device=self.device)
        self.total_s, self.steps = 0.0, 0
        if not dist.is_initialized():
            return [mean.item()]
        gathered = [torch.empty_like(mean) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mean)
        return [t.item() for t in gathered]

    def line(self, times: list) -> str:
        """ "straggler: slowest rank(s) 3 (120.4 ms), 1 (..) | fastest rank(s) 0 (20.1 ms) | ..." """
        order = sorted(range(len(times)), key=lambda rank: times[rank], reverse=True)
        n = min(self.minmax_count, len(times))

        def named(ranks):
            return ", ".join(f"{rank} ({times[rank] * 1000:.1f} ms)" for rank in ranks)

        return (f"straggler: step time up to the gradient reduction, slowest rank(s) {named(order[:n])} | "
                f"fastest rank(s) {named(order[::-1][:n])} | slowest / fastest {_ratio(times, order):.2f}")


def _ratio(times, order) -> float:
    fastest = times[order[-1]]
    return times[order[0]] / fastest if fastest > 0 else float("inf")
