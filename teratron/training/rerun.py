"""The rerun state machine (Megatron's `--rerun-mode`): a suspicious step is run again on the same
data and random state before its optimizer step, to tell a transient fault from a reproducible one.

    machine = RerunStateMachine(run.training, model_chunks, data_iterators, device)  # wraps the iterators
    losses = machine.run_step(iteration, forward_backward)   # forward_backward() -> device losses
    optimizer.step()

A step is suspicious when a check rejects it (every rank learns it: one all-reduce): a NaN/Inf loss
or gradient norm (`--check-for-nan-in-loss-and-grad`, fatal), a loss (`--check-for-spiky-loss`) or
a local gradient norm (`--check-for-large-grads`) at least 10x the largest of the first 100 steps
checked (not fatal), or an injected fault (`--error-injection-rate`, for tests). It is re-run with
the random states (Python, numpy, torch CPU and CUDA, the TP RNG tracker), the model's buffers and
the step's buffered micro-batches of the first try; the trainer zeroes the gradients, so nothing of
the first try reaches the optimizer. A re-run whose results differ and pass the checks was a
transient fault: training continues with it. One that reproduces a fatal rejection raises
`ReproducibleFaultError` (the trainer saves and exits with code 16). `report_determinism_stats`
re-runs every step and reports the relative spread of the loss and gradient norm.
"""

import datetime
import math
import os
import random
import signal
import socket
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
import torch.distributed as dist

from teratron.tensor_parallel.random import get_cuda_rng_tracker
from teratron.transformer.moe import clear_aux_losses_tracker

# Megatron's exit codes (megatron/core/rerun_state_machine.py).
EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17

LARGE_VALUE_FACTOR = 10      # spiky loss, large grads: this many times the largest value sampled
LARGE_VALUE_SAMPLES = 100    # steps sampled for that largest value
GRAD_NORM_TOLERANCE = 1e-3   # relative; backward kernels may be non-deterministic (the loss: none)
STATS_INTERVAL = 2           # report_determinism_stats: iterations between reports


