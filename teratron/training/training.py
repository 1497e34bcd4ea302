"""`pretrain(args)`: set up a run from validated flags and train it (Megatron's training.py).

    pretrain(parse_train_args(argv))

One iteration: zero the grad buffers, run the pipeline schedule over this step's micro-batches
(gradient accumulation; with --cuda-graph-impl local as CUDA graphs, `full_iteration_graph`),
stop (or skip the step) on a non-finite loss, step the optimizer and the LR schedule, update the
MoE routers and collect their metrics, then log, evaluate and save on their intervals. At the end
(also when --exit-interval or a signal stops the run) it logs the last partial log window,
evaluates the validation set unless that iteration just did, and the test split.
"""

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from teratron.dist_checkpointing import claim_save_dir, release_save_dir
from teratron.training.arguments import (check_interleaved_schedule, core_transformer_config_from_args,
                                         validate_args)
from teratron.training.build import (attach_model_hooks, build_model, build_optimizer, build_scheduler,
                                     set_vocab_sizes)
from teratron.training.checkpointing import (ExitSignalHandler, check_save_dir_writable,
                                             checkpoint_and_decide_exit, load_checkpoint,
                                             maybe_finalize_async_save, save_checkpoint)
from teratron.training.data import build_data_loader, build_datasets
from teratron.training.full_iteration_graph import check_cuda_graph_device, training_forward_backward_func
from teratron.training.gpt_step import LossesInFlight, forward_step, reduce_log_dicts
from teratron.training.initialize import (get_device, initialize_distributed, initialize_model_parallel,
                                          set_random_seed, shutdown)
from teratron.training.metrics import TrainingLogger
from teratron.training.microbatches import build_num_microbatches_calculator
from teratron.training.moe_step import finish_moe_step, set_moe_aux_loss_scale
from teratron.training.profiling import build_profiler
from teratron.transformer.moe import clear_aux_losses_tracker


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
class Run:
    """Everything a finished run hands to an `after_training` hook (the demo samples from it)."""
    args: object
    model: list
    tokenizer: object
    state: TrainState
    device: torch.device
    is_logging_rank: bool


