"""Kernels of the inference engine, each with a plain-PyTorch reference for the CPU
(`paged_attention`: decode attention over the paged KV cache)."""
