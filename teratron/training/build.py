"""Model, optimizer and LR scheduler of a run, built from the validated args (Megatron's
`setup_model_and_optimizer`)."""

import torch

from teratron import parallel_state
from teratron.training.arguments import config_from_args


def set_vocab_sizes(args, vocab_size: int) -> None:
    """args.vocab_size (the tokenizer's, real ids) and args.padded_vocab_size (Megatron's padding
    to a multiple of make_vocab_size_divisible_by x TP), which the model is built with."""
    from teratron.tensor_parallel import pad_vocab_size

    args.vocab_size = vocab_size
    args.padded_vocab_size = pad_vocab_size(vocab_size, args.make_vocab_size_divisible_by,
                                            args.tensor_model_parallel_size)


def gpt_model_provider(args, config, pre_process: bool, post_process: bool, vp_stage=None):
    from teratron.models.gpt import GPTModel, get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if args.num_experts is not None:
        # One spec per local layer: MoE where --moe-layer-freq puts it, dense elsewhere.
        spec = get_gpt_decoder_block_spec(config, normalization=args.normalization, vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return GPTModel(
        config, spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base, vp_stage=vp_stage,
        unpadded_vocab_size=args.vocab_size,
    )


def build_model(args, config, device) -> list:
    """This rank's model chunks (one per virtual stage), on `device`, each wrapped in DDP.

    The seed is set right before building: initialisation is layout-invariant (every component
    draws from a stream derived from it), so any TP/PP layout starts from the same full model.
    """
    from teratron.distributed import DistributedDataParallel
    from teratron.tensor_parallel import model_parallel_cuda_manual_seed

    vpp = config.virtual_pipeline_model_parallel_size
    torch.manual_seed(args.seed)
    chunks = []
    for i in range(vpp or 1):
        vp_stage = i if vpp else None
        chunks.append(gpt_model_provider(
            args, config,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        ).to(device))
    model_parallel_cuda_manual_seed(args.seed)
    if args.torch_compile:
        from teratron.transformer.fusions import compile_transformer_layers

        for chunk in chunks:
            compile_transformer_layers(chunk)

    ddp_config = ddp_config_from_args(args)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)]


def attach_model_hooks(config, model, optimizer) -> None:
    """The callbacks the schedules use (Megatron sets the same ones on the config)."""
    from teratron.distributed import finalize_model_grads

    config.no_sync_func = model[0].no_sync if len(model) == 1 else [m.no_sync for m in model]
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss


def ddp_config_from_args(args):
    from teratron.distributed import DistributedDataParallelConfig

    return config_from_args(DistributedDataParallelConfig, args,
                            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                            bucket_size=args.ddp_bucket_size,
                            average_in_collective=args.ddp_average_in_collective)


def optimizer_config_from_args(args):
    from teratron.optimizer import OptimizerConfig

    return config_from_args(OptimizerConfig, args)


def build_optimizer(args, model):
    from teratron.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(optimizer_config_from_args(args), model)


def build_scheduler(args, optimizer):
    """LR and weight-decay schedule in samples, so batch-size ramp-up moves it correctly: each
    iteration count converts to the samples the ramp-up actually consumes by then."""
    from teratron.optimizer_param_scheduler import OptimizerParamScheduler
    from teratron.training.microbatches import build_num_microbatches_calculator

    samples_after = build_num_microbatches_calculator(
        args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
        args.rampup_batch_size).samples_after
    decay_steps = samples_after(args.lr_decay_iters)
    if args.lr_warmup_fraction is not None:
        warmup_steps = args.lr_warmup_fraction * decay_steps
    else:
        warmup_steps = samples_after(args.lr_warmup_iters)
    wsd_steps = None
    if args.lr_wsd_decay_iters is not None:
        wsd_steps = decay_steps - samples_after(args.lr_decay_iters - args.lr_wsd_decay_iters)
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=samples_after(args.train_iters), wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=wsd_steps, lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
