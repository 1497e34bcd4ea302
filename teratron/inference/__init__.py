"""Inference. For now a minimal sampler (the demo's); the engine and server come later."""

from teratron.inference.sampling import generate, sample_next_token

__all__ = ["generate", "sample_next_token"]
