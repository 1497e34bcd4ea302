"""`--torch-compile`: every decoder layer compiled whole by torch.compile (the fused kernels of
`teratron.fusions` are inlined there): each TransformerLayer, and each layer of a TransformerBlock
whatever its kind (the hybrid pattern's MambaLayer). The Triton scans and convolutions inside
Mamba and Gated DeltaNet layers are custom ops the graphs call; the norms, gates and layout changes
around them are fused."""

import torch

from teratron.transformer.transformer_block import TransformerBlock
from teratron.transformer.transformer_layer import TransformerLayer


def compile_transformer_layers(module: torch.nn.Module) -> int:
    """Compile every decoder layer under `module` in place (parameter names unchanged, so
    checkpoints and DDP buckets see the same model); returns how many were compiled."""
    layers = {id(m): m for m in module.modules() if isinstance(m, TransformerLayer)}
    for block in (m for m in module.modules() if isinstance(m, TransformerBlock)):
        layers.update((id(layer), layer) for layer in block.layers)
    for layer in layers.values():
        layer.compile()
    return len(layers)
