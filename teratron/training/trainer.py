"""The Trainer: owns a run's model chunks, optimizer, scheduler, data, logger, checkpointer,
profiler and exit handling; `train()` runs it.

    trainer = Trainer(run, tokenizer)      # builds everything, resumes from --load
    state = trainer.train()

One iteration (`step`): zero the grad buffers, run the pipeline schedule over this step's
micro-batches (gradient accumulation; with --cuda-graph-impl local as CUDA graphs,
`full_iteration_graph`), again if the rerun state machine rejects the results (`rerun`), reduce
the max attention logits (QK-clip, which clips inside the optimizer step), stop (or skip the
step) on a non-finite loss, step the optimizer and
the LR schedule, update the MoE routers and collect their metrics. `train` then logs, evaluates
and saves on their intervals. At the end (also when --exit-interval stops the run) it logs the
last partial log window, evaluates the validation set unless that iteration just did, and the
test split. A SIGTERM under --exit-signal-handler skips every evaluation from the iteration it
arrives in: the run logs, saves and stops, within the scheduler's grace period.
"""

import math
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from teratron.dist_checkpointing import claim_save_dir
from teratron.pipeline_parallel.schedules import get_forward_backward_func
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.topology import current_topology
from teratron.training.build import attach_model_hooks, build_model, build_optimizer, build_qk_clip, build_scheduler
from teratron.training.checkpointing import Checkpointer, ExitSignalHandler, check_save_dir_writable
from teratron.training.config_logger import write_run_config
from teratron.training.config import RunConfig, check_interleaved_schedule
from teratron.training.data import build_data_loader, build_datasets, build_packed_batches
from teratron.training.full_iteration_graph import training_forward_backward_func
from teratron.training.gpt_step import LossesInFlight, forward_step, reduce_log_dicts
from teratron.training.initialize import get_device, set_random_seed
from teratron.training.metrics import TrainingLogger
from teratron.training.moe_step import finish_moe_step, set_moe_aux_loss_scale
from teratron.training.profiling import build_profiler
from teratron.training.rerun import RerunStateMachine, ReproducibleFaultError, kill_rank_for_test
from teratron.training.straggler import StragglerReport
from teratron.training.telemetry import build_telemetry
from teratron.training.watchdog import Watchdog, peer_store
from teratron.transformer.moe import clear_aux_losses_tracker
from teratron.utils import HostCopy


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN/Inf and the run was told to stop on it."""


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    loss_history: list = field(default_factory=list)  # (iteration, lm loss), logging rank only
    eval_history: list = field(default_factory=list)  # (iteration, validation lm loss)


@dataclass
class StepResult:
    losses: dict           # name -> mean over the step's micro-batches (host floats)
    grad_norm: object      # None when the step was skipped or on a rank without it
    skipped: int           # 1 when the optimizer step was skipped
    moe_metrics: dict
    max_attention_logit: float | None = None  # with qk_clip / log_max_attention_logit


@dataclass
class LogWindow:
    """Totals of the iterations since the last log line."""
    start: float = field(default_factory=time.perf_counter)
    iters: int = 0
    samples: int = 0
    skipped: int = 0
    losses: dict = field(default_factory=dict)
    moe: dict = field(default_factory=dict)
    max_attention_logit: float | None = None  # the largest of the window's steps

    def add(self, result: StepResult, global_batch: int) -> None:
        logit, largest = result.max_attention_logit, self.max_attention_logit
        if logit is not None:
            self.max_attention_logit = logit if largest is None else max(largest, logit)
        if not result.skipped:
            for key, value in result.losses.items():
                self.losses[key] = self.losses.get(key, 0.0) + value
            _accumulate(self.moe, result.moe_metrics)
        self.iters += 1
        self.samples += global_batch
        self.skipped += result.skipped

    def means(self):
        """(losses, MoE metrics) averaged over the iterations that stepped."""
        counted = max(self.iters - self.skipped, 1)
        losses = {k: v / counted for k, v in self.losses.items()}
        moe = {k: [x / counted for x in v] if isinstance(v, list) else v / counted for k, v in self.moe.items()}
        return losses, moe


def _accumulate(totals: dict, metrics: dict) -> None:
    """Add a step's metrics to the window's totals (lists, such as tokens per expert, elementwise)."""
    for key, value in metrics.items():
        if key not in totals:
            totals[key] = list(value) if isinstance(value, list) else value
        elif isinstance(value, list):
            totals[key] = [a + b for a, b in zip(totals[key], value)]
        else:
            totals[key] += value


def is_logging_rank() -> bool:
    """The last rank: it sits on the last pipeline stage, where the loss is known."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


