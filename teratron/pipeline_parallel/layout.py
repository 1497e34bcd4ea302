"""Which transformer layers each pipeline stage builds.

Owned by the pipeline-parallel work (issue 4): uneven first/last stages, the
`pipeline_model_parallel_layout` language and virtual stages extend these two functions.
TransformerBlock calls them; nothing else decides layer placement.
"""

from teratron import parallel_state


def _pp_rank_and_size(pp_rank, pp_size):
    if pp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return pp_rank, pp_size


def get_num_layers_to_build(config, vp_stage=None, pp_rank=None, pp_size=None) -> int:
    """Number of transformer layers this (pp_rank, vp_stage) builds. Even split for now."""
    pp_rank, pp_size = _pp_rank_and_size(pp_rank, pp_size)
    return config.num_layers // pp_size


def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None, pp_size=None) -> int:
    """Global index of the first layer this (pp_rank, vp_stage) builds. Even split for now."""
    pp_rank, pp_size = _pp_rank_and_size(pp_rank, pp_size)
    return pp_rank * (config.num_layers // pp_size)


def validate_pipeline_config(config) -> None:
    """Raise a one-line ValueError when the stages cannot split `config.num_layers`.

    Called from TransformerConfig.__post_init__.
    """
    pp_size = config.pipeline_model_parallel_size
    if config.num_layers % pp_size:
        raise ValueError(
            f"num_layers ({config.num_layers}) is not divisible by pipeline_model_parallel_size "
            f"({pp_size}); choose a layer count that splits evenly or set uneven first/last stages"
        )