class RerunMode(str, Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


RERUN_MODES = [mode.value for mode in RerunMode] + ["report_stats"]  # Megatron's parser spells the last this way
ERROR_INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")
INJECTED_FAULTS = ("transient_error", "persistent_error")  # these make the try's gradients NaN


def rerun_mode(value: str) -> RerunMode:
    return RerunMode.REPORT_DETERMINISM_STATS if value == "report_stats" else RerunMode(value)


class ReproducibleFaultError(RuntimeError):
    """The re-run reproduced a fatal rejection: a persistent fault, or a true result of the data
    and weights; the same step on other hardware tells which."""

    exit_code = EXIT_CODE_RESUME_TO_DISAMBIGUATE


class ReplayIterator:
    """A data iterator that keeps the current step's items so the step can be replayed."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.items, self.position, self.replaying = [], 0, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.replaying:
            self.position += 1
            return self.items[self.position - 1]
        item = next(self.iterator)
        self.items.append(item)
        return item

    def __getattr__(self, name):  # the wrapped iterator's own methods (a packed iterator's next_step)
        return getattr(self.iterator, name)

    def rewind(self) -> None:
        self.position, self.replaying = 0, True

    def advance(self) -> None:
        self.items, self.position, self.replaying = [], 0, False


@dataclass
class Measurement:
    """One try's checked results on this rank (host floats)."""
    loss: float         # the sum of the step's losses (0 on a rank without them); NaN stays NaN
    grad_norm: float    # this rank's local gradient norm


class RerunStateMachine:
    def __init__(self, training, model_chunks, data_iterators: list, device):
        self.device = device
        self.mode = rerun_mode(training.rerun_mode)
        self.check_nan = training.check_for_nan_in_loss_and_grad
        self.skip_nan_steps = training.skip_nan_steps
        self.check_spiky = training.check_for_spiky_loss
        self.check_large = training.check_for_large_grads
        self.model = model_chunks
        self.iterators = [ReplayIterator(it) for it in data_iterators] if self.enabled else data_iterators
        self.tracker_file = training.result_rejected_tracker_filename
        self.injection_rate, self.injection_type = training.error_injection_rate, training.error_injection_type
        self.injection_draws = random.Random(training.seed)  # its own: the run's streams stay as without it
        self.largest = {}       # "loss" / "grads" -> (samples seen, largest value)
        self.spreads = {"loss": [], "grad norm": []}  # report_determinism_stats: relative differences
        self.first_step_done = False
        if self.tracker_file is not None:
            try:
                open(self.tracker_file, "a").close()
            except OSError as e:
                raise OSError(f"--result-rejected-tracker-filename {self.tracker_file}: cannot be appended to "
                              f"({e.strerror}); choose a writable file") from None

    @property
    def enabled(self) -> bool:
        return self.mode is not RerunMode.DISABLED and (
            self.mode is RerunMode.REPORT_DETERMINISM_STATS or self.check_nan or self.check_spiky or self.check_large)

    def run_step(self, iteration: int, forward_backward, log=print) -> dict:
        """forward_backward() (zeroes the grads, runs the step's micro-batches, returns the losses);
        again when the machine asks. Returns the losses of the try whose gradients stand."""
        if not self.enabled:
            return forward_backward()
        for iterator in self.iterators:
            iterator.advance()
        saved = self._save_state()
        validating = self.mode is RerunMode.VALIDATE_RESULTS and self.first_step_done
        self.first_step_done = True
        injected = self._inject() if validating else None
        losses, first = self._try(forward_backward, corrupt=injected in INJECTED_FAULTS)
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            losses, second = self._rerun(saved, forward_backward)
            self._record_spread(iteration, first, second, log)
            return losses
        if validating:
            fatal, soft = self._rejections(first, injected)
            if fatal or soft:
                return self._rerun_rejected(iteration, saved, forward_backward, first, fatal, soft, injected, log)
        return losses

    def _rerun_rejected(self, iteration, saved, forward_backward, first, fatal, soft, injected, log) -> dict:
        """Run the rejected step again and judge: continue with the re-run, or raise."""
        what = _what(fatal, soft, injected)
        self._track(iteration, "initial_run", first, what)
        log(f"iteration {iteration}: {what}; re-running the step on the same data and random state")
        losses, second = self._rerun(saved, forward_backward, corrupt=injected == "persistent_error")
        if self._differs(first, second) and not self._rejections(second, None, sample=False)[0]:
            self._track(iteration, "first_rerun_not_reproducible", second, what)
            log(f"iteration {iteration}: the re-run differs and passes the checks (a transient fault); "
                "continuing with the re-run's results")
            return losses
        self._track(iteration, "first_rerun_reproducible", second, what)
        if fatal & 1 and self.skip_nan_steps:
            log(f"iteration {iteration}: the re-run reproduced it; --skip-nan-steps skips the step")
            return losses
        if fatal:
            advice = "; if training diverged, lower --lr, check the data, or pass --skip-nan-steps" if fatal & 3 else ""
            raise ReproducibleFaultError(f"iteration {iteration}: {what}, and the re-run on the same data reproduced "
                                         f"it (a persistent fault, or the data and weights really give it){advice}")
        log(f"iteration {iteration}: the re-run reproduced it; not fatal, continuing")
        return losses

    # ----- the tries -----

    def _save_state(self) -> dict:
        return {
            "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": get_cuda_rng_tracker().get_states(),
            # routers' token counts, FP8 amax histories: state a forward changes
            "buffers": [[b.detach().clone() for b in _module_buffers(chunk)] for chunk in self.model],
        }

    def _try(self, forward_backward, corrupt: bool = False):
        """(losses, Measurement) of one run of the step; `corrupt`: the injected fault."""
        losses = forward_backward()
        if corrupt:
            _corrupt_grads(self.model)
        return losses, self._measure(losses)

    def _rerun(self, saved: dict, forward_backward, corrupt: bool = False):
        random.setstate(saved["python"])
        np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["torch"])
        if saved["cuda"] is not None:
            torch.cuda.set_rng_state_all(saved["cuda"])
        get_cuda_rng_tracker().set_states(saved["tracker"])
        with torch.no_grad():
            for chunk, buffers in zip(self.model, saved["buffers"]):
                for buffer, value in zip(_module_buffers(chunk), buffers):
                    buffer.copy_(value)
        clear_aux_losses_tracker()  # the first try's MoE metrics
        for iterator in self.iterators:
            iterator.rewind()
        return self._try(forward_backward, corrupt)

    def _measure(self, losses: dict) -> Measurement:
        zero = torch.zeros((), device=self.device)
        by_dtype = {}
        for grad in _local_grads(self.model):
            by_dtype.setdefault((grad.device, grad.dtype), []).append(grad)
        # One multi-tensor kernel per (device, dtype) instead of a kernel and an fp32 copy per parameter.
        norms = [n.float().to(self.device) for grads in by_dtype.values() for n in torch._foreach_norm(grads)]
        loss = torch.stack([v.float().reshape(()) for v in losses.values()]).sum() if losses else zero
        grad_norm = torch.stack(norms).norm() if norms else zero
        return Measurement(*torch.stack([loss, grad_norm]).tolist())

    # ----- the checks -----

    def _rejections(self, m: Measurement, injected, sample: bool = True) -> tuple:
        """(fatal, soft) rejection bits, any rank's: fatal 1 loss NaN/Inf, 2 gradient norm NaN/Inf,
        4 injected; soft (with `sample`: the spiky-loss and large-grads checks) 1 spiky loss, 2 large grads."""
        flags = [self.check_nan and not math.isfinite(m.loss), self.check_nan and not math.isfinite(m.grad_norm),
                 bool(injected),
                 sample and self.check_spiky and self._unexpectedly_large("loss", m.loss),
                 sample and self.check_large and self._unexpectedly_large("grads", m.grad_norm)]
        flags = self._any_rank(flags)
        return flags[0] | flags[1] << 1 | flags[2] << 2, flags[3] | flags[4] << 1

    def _any_rank(self, flags: list) -> list:
        """Each flag or-ed over every rank (one all-reduce)."""
        values = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return values.tolist()

    def _unexpectedly_large(self, name: str, value: float) -> bool:
        value = abs(value)
        if not math.isfinite(value):
            return False  # the NaN check's business
        seen, largest = self.largest.get(name, (0, 0.0))
        if seen < LARGE_VALUE_SAMPLES:
            self.largest[name] = (seen + 1, max(largest, value))
            return False
        return value >= LARGE_VALUE_FACTOR * largest

    def _differs(self, first: Measurement, second: Measurement) -> bool:
        """Whether any rank's re-run gave other results (the loss exactly, the gradient norm within
        GRAD_NORM_TOLERANCE)."""
        differs = (_relative_difference(first.loss, second.loss) > 0
                   or _relative_difference(first.grad_norm, second.grad_norm) > GRAD_NORM_TOLERANCE)
        return bool(self._any_rank([differs])[0])

    def _inject(self):
        """The injected fault's type, or None: Megatron's draw, on average one validated step in
        `rate` and one rank (every rank draws the same number, offset by its rank)."""
        if self.injection_rate <= 0:
            return None
        rank = dist.get_rank() if dist.is_initialized() else 0
        if (self.injection_draws.randint(0, self.injection_rate - 1) + rank) % self.injection_rate != 0:
            return None
        return self.injection_type

    # ----- reports -----

    def _record_spread(self, iteration: int, first: Measurement, second: Measurement, log) -> None:
        self.spreads["loss"].append(_relative_difference(first.loss, second.loss))
        self.spreads["grad norm"].append(_relative_difference(first.grad_norm, second.grad_norm))
        if iteration % STATS_INTERVAL:
            return
        stats = torch.tensor([[max(v), sum(v), len(v), sum(x == 0 for x in v)] for v in self.spreads.values()],
                             dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            maxima = stats[:, :1].clone()
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats)
            stats[:, :1] = maxima
        parts = [f"{name}: {int(n):,} re-runs, {int(zeros):,} identical, relative spread mean {total / n:.3e} "
                 f"max {largest:.3e}" for name, (largest, total, n, zeros) in zip(self.spreads, stats.tolist())]
        log(f"determinism stats after iteration {iteration} (all ranks): " + "; ".join(parts))
        self.spreads = {name: [] for name in self.spreads}

    def _track(self, iteration: int, status: str, m: Measurement, message: str) -> None:
        """A line in Megatron's `--result-rejected-tracker-filename` format."""
        if self.tracker_file is None:
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        with open(self.tracker_file, "a") as f:
            f.write(f"ts={datetime.datetime.now()} node={socket.gethostname()} device={device} "
                    f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={rank} iteration={iteration} status={status} "
                    f"result=(loss {m.loss}, grad norm {m.grad_norm}) message='{message}'\n")


