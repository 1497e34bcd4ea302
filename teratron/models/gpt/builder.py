"""The one GPT model builder: `teratron train`, `convert`, `merge`, `estimate` and inference call it.

    chunks = build_model_chunks(model_config, pg_collection)    # this rank's (virtual) stages
    model = build_gpt_model(model_config, pg_collection=pg)     # one stage (the whole model at PP 1)

Layers are placed by `transformer.get_num_layers_to_build` / `get_transformer_layer_offset`
from the config's pipeline settings; MoE layers go where `moe_layer_freq` puts them; the
multi-token-prediction layers (config.mtp_num_layers) on the last stage. A hybrid config
(`hybrid_layer_pattern`) gets its pattern's layers (`models.hybrid`) around GPT's embedding,
output layer and loss, and its MTP depths the layers after the pattern's '/': Megatron's HybridModel.
"""

from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from teratron.models.gpt.gpt_model import GPTModel
from teratron.models.hybrid.hybrid_layer_specs import get_hybrid_decoder_block_spec, hybrid_mtp_layer_spec
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.topology import resolve_pg_collection


def build_gpt_model(model: GPTModelConfig, pre_process: bool = True, post_process: bool = True,
                    vp_stage=None, pg_collection=None) -> GPTModel:
    """One (virtual) pipeline stage of the model, on the CPU unless the config says otherwise."""
    pg = resolve_pg_collection(pg_collection)
    config = model.transformer
    placement = dict(normalization=config.normalization, vp_stage=vp_stage, pp_rank=get_pg_rank(pg.pp),
                     pp_size=get_pg_size(pg.pp))
    block_spec = get_hybrid_decoder_block_spec if config.hybrid_layer_pattern else get_gpt_decoder_block_spec
    spec = block_spec(config, **placement)
    mtp_layer = hybrid_mtp_layer_spec(config, config.normalization) if config.hybrid_layer_pattern else None
    return GPTModel(
        config, spec, vocab_size=model.padded_vocab_size, max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type, rotary_percent=model.rotary_percent,
        rotary_base=model.rotary_base, rope_scaling=model.rope_scaling, rope_scaling_factor=model.rope_scaling_factor,
        rope_scaling_low_freq_factor=model.rope_scaling_low_freq_factor,
        rope_scaling_high_freq_factor=model.rope_scaling_high_freq_factor,
        rope_scaling_original_max_position_embeddings=model.rope_scaling_original_max_position_embeddings,
        pg_collection=pg, vp_stage=vp_stage,
        unpadded_vocab_size=model.vocab_size, mtp_block_spec=get_gpt_mtp_block_spec(config, mtp_layer, **placement),
    )


def build_model_chunks(model: GPTModelConfig, pg_collection=None) -> list:
    """This rank's model chunks, one per virtual stage (one without interleaving): the first
    chunk of the first pipeline rank holds the embedding, the last chunk of the last rank the
    output layer."""
    pg = resolve_pg_collection(pg_collection)
    pp_rank, pp_size = get_pg_rank(pg.pp), get_pg_size(pg.pp)
    vpp = model.transformer.virtual_pipeline_model_parallel_size
    if vpp is None:
        return [build_gpt_model(model, pp_rank == 0, pp_rank == pp_size - 1, None, pg)]
    return [build_gpt_model(model, pp_rank == 0 and i == 0, pp_rank == pp_size - 1 and i == vpp - 1, i, pg)
            for i in range(vpp)]
