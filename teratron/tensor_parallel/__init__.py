"""Tensor parallelism: autograd collectives, parallel layers, vocab-parallel loss, RNG streams."""

from teratron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from teratron.tensor_parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from teratron.tensor_parallel.layers import (
    ColumnParallelLinear,
    DuplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from teratron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from teratron.tensor_parallel.random import (
    CheckpointWithoutOutput,
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)
from teratron.tensor_parallel.utils import (
    VocabUtility,
    divide,
    gather_shards,
    gather_split_1d_tensor,
    pad_vocab_size,
    shard_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)

__all__ = [
    "ColumnParallelLinear", "DuplicatedLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "copy_tensor_model_parallel_attributes", "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes", "set_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "vocab_parallel_cross_entropy",
    "fused_vocab_parallel_cross_entropy",
    "CheckpointWithoutOutput", "RNGStatesTracker", "checkpoint", "get_cuda_rng_tracker", "get_rng_tracker",
    "get_data_parallel_rng_tracker_name", "get_expert_parallel_rng_tracker_name",
    "model_parallel_cuda_manual_seed", "model_parallel_manual_seed",
    "VocabUtility", "divide", "gather_shards", "gather_split_1d_tensor", "pad_vocab_size", "shard_tensor",
    "split_tensor_along_last_dim", "split_tensor_into_1d_equal_chunks",
]
