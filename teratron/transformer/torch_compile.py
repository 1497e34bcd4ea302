"""`--torch-compile`: every transformer layer compiled whole by torch.compile (the fused kernels
of `teratron.fusions` are inlined there)."""

import torch

from teratron.transformer.transformer_layer import TransformerLayer


def compile_transformer_layers(module: torch.nn.Module) -> int:
    """Compile every TransformerLayer under `module` in place (parameter names unchanged, so
    checkpoints and DDP buckets see the same model); returns how many were compiled."""
    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)
