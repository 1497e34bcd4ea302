"""Old home of the compile helper, kept only while `teratron/training/build.py` imports it from
here; new code imports `teratron.transformer.torch_compile` (and `teratron.fusions` for the fused
kernels). Delete this file once training imports the new module."""

from teratron.transformer.torch_compile import compile_transformer_layers

__all__ = ["compile_transformer_layers"]
