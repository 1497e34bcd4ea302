"""Model, optimizer and LR scheduler of a run, built from its `RunConfig` (Megatron's
`setup_model_and_optimizer`)."""

import copy
import dataclasses
from functools import partial

import torch

from teratron.distributed import DistributedDataParallel, FullyShardedDataParallel, finalize_model_grads
from teratron.models.gpt.builder import build_model_chunks
from teratron.optimizer import get_megatron_optimizer
from teratron.optimizer.qk_clip import QKClip
from teratron.optimizer_param_scheduler import OptimizerParamScheduler
from teratron.tensor_parallel import model_parallel_cuda_manual_seed


def build_model(run, device, pg_collection=None) -> list:
    """This rank's model chunks (one per virtual stage), on `device`, each wrapped in DDP (or
    sharded by FSDP, `--use-torch-fsdp2` / `--use-megatron-fsdp`).

    The chunks share a copy of the run's TransformerConfig, on which the Trainer sets the
    schedule's callbacks (Megatron's plumbing); the run description itself stays unchanged.
    The seed is set right before building: initialisation is layout-invariant (every component
    draws from a stream derived from it), so any TP/PP layout starts from the same full model.
    """
    model_config = dataclasses.replace(run.model, transformer=copy.copy(run.transformer))
    torch.manual_seed(run.training.seed)
    chunks = build_model_chunks(model_config, pg_collection)
    if not run.transformer.init_model_with_meta_device:  # else FSDP allocates the shards on the device
        chunks = [chunk.to(device) for chunk in chunks]
    model_parallel_cuda_manual_seed(run.training.seed)
    if run.training.torch_compile:
        from teratron.transformer.torch_compile import compile_transformer_layers

        for chunk in chunks:
            compile_transformer_layers(chunk)
    if run.ddp.shards_with_fsdp2():
        return [FullyShardedDataParallel(model_config.transformer, run.ddp, chunk, pg_collection, device)
                for chunk in chunks]
    return [DistributedDataParallel(config=model_config.transformer, ddp_config=run.ddp, module=chunk,
                                    disable_bucketing=i > 0, pg_collection=pg_collection)
            for i, chunk in enumerate(chunks)]


def attach_model_hooks(model, optimizer, pg_collection=None) -> None:
    """The callbacks the schedules read from the model's config (Megatron sets the same ones)."""
    config = model[0].config
    config.no_sync_func = model[0].no_sync if len(model) == 1 else [m.no_sync for m in model]
    config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pg_collection)
    config.grad_scale_func = optimizer.scale_loss


def build_optimizer(run, model, pg_collection=None):
    return get_megatron_optimizer(run.optimizer, model, pg_collection=pg_collection)


def build_qk_clip(model, optimizer, pg_collection=None):
    """The max-attention-logit records of the model (None without qk_clip or
    log_max_attention_logit); with qk_clip they clip through the optimizer's param-update hook."""
    config = model[0].config
    if not (config.qk_clip or config.log_max_attention_logit):
        return None
    qk_clip = QKClip(model, config, pg_collection)
    if config.qk_clip:
        optimizer.register_param_update_hook(qk_clip.clip)
    return qk_clip


def build_scheduler(run, optimizer) -> OptimizerParamScheduler:
    """LR and weight-decay schedule in samples, stepped by each iteration's global batch. Lengths
    given in iterations convert to the samples the batch-size ramp-up actually consumes by then;
    those given in samples (--train-samples, --lr-*-samples) are taken as they are, as Megatron.
    On resume the checkpoint's schedule must agree with it unless --override-opt_param-scheduler
    or --use-checkpoint-opt_param-scheduler says which wins (Megatron's rule)."""
    s, opt = run.scheduler, run.optimizer
    if s.unit == "samples":
        decay_steps, warmup_steps, wsd_steps = s.lr_decay_samples, s.lr_warmup_samples, s.lr_wsd_decay_samples
    else:
        samples_after = run.microbatches().samples_after
        decay_steps, warmup_steps = samples_after(s.lr_decay_iters), samples_after(s.lr_warmup_iters)
        wsd_steps = None
        if s.lr_wsd_decay_iters is not None:
            wsd_steps = decay_steps - samples_after(s.lr_decay_iters - s.lr_wsd_decay_iters)
    if s.lr_warmup_fraction is not None:
        warmup_steps = s.lr_warmup_fraction * decay_steps
    train_samples = run.training.train_samples
    if train_samples is None:
        train_samples = run.microbatches().samples_after(run.training.train_iters)
    return OptimizerParamScheduler(
        optimizer, init_lr=s.lr_warmup_init, max_lr=opt.lr, min_lr=opt.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=s.lr_decay_style,
        start_wd=s.start_weight_decay, end_wd=s.end_weight_decay,
        wd_incr_steps=train_samples, wd_incr_style=s.weight_decay_incr_style,
        wsd_decay_steps=wsd_steps, lr_wsd_decay_style=s.lr_wsd_decay_style,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
    )
