"""Optimizers: mixed precision with fp32 masters, the distributed optimizer, Adam/SGD/Lion/Muon,
gradient clipping and CPU offload, built by `get_megatron_optimizer` (Megatron's entry point)."""

import torch

from teratron.optimizer.clip_grads import all_reduce_over_groups, calc_params_l2_norm, default_device
from teratron.optimizer.cpu_offload import use_host_cores
from teratron.optimizer.distrib_optimizer import DistributedOptimizer
from teratron.optimizer.fsdp_optimizer import FsdpOptimizer
from teratron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from teratron.optimizer.lion import Lion
from teratron.optimizer.muon import Muon
from teratron.optimizer.optimizer import (ChainedOptimizer, Float16OptimizerWithFloat16Params,
                                          FP32Optimizer, MainParamShard, MegatronOptimizer)
from teratron.optimizer.optimizer_config import OptimizerConfig
from teratron.process_groups import ProcessGroupCollection
from teratron.topology import resolve_pg_collection

__all__ = [
    "ChainedOptimizer", "ConstantGradScaler", "DistributedOptimizer", "DynamicGradScaler",
    "Float16OptimizerWithFloat16Params", "FP32Optimizer", "FsdpOptimizer", "Lion", "MainParamShard", "MegatronGradScaler",
    "MegatronOptimizer", "Muon", "OptimizerConfig", "calc_params_l2_norm", "get_megatron_optimizer",
]

_EMBEDDING_NAMES = ("word_embeddings", "position_embeddings", "output_layer")


def _unwrap(model_chunk):
    while isinstance(getattr(model_chunk, "module", None), torch.nn.Module):
        model_chunk = model_chunk.module
    return model_chunk


def _is_embedding_or_output(name, param):
    return getattr(param, "is_embedding_or_output_parameter", False) or any(n in name for n in _EMBEDDING_NAMES)


def _get_param_groups(model_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult, param_filter):
    """Megatron's grouping: by (weight-decay mult, lr mult, expert?, decoupled lr?).

    Default no-decay rule: biases and 1-D params (norm weights), except q/k layernorm weights
    with apply_wd_to_qk_layernorm. Each group carries max_lr/min_lr/lr_mult/wd_mult for the
    OptimizerParamScheduler and starts at lr = max_lr * lr_mult, weight_decay = wd * wd_mult.
    """
    groups = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or not param_filter(name, param):
                continue
            if no_weight_decay_cond is not None:
                no_wd = no_weight_decay_cond(name, param)
            else:
                qk_norm = "q_layernorm." in name or "k_layernorm." in name
                no_wd = (name.endswith(".bias") or param.dim() == 1) and not (
                    config.apply_wd_to_qk_layernorm and qk_norm)
            scale_lr = scale_lr_cond(name, param) if scale_lr_cond is not None else False
            is_expert = not getattr(param, "allreduce", True)
            is_decoupled = config.decoupled_lr is not None and _is_embedding_or_output(name, param)
            key = (0.0 if no_wd else 1.0, lr_mult if scale_lr else 1.0, is_expert, is_decoupled)
            groups.setdefault(key, []).append(param)
    param_groups = []
    for (wd_mult, group_lr_mult, is_expert, is_decoupled), params in groups.items():
        max_lr = config.decoupled_lr if is_decoupled else config.lr
        # None: the scheduler's floor (a decoupled lr without its own floor uses min_lr, as --min-lr).
        min_lr = config.decoupled_min_lr if is_decoupled and config.decoupled_min_lr is not None else config.min_lr
        param_groups.append({
            "params": params, "wd_mult": wd_mult, "lr_mult": group_lr_mult,
            "is_expert_parallel": is_expert, "is_decoupled_lr": is_decoupled,
            "max_lr": max_lr, "min_lr": min_lr,
            "lr": max_lr * group_lr_mult, "weight_decay": config.weight_decay * wd_mult,
        })
    return param_groups


def _grad_scaler(config):
    if not (config.fp16 or config.bf16):
        return None
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=int(config.loss_scale_window), hysteresis=config.hysteresis)
    return None


