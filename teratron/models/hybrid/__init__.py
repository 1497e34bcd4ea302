"""Hybrid models (Megatron Core's HybridModel): GPT's embedding, output layer and loss around a
stack of Mamba-2, Gated DeltaNet, attention, MLP and MoE layers in the order of
`--hybrid-layer-pattern` (`hybrid_layer_allocation`). `models.gpt.build_gpt_model` builds them:
a config with `hybrid_layer_pattern` gets these layer specs (`hybrid_layer_specs`)."""

from teratron.models.hybrid.hybrid_layer_allocation import (HybridPattern, Symbols, mtp_depth_layer_numbers,
                                                             parse_hybrid_pattern,
                                                         pipeline_layout)

__all__ = ["HybridPattern", "Symbols", "mtp_depth_layer_numbers", "parse_hybrid_pattern", "pipeline_layout"]
