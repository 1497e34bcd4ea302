"""GPT: the decoder-only language model and its layer specs (Megatron: `megatron.core.models.gpt`)."""

from teratron.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                 get_gpt_layer_with_transformer_engine_spec,
                                                 get_gpt_mtp_block_spec, get_mlp_module_spec)
from teratron.models.gpt.gpt_model import GPTModel

__all__ = ["GPTModel", "get_gpt_decoder_block_spec", "get_gpt_layer_local_spec",
           "get_gpt_layer_with_transformer_engine_spec", "get_gpt_mtp_block_spec", "get_mlp_module_spec"]
