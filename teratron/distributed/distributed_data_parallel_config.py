"""DistributedDataParallelConfig: how gradients are bucketed and reduced (Megatron's fields)."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_fp32: bool = False
    """Keep the grad buffers (and the reduction) in fp32 even when params are bf16/fp16."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's reduction from the backward pass as soon as its last grad is ready.
    Without it, all grads of a buffer form one bucket reduced in `finish_grad_sync()`."""

    overlap_param_gather: bool = False
    """Distributed optimizer: the all-gathers of the updated params are launched at the end of
    `optimizer.step()` without waiting; each bucket's is waited for in a forward pre-hook of the
    first module using its params, instead of all of them inside the step."""

    align_param_gather: bool = False
    """Accepted for Megatron compatibility; parameter all-gathers are always issued in the
    forward order of the buckets, which is what this flag aligns across virtual stages."""

    use_distributed_optimizer: bool = False
    """Reduce-scatter grads (each DP rank owns an equal contiguous shard of every bucket) so the
    distributed optimizer keeps master weights and states for its shard only. The one switch
    for it: `get_megatron_optimizer` builds a DistributedOptimizer when the model chunks' DDP
    configs set it (--use-distributed-optimizer)."""

    num_distributed_optimizer_instances: int = 1
    """FSDP: hybrid sharding (HSDP) over this many instances: each shards over 1/N of the DP x CP
    ranks and replicates across the others. Without FSDP only 1 (one distributed-optimizer
    instance over the full data-parallel group)."""

    copy_engine_collectives: bool = False
    """Distributed optimizer, all data-parallel ranks on one NVLink node: reduce-scatter grads and
    all-gather params by copy-engine pulls from symmetric memory instead of NCCL kernels, which
    slow the GEMMs beside them more (teratron's own; see distributed/copy_engine.py)."""

    check_for_nan_in_grad: bool = False
    """Raise before reducing when a local gradient holds NaN or Inf."""

    check_for_large_grads: bool = False
    """Accepted for Megatron compatibility; must stay False."""

    bucket_size: Optional[int] = None
    """Bucket size in elements; None picks max(40M, 1M x DP size). Used with overlap_grad_reduce."""

    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad bucket sizes to a multiple of 2^16 x DP size (faster NCCL at large DP)."""

    average_in_collective: bool = False
    """Average in the collective (ReduceOp.AVG) instead of dividing grads by DP size first."""

    fp8_param_gather: bool = False
    """Accepted for Megatron compatibility; must stay False (no FP8 params)."""

    use_megatron_fsdp: bool = False
    """Shard over data parallelism as `data_parallel_sharding_strategy` says
    (distributed/fsdp.py: FSDP2 for the strategies that shard gradients)."""

    use_torch_fsdp2: bool = False
    """PyTorch FSDP2 over data parallelism: `optim_grads_params`, or `optim_grads` without
    `torch_fsdp2_reshard_after_forward` (teratron's field for Megatron's
    --torch-fsdp2-no-reshard-after-forward)."""

    torch_fsdp2_reshard_after_forward: bool = True

    data_parallel_sharding_strategy: str = "no_shard"
    """With use_megatron_fsdp: 'no_shard' (DDP), 'optim' (the distributed optimizer), 'optim_grads'
    or 'optim_grads_params' (FSDP2)."""

    def __post_init__(self):
        if self.num_distributed_optimizer_instances < 1:
            raise ValueError(f"num_distributed_optimizer_instances must be >= 1, got "
                             f"{self.num_distributed_optimizer_instances}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "overlap_param_gather needs use_distributed_optimizer=True "
                "(--use-distributed-optimizer); only the distributed optimizer gathers params")
        if self.copy_engine_collectives and not self.use_distributed_optimizer:
            raise ValueError(
                "copy_engine_collectives needs use_distributed_optimizer=True "
                "(--use-distributed-optimizer); it replaces the reduce-scatter and all-gather")
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"bucket_size must be a positive element count or None, got {self.bucket_size}")
        if self.use_megatron_fsdp and self.use_torch_fsdp2:
            raise ValueError("use_megatron_fsdp and use_torch_fsdp2 each choose the FSDP flavour; pass one "
                             "(--use-megatron-fsdp or --use-torch-fsdp2)")
        strategies = ("no_shard", "optim", "optim_grads", "optim_grads_params")
        if self.data_parallel_sharding_strategy not in strategies:
            raise ValueError(f"data_parallel_sharding_strategy={self.data_parallel_sharding_strategy!r}; "
                             f"choose one of {', '.join(strategies)}")
        if self.fsdp_strategy() == "optim":  # ZeRO-1 is the distributed optimizer
            self.use_distributed_optimizer = True
        if self.num_distributed_optimizer_instances != 1 and not self.shards_with_fsdp2():
            raise ValueError(
                "num_distributed_optimizer_instances must be 1 without FSDP (a partial, multi-instance distributed "
                "optimizer is not supported); with --use-torch-fsdp2 / --use-megatron-fsdp it sets hybrid sharding")
        if self.shards_with_fsdp2():
            for name in ("overlap_param_gather", "copy_engine_collectives"):
                if getattr(self, name):
                    raise ValueError(f"{name} is a setting of DDP's buffers, which FSDP does not use "
                                     "(FSDP2 prefetches each layer's gather); drop it")
        for name in ("check_for_large_grads", "fp8_param_gather"):
            if getattr(self, name):
                raise NotImplementedError(f"DistributedDataParallelConfig.{name}=True is not supported; leave it False")

    def fsdp_strategy(self) -> str | None:
        """The sharding strategy when FSDP is on (None without it)."""
        if self.use_torch_fsdp2:
            return "optim_grads_params" if self.torch_fsdp2_reshard_after_forward else "optim_grads"
        if self.use_megatron_fsdp:
            return self.data_parallel_sharding_strategy
        return None

    def shards_with_fsdp2(self) -> bool:
        """Whether the model chunks are sharded by FullyShardedDataParallel (the strategies that
        shard gradients); 'no_shard' and 'optim' run DDP (with the distributed optimizer)."""
        return self.fsdp_strategy() in ("optim_grads", "optim_grads_params")
