"""The transformer stack: configs, layer specs and layers (Megatron: `megatron.core.transformer`).

Only the configs are re-exported; import layers from their submodules.
"""

from teratron.model_parallel_config import ModelParallelConfig
from teratron.transformer.transformer_config import MLATransformerConfig, TransformerConfig

__all__ = ["ModelParallelConfig", "TransformerConfig", "MLATransformerConfig"]