def is_logging_rank() -> bool:
    """The last rank: it sits on the last pipeline stage, where the loss is known."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def pretrain(args, after_training: Optional[Callable[[Run], None]] = None) -> TrainState:
    world_size = initialize_distributed(args)
    try:
        return _pretrain(args, world_size, after_training)
    finally:
        release_save_dir()
        shutdown()


def _pretrain(args, world_size, after_training):
    from teratron.tokenizers import build_tokenizer

    validate_args(args, world_size)
    check_interleaved_schedule(args)
    check_cuda_graph_device(args)
    if args.context_parallel_size > 1:
        raise NotImplementedError("--context-parallel-size > 1 is not supported by teratron train yet; "
                                  "use 1")
    config = core_transformer_config_from_args(args)
    # The config is the authority on virtual stages (a layout sets them): the grid and the
    # model chunks follow it.
    args.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size
    if args.save:
        check_save_dir_writable(args.save)
        claim_save_dir(args.save, args.load, args.finetune, args.overwrite)
    initialize_model_parallel(args)
    set_random_seed(args.seed, args.deterministic_mode)
    device = get_device()

    tokenizer = build_tokenizer(args)
    set_vocab_sizes(args, tokenizer.vocab_size)  # padding is masked out of the loss
    model = build_model(args, config, device)
    clear_aux_losses_tracker()  # no routing statistics of an earlier model in this process
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer)
    attach_model_hooks(config, model, optimizer)
    if is_logging_rank():
        _print_model_summary(args, model)

    state = TrainState()
    if args.load:
        (state.iteration, state.consumed_train_samples,
         state.consumed_valid_samples) = load_checkpoint(model, optimizer, scheduler, args)
    train_iters, valid_iters, test_iters = _data_iterators(args, tokenizer, state, len(model))

    logger = TrainingLogger(args, is_logging_rank(), world_size, state.iteration)
    try:
        train(args, model, optimizer, scheduler, train_iters, valid_iters, logger, state, device,
              test_iters)
    finally:
        logger.close()
    if after_training is not None:
        after_training(Run(args, model, tokenizer, state, device, is_logging_rank()))
    return state


def _print_model_summary(args, model) -> None:
    params = sum(p.numel() for chunk in model for p in chunk.parameters())
    vpp = f" (x {len(model)} virtual)" if len(model) > 1 else ""
    ep = f", EP {args.expert_model_parallel_size}" if args.num_experts is not None else ""
    print(f"model: {params:,} parameters on this rank (TP {args.tensor_model_parallel_size} x "
          f"PP {args.pipeline_model_parallel_size}{vpp} x DP {args.data_parallel_size}{ep}, "
          f"{args.world_size} process(es))", flush=True)


def _data_iterators(args, tokenizer, state, chunks: int):
    """(train, valid, test) iterators, one per model chunk; train and valid resume after the
    consumed samples, test starts at its first sample (it is read once, at the end). valid and
    test are None without their data or with --eval-iters 0."""
    train_ds, valid_ds, test_ds = build_datasets(args, tokenizer)
    if train_ds is None:
        raise ValueError("no training data: --split gives the train set no share; fix --split or "
                         "pass --train-data-path")
    train_iters = [iter(build_data_loader(args, train_ds, state.consumed_train_samples))
                   for _ in range(chunks)]
    valid_iters = None
    if valid_ds is not None and args.eval_iters > 0:
        valid_iters = [iter(build_data_loader(args, valid_ds, state.consumed_valid_samples))
                       for _ in range(chunks)]
    test_iters = None
    if test_ds is not None and args.eval_iters > 0:
        test_iters = [iter(build_data_loader(args, test_ds, 0)) for _ in range(chunks)]
    return train_iters, valid_iters, test_iters


def _iterators(iterators):
    return iterators if len(iterators) > 1 else iterators[0]


def train(args, model, optimizer, scheduler, train_iters, valid_iters, logger, state, device,
          test_iters=None):
    exit_handler = ExitSignalHandler() if args.exit_signal_handler else None
    profiler = build_profiler(args, device)
    try:
        _train_loop(args, model, optimizer, scheduler, train_iters, valid_iters, test_iters, logger, state,
                    device, exit_handler, profiler)
    finally:
        if profiler is not None:  # training ended inside the profiled range
            profiler.stop(state.iteration)
        if exit_handler is not None:
            exit_handler.restore()


def _train_loop(args, model, optimizer, scheduler, train_iters, valid_iters, test_iters, logger, state,
                device, exit_handler, profiler=None):
    calculator = build_num_microbatches_calculator(args.global_batch_size, args.micro_batch_size,
                                                   args.data_parallel_size, args.rampup_batch_size)
    step_func = partial(forward_step, device=device)
    forward_backward_func = training_forward_backward_func(model)  # the schedule, or its CUDA graphs
    for chunk in model:
        chunk.train()
    if profiler is not None:
        profiler.step(state.iteration + 1)
    window = {"losses": {}, "moe": {}, "iters": 0, "samples": 0, "skipped": 0,
              "start": time.perf_counter()}
    last_saved = last_evaluated = state.iteration
    stop = False
    while state.iteration < args.train_iters and not stop:
        calculator.update(state.consumed_train_samples)
        global_batch = calculator.get_current_global_batch_size()
        losses, grad_norm, skipped, moe_metrics = train_step(
            args, model, optimizer, scheduler, step_func, _iterators(train_iters), calculator.get(),
            global_batch, state.iteration + 1, device, forward_backward_func)
        state.iteration += 1
        state.consumed_train_samples += global_batch
        if "lm loss" in losses:
            state.loss_history.append((state.iteration, losses["lm loss"]))
        if not skipped:
            for key, value in losses.items():
                window["losses"][key] = window["losses"].get(key, 0.0) + value
            _accumulate(window["moe"], moe_metrics)
        window["iters"] += 1
        window["samples"] += global_batch
        window["skipped"] += skipped
        logger.advance(state.iteration, losses.get("lm loss"))

        if state.iteration % args.log_interval == 0 or state.iteration == args.train_iters:
            _log(args, logger, window, state, optimizer, grad_norm, global_batch)
        paused = time.perf_counter()  # evaluation and saving do not count as training time
        if valid_iters and state.iteration % args.eval_interval == 0:
            evaluate_and_log(args, model, step_func, valid_iters, logger, state, device)
            last_evaluated = state.iteration
        saved, stop = checkpoint_and_decide_exit(
            state.iteration, model, optimizer, scheduler, args, state.consumed_train_samples,
            state.consumed_valid_samples, exit_handler)
        if saved:
            last_saved = state.iteration
        if profiler is not None:  # nor does starting, stopping and writing the profile
            profiler.step(state.iteration + 1)
        window["start"] += time.perf_counter() - paused

    if window["iters"]:  # stopped between logging iterations: no iteration goes unlogged
        _log(args, logger, window, state, optimizer, grad_norm, global_batch)
    if stop:
        logger.print(f"exiting after iteration {state.iteration} (--exit-interval or a signal)")
    if valid_iters and last_evaluated != state.iteration:
        evaluate_and_log(args, model, step_func, valid_iters, logger, state, device,
                         prefix="the end of training for val data")
    if test_iters:
        losses = evaluate(args, model, step_func, test_iters, device)
        logger.log_eval(state.iteration, losses, split="test", prefix="the end of training for test data")
    if args.save and last_saved != state.iteration:
        save_checkpoint(state.iteration, model, optimizer, scheduler, args,
                        state.consumed_train_samples, state.consumed_valid_samples)
    maybe_finalize_async_save(blocking=True)


def _log(args, logger, window, state, optimizer, grad_norm, global_batch):
    # No device sync: each step's host already waited for its losses (the end of its backward),
    # and a sync here would idle the GPU while the host logs and launches the next step.
    now = time.perf_counter()
    counted = max(window["iters"] - window["skipped"], 1)
    losses = {k: v / counted for k, v in window["losses"].items()}
    moe_metrics = {k: [x / counted for x in v] if isinstance(v, list) else v / counted
                   for k, v in window["moe"].items()}
    logger.log_iteration(
        state.iteration, losses, grad_norm, optimizer.param_groups[0]["lr"], now - window["start"],
        window["iters"], window["samples"], global_batch, state.consumed_train_samples,
        window["skipped"],
        loss_scale=optimizer.get_loss_scale().item() if args.fp16 else None, moe_metrics=moe_metrics,
    )
    window.update(losses={}, moe={}, iters=0, samples=0, skipped=0, start=time.perf_counter())


def _accumulate(totals: dict, metrics: dict) -> None:
    """Add a step's metrics to the window's totals (lists, such as tokens per expert, elementwise)."""
    for key, value in metrics.items():
        if key not in totals:
            totals[key] = list(value) if isinstance(value, list) else value
        elif isinstance(value, list):
            totals[key] = [a + b for a, b in zip(totals[key], value)]
        else:
            totals[key] += value


def _any_rank_non_finite(losses: dict, device) -> torch.Tensor:
    """1.0 on every rank (a device tensor, no host sync) when any rank's losses hold NaN/Inf."""
    flag = torch.zeros((), device=device)
    if losses:
        flag = (~torch.isfinite(torch.stack(list(losses.values())))).any().float()
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def train_step(args, model, optimizer, scheduler, step_func, data_iterator, num_microbatches,
               global_batch, iteration, device, forward_backward_func=None):
    """One optimizer step over `num_microbatches` micro-batches; returns (losses, grad norm,
    skipped, MoE metrics)."""
    from teratron.pipeline_parallel.microbatch_step import get_model_config

    config = get_model_config(model[0])
    set_moe_aux_loss_scale(config, num_microbatches, device)
    losses, grad_norm, skipped = _forward_backward_and_step(
        args, model, optimizer, scheduler, step_func, data_iterator, num_microbatches, global_batch,
        iteration, device, forward_backward_func)
    return losses, grad_norm, skipped, finish_moe_step(model, config, num_microbatches)


