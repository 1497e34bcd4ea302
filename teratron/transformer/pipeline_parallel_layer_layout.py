"""Megatron's path of PipelineParallelLayerLayout (`core.transformer.pipeline_parallel_layer_layout`).

The class lives with the rest of layer placement in `teratron.pipeline_parallel.layout`, below the
transformer, so the transformer's config can validate a layout without an import circle.
"""

from teratron.pipeline_parallel.layout import LayerType, PipelineParallelLayerLayout

__all__ = ["LayerType", "PipelineParallelLayerLayout"]
