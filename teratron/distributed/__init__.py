"""Data parallelism: DDP with contiguous grad buffers, and the post-backward grad reduction."""

from teratron.distributed.distributed_data_parallel import DistributedDataParallel
from teratron.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from teratron.distributed.finalize_model_grads import finalize_model_grads

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "finalize_model_grads"]