def _forward_backward_and_step(args, model, optimizer, scheduler, step_func, data_iterator,
                               num_microbatches, global_batch, iteration, device, forward_backward_func=None):
    from teratron.pipeline_parallel.schedules import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    log_dicts = (forward_backward_func or get_forward_backward_func())(
        forward_step_func=step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False,
    )
    losses = reduce_log_dicts(log_dicts, device, on_host=False)
    # The losses, and whether any rank's is NaN/Inf, leave for the host now and are waited for
    # after the optimizer step is queued: the GPU goes from the backward to the optimizer, and on
    # to the next step, without idling while the host checks and logs. With --skip-nan-steps the
    # loss decides whether to step, so the host waits for it first.
    check = args.check_for_nan_in_loss_and_grad or args.skip_nan_steps
    in_flight = LossesInFlight(losses, _any_rank_non_finite(losses, device) if check else None)
    if args.skip_nan_steps:
        losses = in_flight.get()
        if in_flight.flag:
            return losses, None, 1
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=global_batch)
    if not args.skip_nan_steps:
        losses = in_flight.get()
        if in_flight.flag:
            raise NonFiniteLossError(
                f"iteration {iteration}: the loss is NaN/Inf ({_fmt(losses)}); lower --lr, check the "
                "data, or pass --skip-nan-steps to skip such steps")
    if (args.check_for_nan_in_loss_and_grad and grad_norm is not None
            and not math.isfinite(float(grad_norm))):
        raise NonFiniteLossError(f"iteration {iteration}: the gradient norm is {float(grad_norm)}; "
                                 "lower --lr or set --clip-grad")
    return losses, grad_norm, 0 if update_successful else 1


def _fmt(losses):
    return ", ".join(f"{k} = {v}" for k, v in losses.items()) or "on another pipeline stage"


@torch.no_grad()
def evaluate(args, model, step_func, data_iters, device) -> dict:
    """Mean losses over --eval-iters full global batches of `data_iters` (forward only)."""
    from teratron.pipeline_parallel.schedules import get_forward_backward_func

    for chunk in model:
        chunk.eval()
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    log_dicts = []
    for _ in range(args.eval_iters):
        log_dicts += get_forward_backward_func()(
            forward_step_func=step_func, data_iterator=_iterators(data_iters), model=model,
            num_microbatches=num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=True,
        )
    for chunk in model:
        chunk.train()
    return reduce_log_dicts(log_dicts, device)


def evaluate_and_log(args, model, step_func, valid_iters, logger, state, device, prefix=None):
    """Evaluate the validation set; `prefix` names the moment in the log line (the iteration by
    default)."""
    losses = evaluate(args, model, step_func, valid_iters, device)
    state.consumed_valid_samples += args.eval_iters * args.global_batch_size
    if "lm loss" in losses:
        state.eval_history.append((state.iteration, losses["lm loss"]))
    logger.log_eval(state.iteration, losses, prefix=prefix)
