"""Data parallelism: DDP with contiguous grad buffers, FSDP (FSDP2), and the post-backward grad reduction."""

from teratron.distributed.distributed_data_parallel import DistributedDataParallel
from teratron.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from teratron.distributed.finalize_model_grads import finalize_model_grads
from teratron.distributed.fsdp import FullyShardedDataParallel

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "FullyShardedDataParallel",
           "finalize_model_grads"]
