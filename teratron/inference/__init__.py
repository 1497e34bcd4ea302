"""Inference: the dynamic-batching engine over a paged KV cache, and token sampling."""

from teratron.inference.config import InferenceConfig
from teratron.inference.contexts import DynamicInferenceContext
from teratron.inference.engines import DynamicInferenceEngine, RequestOutput
from teratron.inference.sampling import generate, sample_next_token
from teratron.inference.sampling_params import SamplingParams

__all__ = ["DynamicInferenceContext", "DynamicInferenceEngine", "InferenceConfig", "RequestOutput", "SamplingParams",
           "generate", "sample_next_token"]
