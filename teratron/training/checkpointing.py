"""Training checkpoints: Megatron's folder layout, written as sharded checkpoints
(`teratron.dist_checkpointing`) that load into any parallel layout.

    SAVE/latest_checkpointed_iteration.txt      the last complete iteration (written last)
    SAVE/iter_0000100/                          torch.distributed.checkpoint files, metadata.json
                                                (format version, model args, layout), common.pt

A checkpoint holds the model, the optimizer (states, fp32 masters, param groups, loss scaler)
and scheduler, every rank's RNG states, the iteration, the consumed train/valid samples (the data
loaders resume after them) and the args. With an unchanged layout and `--deterministic` a resumed
CPU run continues the same loss curve bit for bit; with another TP/PP/VPP/DP/EP layout, or with
or without the distributed optimizer, the model and optimizer load exactly and the RNG streams
start fresh.

Saving writes into a hidden temporary folder that is renamed once every rank has finished, and
only then names it in the tracker: an interrupted save never looks complete. `--async-save`
snapshots the state and writes it on a background thread; the save is published by a later
`maybe_finalize_async_save` (every iteration, before the next save and at the end).
`--exit-signal-handler` turns SIGTERM into "save and stop after this iteration" (no evaluation
first: the scheduler's grace period is for the save); `--exit-interval N` stops (after saving) at
iterations divisible by N. Every published save logs "saved checkpoint at iteration N"; after
Ctrl+C, `resume_hint` names the checkpoint to resume from.
"""

import os
import shutil
import signal
import tempfile
from datetime import timedelta

import torch.distributed as dist

from teratron import dist_checkpointing
from teratron.dist_checkpointing import storage
from teratron.dist_checkpointing.checkpoint import all_ranks_true
from teratron.dist_checkpointing.megatron_format import (TERATRON_RECORD, is_megatron_checkpoint,
                                                         load_megatron_checkpoint)
from teratron.dist_checkpointing.megatron_format import read_common_state as read_megatron_common_state
from teratron.dist_checkpointing.model_args import GDP_DEFAULTS, model_args_from_config
from teratron.training.arguments import flag_values
from teratron.training.telemetry import NO_TELEMETRY

# Model args that may differ between the saving and the loading run: the padded vocabulary follows
# the TP size (the loader pads or trims the padding rows), and only a learned position table has a
# shape (which the loader checks). The vocabulary itself is the tokenizer's: `_check_tokenizer`.
_MAY_DIFFER = ("vocab_size", "padded_vocab_size", "max_position_embeddings")


def check_save_dir_writable(save: str) -> None:
    """Fail before training when --save cannot be created or written; creates nothing."""
    path = os.path.abspath(save)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--save {save}: exists and is not a directory; pass a directory path")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--save {save}: {existing} is not a directory, so the folder cannot be "
                         "created; pass a directory path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".teratron-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"--save {save}: cannot write in {existing} ({e.strerror}); "
                              "choose a writable directory") from None


