"""InferenceConfig: the dynamic engine's memory budget and scheduler limits (Megatron's
`inference.config`, the `--inference-*` flags)."""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class InferenceConfig:
    buffer_size_gb: float = 1.0
    """KV-cache memory of this stage in GiB (--inference-dynamic-batching-buffer-size-gb): the K and V
    of every local layer for as many blocks as fit, after a hybrid model's recurrent states
    (mamba_memory_ratio)."""
    block_size: int = 16
    """Tokens per KV-cache block (--inference-dynamic-batching-block-size)."""
    max_requests: int = 64
    """The most requests holding KV blocks at once (--inference-max-requests); more wait."""
    max_seq_length: Optional[int] = None
    """The longest prompt plus generated tokens of one request (--inference-max-seq-length); None:
    the model's max_sequence_length."""
    max_tokens_per_step: int = 512
    """Tokens one forward step computes, decode tokens and prefill chunks together: longer prompts
    are prefilled in chunks across steps (chunked prefill) (--inference-dynamic-batching-max-tokens)."""
    prefix_caching: bool = False
    """Share the KV blocks of identical prompt prefixes between requests, found by block hash;
    unreferenced cached blocks are evicted least recently used first
    (--inference-dynamic-batching-prefix-caching)."""
    mamba_memory_ratio: Optional[float] = None
    """Hybrid models: the share of buffer_size_gb for the Mamba-2 and Gated DeltaNet layers' states
    of the running requests, which then caps how many run at once
    (--inference-dynamic-batching-mamba-memory-ratio); None: the states of max_requests requests come
    out of the buffer first, the KV cache gets the rest."""
    prefix_caching_mamba_gb: Optional[float] = None
    """With prefix caching on a hybrid model: GiB for the Mamba-2 and Gated DeltaNet layers' states
    at cached block boundaries (--inference-dynamic-batching-prefix-caching-mamba-gb), without which
    their layers cannot start after a cached prefix, so hybrid requests reuse none."""
    num_speculative_tokens: int = 0
    """Draft tokens proposed per request and decode step, verified in one target forward
    (speculative decoding: the engine's draft_model proposes them, or without one the model's
    multi-token-prediction layers, at most one per depth); 0: off."""

    num_cuda_graphs: int = 16
    """Decode steps replay CUDA graphs captured for up to this many batch sizes between 1 and
    max_requests (--inference-dynamic-batching-num-cuda-graphs); -1: one per batch size; 0: none.
    On CUDA only, and not for MoE models (their routing has data-dependent shapes)."""

    def __post_init__(self):
        if not self.buffer_size_gb > 0:
            raise ValueError(f"buffer_size_gb={self.buffer_size_gb} must be > 0 "
                             "(--inference-dynamic-batching-buffer-size-gb)")
        for name, flag in (("block_size", "--inference-dynamic-batching-block-size"),
                           ("max_requests", "--inference-max-requests"),
                           ("max_tokens_per_step", "--inference-dynamic-batching-max-tokens")):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1 ({flag})")
        if self.max_seq_length is not None and (not isinstance(self.max_seq_length, int) or self.max_seq_length < 2):
            raise ValueError(f"max_seq_length={self.max_seq_length!r} must be an integer >= 2, or None for "
                             "the model's max_sequence_length (--inference-max-seq-length)")
        if not isinstance(self.num_cuda_graphs, int) or self.num_cuda_graphs < -1:
            raise ValueError(f"num_cuda_graphs={self.num_cuda_graphs!r} must be -1 (every batch size), 0 (none) or a "
                             "count >= 1 (--inference-dynamic-batching-num-cuda-graphs)")
        if self.mamba_memory_ratio is not None and not 0 < self.mamba_memory_ratio < 1:
            raise ValueError(f"mamba_memory_ratio={self.mamba_memory_ratio} must be between 0 and 1, exclusive "
                             "(--inference-dynamic-batching-mamba-memory-ratio)")
        if self.prefix_caching_mamba_gb is not None and not self.prefix_caching_mamba_gb >= 0:
            raise ValueError(f"prefix_caching_mamba_gb={self.prefix_caching_mamba_gb} must be >= 0 "
                             "(--inference-dynamic-batching-prefix-caching-mamba-gb)")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens!r} must be an integer >= 0 "
                             "(0: no speculative decoding)")