class Trainer:
    def __init__(self, run: RunConfig, tokenizer):
        check_interleaved_schedule(run)
        if run.checkpoint.save:
            check_save_dir_writable(run.checkpoint.save)
            c = run.checkpoint
            claim_save_dir(c.save, c.load, c.finetune, c.overwrite)
        self.run = run
        self.tokenizer = tokenizer
        self.logger = None  # the TrainingLogger, made by train()
        self.last_saved = None  # the iteration last saved (or loaded), set by train()
        self.watchdog = self.straggler = None  # --watchdog-timeout, --log-straggler: made by train()
        self.device = get_device()
        self.pg_collection = current_topology().pg_collection()  # passed to everything built below
        set_random_seed(run.training.seed, run.training.deterministic_mode)
        self.telemetry = build_telemetry(run.logging, dist.get_rank() if dist.is_initialized() else 0)

        with self.telemetry.span("model_init"):
            self.model = build_model(run, self.device, self.pg_collection)
            clear_aux_losses_tracker()  # no routing statistics of an earlier model in this process
            self.optimizer = build_optimizer(run, self.model, self.pg_collection)
            self.scheduler = build_scheduler(run, self.optimizer)
            attach_model_hooks(self.model, self.optimizer, self.pg_collection)
            self.qk_clip = build_qk_clip(self.model, self.optimizer, self.pg_collection)
        self.config = self.model[0].config  # the model's TransformerConfig, with the schedule's callbacks
        if is_logging_rank():
            self._print_model_summary()

        self.checkpointer = Checkpointer(run, tokenizer, log=self._print, telemetry=self.telemetry)
        self.state = TrainState()
        if run.checkpoint.load:
            with self.telemetry.span("load_checkpoint"):
                (self.state.iteration, self.state.consumed_train_samples,
                 self.state.consumed_valid_samples) = self.checkpointer.load(self.model, self.optimizer,
                                                                             self.scheduler)
            if self.state.iteration:
                self._print(f"resumed from iteration {self.state.iteration} of --load {run.checkpoint.load}")
        if run.transformer.config_logger_dir and (not dist.is_initialized() or dist.get_rank() == 0):
            write_run_config(run, run.transformer.config_logger_dir, self.state.iteration)
        self.train_iters, self.valid_iters, self.test_iters = self._data_iterators()
        self.rerun = RerunStateMachine(run.training, self.model, self.train_iters, self.device)
        self.train_iters = self.rerun.iterators  # they keep each step's micro-batches for a re-run
        self.step_func = partial(forward_step, device=self.device, pg_collection=self.pg_collection,
                                 telemetry=self.telemetry)
        self.microbatches = run.microbatches()

    def _print(self, line: str) -> None:
        """A line on the logging rank (through the logger's progress bar once training runs)."""
        if self.logger is not None:
            self.logger.print(line)
        elif is_logging_rank():
            print(line, flush=True)

    def _print_model_summary(self) -> None:
        t, run = self.run.transformer, self.run
        params = sum(p.numel() for chunk in self.model for p in chunk.parameters())
        vpp = f" (x {len(self.model)} virtual)" if len(self.model) > 1 else ""
        ep = f", EP {t.expert_model_parallel_size}" if t.num_moe_experts is not None else ""
        cp = f" x CP {t.context_parallel_size}" if t.context_parallel_size > 1 else ""
        print(f"model: {params:,} parameters on this rank (TP {t.tensor_model_parallel_size} x "
              f"PP {t.pipeline_model_parallel_size}{vpp}{cp} x DP {run.distributed.data_parallel_size}{ep}, "
              f"{run.distributed.world_size} process(es))", flush=True)

    def _data_iterators(self):
        """(train, valid, test) iterators, one per model chunk; train and valid resume after the
        consumed samples, test starts at its first sample (it is read once, at the end). valid and
        test are None without their data or with --eval-iters 0."""
        train_ds, valid_ds, test_ds = build_datasets(self.run, self.tokenizer)
        if train_ds is None:
            raise ValueError("no training data: --split gives the train set no share; fix --split or "
                             "pass --train-data-path")
        dp = (get_pg_rank(self.pg_collection.dp), get_pg_size(self.pg_collection.dp))

        def iterators(dataset, consumed):
            if self.run.data.sequence_packing:
                return [build_packed_batches(self.run, dataset, consumed, *dp, self.tokenizer) for _ in self.model]
            return [iter(build_data_loader(self.run, dataset, consumed, *dp)) for _ in self.model]

        evaluated = self.run.training.eval_iters > 0
        return (iterators(train_ds, self.state.consumed_train_samples),
                iterators(valid_ds, self.state.consumed_valid_samples) if valid_ds is not None and evaluated
                else None,
                iterators(test_ds, 0) if test_ds is not None and evaluated else None)

    # ----- the loop -----

    def train(self) -> TrainState:
        run, state = self.run, self.state
        self.logger = TrainingLogger(run, is_logging_rank(), state.iteration)
        exit_handler = ExitSignalHandler() if run.training.exit_signal_handler else None
        profiler = build_profiler(run.profiling, self.device)
        if run.logging.log_straggler:
            self.straggler = StragglerReport(self.config, self.device, run.logging.straggler_minmax_count)
        if run.training.watchdog_timeout:
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            self.watchdog = Watchdog(run.training.watchdog_timeout, rank, world, peer_store())
        try:
            with self.telemetry.span("job"):
                self._train_loop(exit_handler, profiler)
        finally:
            self.telemetry.close()
            if self.watchdog is not None:
                self.watchdog.close()
            if profiler is not None:  # training ended inside the profiled range
                profiler.stop(state.iteration)
            if exit_handler is not None:
                exit_handler.restore()
            self.logger.close()
        return state

    def _train_loop(self, exit_handler, profiler):
        run, state, training = self.run, self.state, self.run.training
        # the schedule, or its CUDA graphs
        forward_backward_func = self.telemetry.wrap("forward_backward", training_forward_backward_func(self.model))
        for chunk in self.model:
            chunk.train()
        if profiler is not None:
            profiler.step(state.iteration + 1)
        window = LogWindow()
        self.last_saved = last_evaluated = state.iteration  # at start: loaded, or nothing worth saving
        stop = signalled = False
        result, global_batch = None, training.global_batch_size
        while state.iteration < training.train_iters and not stop:
            self.microbatches.update(state.consumed_train_samples)
            global_batch = self.microbatches.get_current_global_batch_size()
            result = self._watched_step(global_batch, forward_backward_func, first=result is None)
            state.iteration += 1
            state.consumed_train_samples += global_batch
            if "lm loss" in result.losses:
                state.loss_history.append((state.iteration, result.losses["lm loss"]))
            window.add(result, global_batch)
            self.logger.advance(state.iteration, result.losses.get("lm loss"))

            if state.iteration % run.logging.log_interval == 0 or state.iteration == training.train_iters:
                window = self.log(window, result.grad_norm, global_batch)
            kill_rank_for_test(state.iteration)
            paused = time.perf_counter()  # evaluation and saving do not count as training time
            signalled = exit_handler is not None and exit_handler.any_rank_received()
            if self.valid_iters and state.iteration % training.eval_interval == 0 and not signalled:
                self.evaluate_and_log()
                last_evaluated = state.iteration
            saved, stop = self.checkpointer.after_iteration(
                state.iteration, self.model, self.optimizer, self.scheduler, state.consumed_train_samples,
                state.consumed_valid_samples, signalled)
            if saved:
                self.last_saved = state.iteration
            if profiler is not None:  # nor does starting, stopping and writing the profile
                profiler.step(state.iteration + 1)
            window.start += time.perf_counter() - paused

        if window.iters:  # stopped between logging iterations: no iteration goes unlogged
            self.log(window, result.grad_norm, global_batch)
        if signalled:
            self.logger.print(f"exiting after iteration {state.iteration}: SIGTERM (--exit-signal-handler), "
                              "no evaluation")
        elif stop:
            self.logger.print(f"exiting after iteration {state.iteration} (--exit-interval)")
        if self.valid_iters and last_evaluated != state.iteration and not signalled:
            self.evaluate_and_log(prefix="the end of training for val data")
        if self.test_iters and not signalled:
            losses = self.evaluate(self.test_iters)
            self.logger.log_eval(state.iteration, losses, split="test", prefix="the end of training for test data")
        if run.checkpoint.save and self.last_saved != state.iteration:
            self.save()
        self.checkpointer.finalize_async_save(blocking=True)

    def _watched_step(self, global_batch: int, forward_backward_func, first: bool) -> StepResult:
        """`step` under the hang watchdog (not this process's first step: compilation and warm-up)
        and the straggler report's clock."""
        if self.watchdog is not None and not first:
            self.watchdog.step_started(self.state.iteration + 1)
        if self.straggler is not None:
            self.straggler.step_started()
        try:
            with self.telemetry.span("step", iteration=self.state.iteration + 1):
                result = self.step(self._num_microbatches(self.train_iters), global_batch, forward_backward_func)
        except ReproducibleFaultError as e:
            raise ReproducibleFaultError(f"{e}; {self._save_for_diagnosis()}") from None
        if self.straggler is not None:
            self.straggler.step_ended()
        if self.watchdog is not None:
            self.watchdog.step_ended()
        return result

    def _save_for_diagnosis(self) -> str:
        """After a reproduced fault: save the weights before the step (if not saved), say where."""
        if not self.run.checkpoint.save:
            return "no --save, nothing saved; exiting with code 16"
        if self.last_saved != self.state.iteration:
            self.save()
        self.checkpointer.finalize_async_save(blocking=True)
        return (f"checkpoint of iteration {self.state.iteration} in {self.run.checkpoint.save}: resume from it on "
                "other hardware to tell which; exiting with code 16")

    def save(self) -> str:
        s = self.state
        return self.checkpointer.save(s.iteration, self.model, self.optimizer, self.scheduler,
                                      s.consumed_train_samples, s.consumed_valid_samples)

    def log(self, window: LogWindow, grad_norm, global_batch: int) -> LogWindow:
        """Log the window's iterations; returns the next, empty window."""
        # No device sync: each step's host already waited for its losses (the end of its backward),
        # and a sync here would idle the GPU while the host logs and launches the next step.
        losses, moe_metrics = window.means()
        record = self.logger.log_iteration(
            self.state.iteration, losses, grad_norm, self.optimizer.param_groups[0]["lr"],
            time.perf_counter() - window.start, window.iters, window.samples, global_batch,
            self.state.consumed_train_samples, window.skipped,
            loss_scale=self.optimizer.get_loss_scale().item() if self.run.optimizer.fp16 else None,
            moe_metrics=moe_metrics, max_attention_logit=window.max_attention_logit,
        )
        if is_logging_rank():  # where the loss is known
            self.telemetry.record_iteration(record)
        if self.straggler is not None:  # a collective: every rank logs at the same iterations
            self.logger.print(self.straggler.line(self.straggler.gather()))
        return LogWindow()

    # ----- one step -----

    def step(self, num_microbatches: int, global_batch: int, forward_backward_func=None) -> StepResult:
        """One optimizer step over `num_microbatches` micro-batches."""
        set_moe_aux_loss_scale(self.config, num_microbatches, self.device, self.pg_collection)
        losses, grad_norm, skipped, max_logit = self._forward_backward_and_step(num_microbatches, global_batch,
                                                                                forward_backward_func)
        return StepResult(losses, grad_norm, skipped,
                          finish_moe_step(self.model, self.config, num_microbatches, self.pg_collection),
                          None if max_logit is None else max_logit.get())

    def _forward_backward_and_step(self, num_microbatches, global_batch, forward_backward_func=None):
        training, iteration = self.run.training, self.state.iteration + 1
        losses = self.rerun.run_step(iteration, partial(self._forward_backward, num_microbatches,
                                                        forward_backward_func), log=self._print)
        # The step's max attention logits, reduced before the optimizer step clips by them.
        max_logit = HostCopy(self.qk_clip.reduce()) if self.qk_clip is not None else None
        # The losses, and whether any rank's is NaN/Inf, leave for the host now and are waited for
        # after the optimizer step is queued: the GPU goes from the backward to the optimizer, and on
        # to the next step, without idling while the host checks and logs (with the rerun state
        # machine's checks on, it has waited for them already). With --skip-nan-steps the loss
        # decides whether to step, so the host waits for it first.
        check = training.check_for_nan_in_loss_and_grad or training.skip_nan_steps
        in_flight = LossesInFlight(losses, _any_rank_non_finite(losses, self.device) if check else None)
        if training.skip_nan_steps:
            losses = in_flight.get()
            if in_flight.flag:
                return losses, None, 1, max_logit
        with self.telemetry.span("optimizer"):
            update_successful, grad_norm, _ = self.optimizer.step()  # ends by launching the param gathers
        if update_successful:
            self.scheduler.step(increment=global_batch)
        if not training.skip_nan_steps:
            losses = in_flight.get()
            if in_flight.flag:
                raise NonFiniteLossError(
                    f"iteration {iteration}: the loss is NaN/Inf ({_fmt(losses)}); lower --lr, check the "
                    "data, or pass --skip-nan-steps to skip such steps")
        if (training.check_for_nan_in_loss_and_grad and grad_norm is not None
                and not math.isfinite(float(grad_norm))):
            raise NonFiniteLossError(f"iteration {iteration}: the gradient norm is {float(grad_norm)}; "
                                     "lower --lr or set --clip-grad")
        return losses, grad_norm, 0 if update_successful else 1, max_logit

    def _forward_backward(self, num_microbatches, forward_backward_func=None) -> dict:
        """Zero the grads, run the step's micro-batches; the reduced losses (device tensors)."""
        training = self.run.training
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        log_dicts = (forward_backward_func or get_forward_backward_func())(
            forward_step_func=self.step_func, data_iterator=_iterators(self.train_iters), model=self.model,
            num_microbatches=num_microbatches, seq_length=training.seq_length,
            micro_batch_size=training.micro_batch_size, forward_only=False, pg_collection=self.pg_collection,
        )
        return reduce_log_dicts(log_dicts, self.device, on_host=False, pg_collection=self.pg_collection)

    def _num_microbatches(self, data_iters) -> int:
        """This step's micro-batches per rank: the calculator's (for the training iterators), or with
        --sequence-packing the rows of the packed step (each model chunk's iterator prepares it)."""
        if self.run.data.sequence_packing:
            counts = {iterator.next_step() for iterator in data_iters}
            assert len(counts) == 1, counts  # every chunk packs the same samples
            return counts.pop()
        if data_iters is self.train_iters:
            return self.microbatches.get()
        training = self.run.training
        return training.global_batch_size // (training.micro_batch_size * self.run.distributed.data_parallel_size)

    # ----- evaluation -----

    @torch.no_grad()
    def evaluate(self, data_iters) -> dict:
        """Mean losses over --eval-iters full global batches of `data_iters` (forward only)."""
        training = self.run.training
        for chunk in self.model:
            chunk.eval()
        log_dicts = []
        with self.telemetry.span("evaluate", iteration=self.state.iteration):
            for _ in range(training.eval_iters):
                log_dicts += get_forward_backward_func()(
                    forward_step_func=self.step_func, data_iterator=_iterators(data_iters), model=self.model,
                    num_microbatches=self._num_microbatches(data_iters), seq_length=training.seq_length,
                    micro_batch_size=training.micro_batch_size, forward_only=True,
                    pg_collection=self.pg_collection)
        for chunk in self.model:
            chunk.train()
        return reduce_log_dicts(log_dicts, self.device, pg_collection=self.pg_collection)

    def evaluate_and_log(self, prefix=None) -> None:
        """Evaluate the validation set; `prefix` names the moment in the log line (the iteration by
        default)."""
        losses = self.evaluate(self.valid_iters)
        self.state.consumed_valid_samples += self.run.training.eval_iters * self.run.training.global_batch_size
        if "lm loss" in losses:
            self.state.eval_history.append((self.state.iteration, losses["lm loss"]))
        self.logger.log_eval(self.state.iteration, losses, prefix=prefix)


def _iterators(iterators):
    return iterators if len(iterators) > 1 else iterators[0]


def _any_rank_non_finite(losses: dict, device) -> torch.Tensor:
    """1.0 on every rank (a device tensor, no host sync) when any rank's losses hold NaN/Inf."""
    flag = torch.zeros((), device=device)
    if losses:
        flag = (~torch.isfinite(torch.stack(list(losses.values())))).any().float()
    if dist.is_initialized():  # every rank: the stages without a loss learn it too
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def _fmt(losses):
    return ", ".join(f"{k} = {v}" for k, v in losses.items()) or "on another pipeline stage"