def _print_on_rank_0(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def resume_hint(save) -> str:
    """One line for an interrupted run: the checkpoint to resume from (--save's latest complete
    one), or that there is none."""
    if not save:
        return "no checkpoint was saved (no --save)"
    try:
        iteration = storage.read_tracker(save)
    except (ValueError, OSError) as e:
        return f"the checkpoint to resume from is unclear: {e}"
    if iteration is None:
        return f"no checkpoint was saved in --save {save}"
    return f"resume from iteration {iteration} with --load {save}"


def read_tracker(load: str):
    """The iteration named by load's tracker file, or None when there is no tracker."""
    try:
        return storage.read_tracker(load)
    except ValueError as e:
        raise ValueError(f"--load {load}: {e}") from None


class Checkpointer:
    """Saves and loads a run's checkpoints under its CheckpointConfig; owns the --async-save in
    flight (published by `finalize_async_save`: every iteration, before the next save and at the
    end)."""

    def __init__(self, run, tokenizer=None, log=None, telemetry=NO_TELEMETRY):
        self.run = run
        self.telemetry = telemetry  # a "checkpoint" span per save
        self.config = run.checkpoint
        self.tokenizer = tokenizer  # recorded with every save, checked at load
        self.log = log or _print_on_rank_0  # the "saved checkpoint at iteration N" lines
        self._pending_save = None

    def finalize_async_save(self, blocking: bool = False) -> None:
        """Publish the background save once every rank has written it (a collective when one is
        in flight); with `blocking`, wait for it."""
        if self._pending_save is not None and self._pending_save.finalize(blocking):
            self.log(f"saved checkpoint at iteration {self._pending_save.iteration} to {self.config.save}")
            self._pending_save = None

    def save(self, iteration, model, optimizer, opt_param_scheduler, consumed_samples,
             consumed_valid_samples=0) -> str:
        """Write iteration `iteration`'s checkpoint under --save (a collective); returns its folder
        (published now, or by finalize_async_save with --async-save)."""
        with self.telemetry.span("checkpoint", iteration=iteration):
            c = self.config
            self.finalize_async_save(blocking=True)
            common = {"args": self.run.to_dict(), "iteration": iteration,
                      "consumed_train_samples": consumed_samples, "consumed_valid_samples": consumed_valid_samples}
            if not c.no_save_optim:
                common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
            save = dict(root=c.save, iteration=iteration, model_chunks=model,
                        optimizer=None if c.no_save_optim else optimizer, common=common,
                        metadata=self._model_record(), with_rng=not c.no_save_rng, ckpt_format=c.ckpt_format)
            self._copy_hf_files()
            if c.async_save:
                timeout = timedelta(minutes=self.run.distributed.distributed_timeout_minutes)
                self._pending_save = dist_checkpointing.start_async_save(**save, timeout=timeout)
                return storage.iteration_dir(c.save, iteration)
            folder = dist_checkpointing.save_checkpoint(**save)
            self.log(f"saved checkpoint at iteration {iteration} to {c.save}")
            return folder

    def _copy_hf_files(self) -> None:
        """Keep the Hugging Face config/tokenizer files of an imported checkpoint with its descendants."""
        c = self.config
        if not c.load or dist.is_initialized() and dist.get_rank() != 0:
            return
        src, dst = os.path.join(c.load, storage.HF_DIRNAME), os.path.join(c.save, storage.HF_DIRNAME)
        if os.path.isdir(src) and not os.path.exists(dst) and os.path.abspath(src) != os.path.abspath(dst):
            shutil.copytree(src, dst)

    def load(self, model, optimizer, opt_param_scheduler):
        """Restore --load's latest checkpoint into model/optimizer/scheduler and the RNGs.

        Returns (iteration, consumed_train_samples, consumed_valid_samples); (0, 0, 0) when
        --load holds no checkpoint yet (a fresh run that saves to the same folder), or with
        --finetune.
        """
        c = self.config
        iteration = read_tracker(c.load)
        if iteration is None:
            if c.exit_on_missing_checkpoint:
                raise FileNotFoundError(f"--load {c.load}: no checkpoint ({storage.TRACKER_FILENAME} is missing) "
                                        "and --exit-on-missing-checkpoint is set; pass a checkpoint folder or drop "
                                        "the flag to start from scratch")
            print(f"WARNING: no {storage.TRACKER_FILENAME} in --load {c.load}; starting from scratch",
                  flush=True)
            return 0, 0, 0
        checkpoint_dir = storage.iteration_dir(c.load, iteration)
        if not os.path.isdir(checkpoint_dir):
            raise FileNotFoundError(f"--load {c.load}: the tracker names iteration {iteration} but "
                                    f"{checkpoint_dir} is missing; fix the tracker or restore the folder")
        if is_megatron_checkpoint(checkpoint_dir):
            return self._load_megatron(checkpoint_dir, model, optimizer, opt_param_scheduler)
        record = storage.read_metadata(checkpoint_dir)
        self._check_model_args(record.get("model_args", {}), checkpoint_dir)
        self._check_tokenizer(record, checkpoint_dir)
        load_optimizer = not (c.finetune or c.no_load_optim)
        fresh_mtp = self._adds_mtp_layers(record.get("model_args", {}), checkpoint_dir, load_optimizer)
        metadata, common = dist_checkpointing.load_checkpoint(
            checkpoint_dir, model, optimizer, load_optimizer=load_optimizer,
            load_rng=not (c.finetune or c.no_load_rng),
            fresh=(lambda key: key.startswith("mtp.")) if fresh_mtp else None)
        if c.finetune:
            return 0, 0, 0
        if load_optimizer:
            try:
                opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
            except ValueError as e:
                raise ValueError(f"--load {checkpoint_dir}: {e}") from None
        return (common.get("iteration", metadata["iteration"]), common.get("consumed_train_samples", 0),
                common.get("consumed_valid_samples", 0))

    def _load_megatron(self, checkpoint_dir: str, model, optimizer, opt_param_scheduler) -> tuple:
        """A torch_dist checkpoint (Megatron-LM's layout, written by Megatron-LM or by teratron's
        --ckpt-format torch_dist): the model and, when teratron wrote it, the optimizer and the
        scheduler; RNG states start fresh (none are written in that layout). Training continues
        at its iteration and consumed samples, or starts at 0 with --finetune."""
        c = self.config
        common = read_megatron_common_state(checkpoint_dir)
        record = common.get(TERATRON_RECORD)
        if record is not None:  # teratron wrote it: the same checks as for its own layout
            self._check_model_args(record.get("model_args", {}), checkpoint_dir)
            self._check_tokenizer(record, checkpoint_dir)
        load_optimizer = not (c.finetune or c.no_load_optim)
        common = load_megatron_checkpoint(checkpoint_dir, model, self.run.transformer.num_layers,
                                          optimizer if load_optimizer else None, common=common)
        if not dist.is_initialized() or dist.get_rank() == 0:
            fresh = "RNG states start" if load_optimizer else "optimizer and RNG states start"
            print(f"NOTE: loaded torch_dist (Megatron-LM layout) checkpoint {checkpoint_dir}; {fresh} fresh", flush=True)
        if c.finetune:
            return 0, 0, 0
        if load_optimizer and "opt_param_scheduler" in common:
            try:
                opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
            except ValueError as e:
                raise ValueError(f"--load {checkpoint_dir}: {e}") from None
        args = common.get("args")
        return (int(common.get("iteration", 0)),
                int(common.get("consumed_train_samples", getattr(args, "consumed_train_samples", 0))),
                int(common.get("consumed_valid_samples", getattr(args, "consumed_valid_samples", 0))))

    def _check_model_args(self, saved: dict, checkpoint_dir: str) -> None:
        """Refuse a checkpoint of another model, naming each flag that differs and both values (an older
        record without the hybrid M layers' kind has Mamba-2's)."""
        current = model_args_from_config(self.run.model)
        saved = {**GDP_DEFAULTS, **saved} if saved else saved
        differ = [flag_values(k, ("saved", saved[k]), ("now", current[k])) for k in current
                  if k in saved and k not in _MAY_DIFFER and saved[k] != current[k]
                  and not (k == "mtp_num_layers" and saved[k] is None)]  # MTP added: `_adds_mtp_layers`
        if differ:
            raise ValueError(f"--load {checkpoint_dir}: the checkpoint holds another model: {'; '.join(differ)}; "
                             "pass the architecture flags it was saved with, or --use-checkpoint-args to take them "
                             "from it")

    def _adds_mtp_layers(self, saved: dict, checkpoint_dir: str, load_optimizer: bool) -> bool:
        """Whether this run adds MTP layers to a checkpoint saved without them (MTP-only training
        of a pretrained model): they start from their initialisation, with a fresh optimizer."""
        if not self.run.transformer.mtp_num_layers or saved.get("mtp_num_layers"):
            return False
        if load_optimizer:
            raise ValueError(f"--load {checkpoint_dir}: the checkpoint has no MTP layers; add --finetune or "
                             "--no-load-optim to start them (and the optimizer) fresh")
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"NOTE: {checkpoint_dir} has no MTP layers; --mtp-num-layers "
                  f"{self.run.transformer.mtp_num_layers} starts them from their initialisation", flush=True)
        return True

    def _model_record(self) -> dict:
        record = {"model_args": model_args_from_config(self.run.model)}
        if self.tokenizer is not None:
            record["tokenizer"] = self.tokenizer.fingerprint()
        return record

    def _check_tokenizer(self, record: dict, checkpoint_dir: str) -> None:
        """The vocabulary is part of the model: another tokenizer or vocabulary size is refused
        unless --allow-tokenizer-change asks for it (then the embedding and output rows are padded
        with new rows or trimmed, and the log says so)."""
        saved_vocab = record.get("model_args", {}).get("vocab_size")
        saved_tokenizer = record.get("tokenizer")
        now = self.tokenizer.fingerprint() if self.tokenizer is not None else None
        changes = []
        if saved_vocab is not None and saved_vocab != self.run.model.vocab_size:
            changes.append(f"its vocabulary has {saved_vocab} ids, this run's {self.run.model.vocab_size}")
        if saved_tokenizer and now and (saved_tokenizer["class"], saved_tokenizer["sha256"]) != (
                now["class"], now["sha256"]):
            changes.append(f"it was trained with another tokenizer ({saved_tokenizer['class']}, "
                           f"{saved_tokenizer['vocab_size']} ids; now {now['class']}, {now['vocab_size']} ids)")
        if not changes:
            return
        if not self.config.allow_tokenizer_change:
            raise ValueError(f"--load {checkpoint_dir}: {'; '.join(changes)}; pass the tokenizer flags it was "
                             "trained with, or --allow-tokenizer-change to pad or trim the embedding rows")
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"NOTE: --allow-tokenizer-change: {'; '.join(changes)}; the embedding and output rows are "
                  "resized to this run's vocabulary (new rows start from the initialisation)", flush=True)

    def after_iteration(self, iteration, model, optimizer, opt_param_scheduler, consumed_samples,
                        consumed_valid_samples, exit_requested=False):
        """Save on --save-interval, publish a finished async save, and decide whether to stop
        (`exit_requested`: SIGTERM under --exit-signal-handler, or --exit-interval), saving first.
        Returns (saved, stop)."""
        c, exit_interval = self.config, self.run.training.exit_interval
        self.finalize_async_save(blocking=False)
        saved = False

        def save():
            self.save(iteration, model, optimizer, opt_param_scheduler, consumed_samples, consumed_valid_samples)
            return True

        if c.save and c.save_interval and iteration % c.save_interval == 0:
            saved = save()
        stop = bool(exit_interval and iteration % exit_interval == 0)
        stop = exit_requested or stop
        if stop:
            if c.save and not saved:
                saved = save()
            self.finalize_async_save(blocking=True)
        return saved, stop


class ExitSignalHandler:
    """Records SIGTERM (Megatron's --exit-signal-handler) instead of dying, so the run can save
    and stop at the end of the iteration."""

    def __init__(self, signum=signal.SIGTERM):
        self.received = False
        self.previous = signal.signal(signum, self._handle)
        self.signum = signum

    def _handle(self, signum, frame):
        self.received = True

    def any_rank_received(self) -> bool:
        """A collective: True on every rank when any rank got the signal."""
        return not all_ranks_true(not self.received)

    def restore(self) -> None:
        signal.signal(self.signum, self.previous)
