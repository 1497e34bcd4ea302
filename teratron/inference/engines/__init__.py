"""Inference engines: the dynamic (continuous-batching) engine."""

from teratron.inference.engines.dynamic_engine import DynamicInferenceEngine, RequestOutput

__all__ = ["DynamicInferenceEngine", "RequestOutput"]
