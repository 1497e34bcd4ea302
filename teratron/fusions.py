"""Fused elementwise kernels: the plain functions, compiled by torch.compile (Inductor writes one
Triton kernel per fused region on GPU, C++ on CPU). No hand-written kernels: the compiled
function is the unfused one, so both paths have one meaning and the tests compare them.

Selected by Megatron's fusion flags: `apply_rope_fusion` (RoPE), `bias_activation_fusion`
(bias + activation, SwiGLU included), `bias_dropout_fusion` (bias + dropout + residual add); the
vocab-parallel cross entropy compiles its passes on GPU. Inside a layer compiled whole
(`teratron train --torch-compile`, `transformer.torch_compile`) they are simply inlined.
This module sits at the bottom of the layering (it needs only torch), so any layer may use it.
"""

import functools

import torch


@functools.cache
def fused(fn):
    """`fn` compiled once per process, recompiled by Dynamo when shapes, dtypes or Python
    arguments change; past Dynamo's recompile limit it runs eagerly (same results), never fails."""
    return torch.compile(fn)