def kill_rank_for_test(iteration: int) -> None:
    """Tests of restarts: TERATRON_TEST_KILL_RANK_AT=RANK:ITERATION SIGKILLs that rank once that
    iteration's step is logged, in torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT 0)."""
    target = os.environ.get("TERATRON_TEST_KILL_RANK_AT")
    if not target or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, at = (int(x) for x in target.split(":"))
    if iteration == at and (dist.get_rank() if dist.is_initialized() else 0) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


def _module_buffers(chunk):
    """nn.Module's buffers (DDP's `buffers` attribute is its list of grad buffers)."""
    return torch.nn.Module.buffers(chunk)


def _local_grads(model_chunks) -> list:
    """This rank's gradients: DDP's main grads, or the local shards of FSDP's."""
    grads = []
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)
    return grads


@torch.no_grad()
def _corrupt_grads(model_chunks) -> None:
    """The injected fault: this try's gradients become NaN."""
    for grad in _local_grads(model_chunks):
        grad.fill_(float("nan"))


def _relative_difference(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def _what(fatal: int, soft: int, injected) -> str:
    found = [name for bit, name in ((1, "a NaN/Inf loss"), (2, "a NaN/Inf gradient norm")) if fatal & bit]
    found += [name for bit, name in ((1, "a spiky loss"), (2, "unexpectedly large gradients")) if soft & bit]
    if fatal & 4 and not found:
        found.append(f"an injected fault ({injected or 'on another rank'}, --error-injection-type)")
    return "found " + " and ".join(found)