def _torch_optimizer_factory(config, kind, pg_collection):
    """kind: 'adam' | 'sgd' | 'lion' | 'muon'; returns param_groups -> torch optimizer."""
    lr = config.lr or 0.0
    if kind == "adam":
        cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        kwargs = dict(lr=lr, weight_decay=config.weight_decay,
                      betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    elif kind == "sgd":
        cls, kwargs = torch.optim.SGD, dict(lr=lr, weight_decay=config.weight_decay, momentum=config.sgd_momentum)
    elif kind == "lion":
        cls = Lion
        kwargs = dict(lr=lr, weight_decay=config.weight_decay, betas=(config.lion_beta1, config.lion_beta2))
    else:
        cls = Muon
        kwargs = dict(lr=lr, momentum=config.muon_momentum, nesterov=config.muon_nesterov,
                      weight_decay=config.weight_decay, decoupled_weight_decay=config.decoupled_weight_decay,
                      num_ns_steps=config.muon_num_ns_steps, coefficient_type=config.muon_coefficient_type,
                      scale_mode=config.muon_scale_mode, extra_scale_factor=config.muon_extra_scale_factor,
                      fp32_matmul_prec=config.muon_fp32_matmul_prec, tp_mode=config.muon_tp_mode,
                      tp_group=pg_collection.tp, expert_tp_group=pg_collection.expt_tp)

    def make(param_groups):
        if param_groups:
            if kind == "adam" and all(p.is_cuda for group in param_groups for p in group["params"]):
                # One multi-tensor CUDA kernel for the whole step instead of foreach's ~10 passes.
                return cls(param_groups, **kwargs, fused=True)
            return cls(param_groups, **kwargs)
        # A part with no params on this rank: an optimizer with no groups (torch refuses none).
        optimizer = cls([{"params": []}], **kwargs)
        optimizer.param_groups.clear()
        return optimizer

    return make


def _mark_qkv_layouts(model_chunks):
    """Tell Muon how to split fused QKV weights: [groups, (heads per group (x2 with gates) + 2) *
    head dim, h]."""
    for chunk in model_chunks:
        tf_config = getattr(_unwrap(chunk), "config", None)
        if tf_config is None:
            continue
        heads = tf_config.num_attention_heads
        query_groups = getattr(tf_config, "num_query_groups", None) or heads
        head_dim = getattr(tf_config, "kv_channels", None) or tf_config.hidden_size // heads
        for name, param in chunk.named_parameters():
            if name.endswith("linear_qkv.weight") and param.dim() == 2:
                per_group = heads // query_groups
                gates = (per_group,) if getattr(tf_config, "attention_output_gate", False) else ()
                param.muon_qkv_layout = ((per_group, *gates, 1, 1), head_dim)


def _grid_groups(pg):
    """Groups whose product is the whole grid, dense and expert alike: grad statistics reduce here."""
    return [pg.tp, pg.dp_cp, pg.pp]


def _sharding(model_chunks) -> str | None:
    """How the chunks shard the optimizer: 'fsdp' (FullyShardedDataParallel), 'distributed' (DDP
    buffers for the distributed optimizer: use_distributed_optimizer) or None (whole params; also a
    chunk outside DDP)."""
    def kind(chunk):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.shards_with_fsdp2():
            return "fsdp"
        return "distributed" if getattr(ddp_config, "use_distributed_optimizer", False) else None

    kinds = {kind(chunk) for chunk in model_chunks}
    if len(kinds) > 1:
        raise ValueError("the model chunks disagree on how they shard the optimizer; wrap every chunk the same "
                         "way (DistributedDataParallel with one DistributedDataParallelConfig, or "
                         "FullyShardedDataParallel)")
    return kinds.pop()


def _build(config, param_groups, kind, grad_scaler, model_chunks, sharding, is_expert, pg):
    make = _torch_optimizer_factory(config, kind, pg)
    tp = pg.expt_tp if is_expert else pg.tp
    dp = pg.expt_dp if is_expert else pg.dp_cp
    common = dict(tp_group=tp, pp_group=pg.pp, grad_stats_groups=_grid_groups(pg))
    if sharding == "fsdp":
        # Hybrid sharding replicates each dense shard across instances: count it once.
        replicas = None if is_expert else pg.inter_dist_opt
        return FsdpOptimizer(make, param_groups, config, grad_scaler, grad_replica_group=replicas, **common)
    if sharding == "distributed":
        buffers = [b for chunk in model_chunks
                   for b in (chunk.expert_parallel_buffers if is_expert else chunk.buffers)]
        return DistributedOptimizer(make, param_groups, config, grad_scaler, model_chunks, buffers, dp, **common)
    if config.fp16 or config.bf16 or config.optimizer_cpu_offload:
        return Float16OptimizerWithFloat16Params(make, param_groups, config, grad_scaler,
                                                 grad_replica_group=dp, **common)
    return FP32Optimizer(make(param_groups), config, grad_scaler, grad_replica_group=dp, **common)


def _present_on_any_rank(flags, pg):
    """flags[i]: this rank has params for part i; the same answer on every rank of the grid."""
    present = torch.tensor(flags, dtype=torch.float32, device=default_device())
    all_reduce_over_groups(present, _grid_groups(pg), torch.distributed.ReduceOp.MAX)
    return [bool(flag) for flag in present.tolist()]


def get_megatron_optimizer(config: OptimizerConfig, model_chunks, no_weight_decay_cond=None,
                           scale_lr_cond=None, lr_mult: float = 1.0,
                           pg_collection: ProcessGroupCollection | None = None) -> MegatronOptimizer:
    """The optimizer for `model_chunks` (DDP-wrapped or plain modules): the distributed optimizer
    where their DistributedDataParallelConfig says use_distributed_optimizer.

    no_weight_decay_cond(name, param) / scale_lr_cond(name, param) override Megatron's default
    rules; params matching scale_lr_cond get lr * lr_mult. Dense and expert params, and with
    Muon its 2-D weights and the rest, get separate optimizers chained into one. Every rank
    builds the same parts (empty where it has no such params: a pipeline stage without experts
    or without matrices), so all ranks make the same collectives; hence a collective call.
    """
    if not isinstance(model_chunks, (list, tuple)):
        model_chunks = [model_chunks]
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr is not set; give a learning rate (--lr)")
    if config.overlap_param_gather_with_optimizer_step:
        raise NotImplementedError("overlap_param_gather_with_optimizer_step is not supported; leave it False")
    if pg_collection is None:
        pg_collection = getattr(model_chunks[0], "pg_collection", None)
    pg_collection = resolve_pg_collection(pg_collection)
    sharding = _sharding(model_chunks)
    if sharding == "fsdp" and config.optimizer_cpu_offload:
        raise ValueError("optimizer_cpu_offload with FSDP: the sharded fp32 parameters are the master weights "
                         "and stay on the device; turn one off")
    grad_scaler = _grad_scaler(config)
    if config.optimizer_cpu_offload:
        use_host_cores()

    if config.optimizer == "muon":
        if config.fp16:
            raise ValueError("optimizer='muon' does not support fp16; use bf16 or fp32")
        if config.optimizer_cpu_offload:
            raise ValueError("optimizer='muon' does not support optimizer_cpu_offload (its full-matrix "
                             "collectives run on the device); turn offload off or use adam/sgd/lion")
        if config.muon_split_qkv:
            _mark_qkv_layouts(model_chunks)
        is_matrix = lambda name, p: p.dim() == 2 and not _is_embedding_or_output(name, p)  # noqa: E731
        parts = [("muon", is_matrix),
                 (config.muon_scalar_optimizer, lambda name, p: not is_matrix(name, p))]
    else:
        parts = [(config.optimizer, lambda name, p: True)]

    built = []   # (kind, is_expert, this rank's param groups)
    for kind, param_filter in parts:
        groups = _get_param_groups(model_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult,
                                   param_filter)
        for is_expert in (False, True):
            built.append((kind, is_expert, [g for g in groups if g["is_expert_parallel"] == is_expert]))
    present = _present_on_any_rank([bool(groups) for _, _, groups in built], pg_collection)
    optimizers = [_build(config, groups, kind, grad_scaler, model_chunks, sharding, is_expert, pg_collection)
                  for (kind, is_expert, groups), keep in zip(built, present) if keep]
    if not optimizers:
        raise ValueError("the model chunks have no trainable parameters (requires_grad=True) to optimize")
    return optimizers[0] if len(optimizers) == 1 else ChainedOptimizer(optimizers)
