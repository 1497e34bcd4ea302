"""Fused elementwise kernels: the plain functions, compiled by torch.compile (Inductor writes one
Triton kernel per fused region on GPU, C++ on CPU). No hand-written kernels: the compiled
function is the unfused one, so both paths have one meaning and the tests compare them.

Selected by Megatron's fusion flags: `apply_rope_fusion` (RoPE), `bias_activation_fusion`
(bias + activation, SwiGLU included), `bias_dropout_fusion` (bias + dropout + residual add).
Inside a layer compiled whole (`teratron train --torch-compile`) they are simply inlined.
"""

import functools

import torch


@functools.cache
def fused(fn):
    """`fn` compiled once per process, recompiled by Dynamo when shapes, dtypes or Python
    arguments change; past Dynamo's recompile limit it runs eagerly (same results), never fails."""
    return torch.compile(fn)


def compile_transformer_layers(module: torch.nn.Module) -> int:
    """Compile every TransformerLayer under `module` in place (parameter names unchanged, so
    checkpoints and DDP buckets see the same model); returns how many were compiled."""
    from teratron.transformer.transformer_layer import TransformerLayer

    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)
