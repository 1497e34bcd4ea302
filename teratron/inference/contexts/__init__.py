"""The KV cache and step metadata the model's attention layers use during inference."""

from teratron.inference.contexts.dynamic_context import DynamicInferenceContext, StepChunk
from teratron.inference.contexts.kv_block_allocator import KVBlockAllocator

__all__ = ["DynamicInferenceContext", "KVBlockAllocator", "StepChunk"]
