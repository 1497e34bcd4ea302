"""Which transformer layers each pipeline stage builds.

TransformerBlock calls `get_num_layers_to_build` and `get_transformer_layer_offset`; nothing else
decides layer placement. All placements reduce to one table: the number of decoder layers of
each (virtual) stage in flat order i = vp_stage * pp + pp_rank, whose prefix sums are the offsets.
The table comes from, in order of precedence:
- `pipeline_model_parallel_layout` (see transformer/pipeline_parallel_layer_layout.py);
- `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`: those ranks get the
  given counts, the other ranks split the rest evenly;
- an even split, where `account_for_embedding_in_pipeline_split` /
  `account_for_loss_in_pipeline_split` count the embedding / loss as one more layer of the first /
  last stage.
With virtual stages each rank's layers are split evenly over its model chunks.
"""

from typing import Optional

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.topology import resolve_pg_collection
from teratron.transformer.enums import LayerType
from teratron.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout


def _pp_rank_and_size(pp_rank, pp_size):
    """The stage asked about; what is not given is this rank's in the current topology."""
    pp_group = resolve_pg_collection().pp
    if pp_size is None:
        pp_size = get_pg_size(pp_group)
    if pp_rank is None:
        pp_rank = get_pg_rank(pp_group)
    return pp_rank, pp_size


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}: {total} layers cannot be split evenly over {parts}; change "
                         f"num_layers, the first/last stage layer counts or the (virtual) pipeline size")
    return total // parts


def _rank_layer_counts(config, pp: int) -> list:
    """Decoder layers per pipeline rank (not yet split over virtual stages)."""
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        extra = [int(config.account_for_embedding_in_pipeline_split),
                 int(config.account_for_loss_in_pipeline_split)]
        counted = f"num_layers ({config.num_layers})"
        if any(extra):
            counted += f" + embedding/loss ({sum(extra)})"
        per_rank = _split(config.num_layers + sum(extra), pp,
                          f"{counted} over pipeline_model_parallel_size ({pp})")
        return [per_rank] * pp
    ends = {0: first, pp - 1: last}
    fixed = {rank: n for rank, n in ends.items() if n is not None}
    rest, middle = config.num_layers - sum(fixed.values()), pp - len(fixed)
    if rest < 0 or (middle == 0 and rest):
        raise ValueError(f"num_layers_in_first_pipeline_stage ({first}) and "
                         f"num_layers_in_last_pipeline_stage ({last}) do not add up to num_layers "
                         f"({config.num_layers}) over {pp} stages; adjust them")
    per_rank = 0
    if middle:
        per_rank = _split(rest, middle, f"the {rest} layers left for the {middle} middle pipeline stages")
    return [fixed.get(rank, per_rank) for rank in range(pp)]


def stage_layer_counts(config, pp_size: int) -> list:
    """Decoder layers of every (virtual) stage, flat order i = vp_stage * pp_size + pp_rank."""
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        if layout.pipeline_model_parallel_size != pp_size:
            raise ValueError(f"pipeline_model_parallel_layout is for {layout.pipeline_model_parallel_size} "
                             f"pipeline stages, not {pp_size}; build the model with the config's PP size")
        return [stage.count(LayerType.decoder) for stage in layout.stages]
    vpp = config.virtual_pipeline_model_parallel_size or 1
    per_chunk = [_split(n, vpp, f"pipeline rank {rank}'s {n} layers over "
                                f"virtual_pipeline_model_parallel_size ({vpp})")
                 for rank, n in enumerate(_rank_layer_counts(config, pp_size))]
    counts = [per_chunk[i % pp_size] for i in range(vpp * pp_size)]
    if config.account_for_embedding_in_pipeline_split:
        counts[0] -= 1
    if config.account_for_loss_in_pipeline_split:
        counts[-1] -= 1
    if min(counts) < 0:
        raise ValueError(f"the embedding/loss stage has no room: {config.num_layers} layers over "
                         f"{vpp * pp_size} (virtual) stages; lower the pipeline size")
    return counts


def _stage_index(config, vp_stage, pp_rank, pp_size) -> int:
    vpp = config.virtual_pipeline_model_parallel_size or 1
    if vp_stage is None:
        if vpp > 1:
            raise ValueError("vp_stage must be given when virtual_pipeline_model_parallel_size is set")
        vp_stage = 0
    return vp_stage * pp_size + pp_rank


def get_num_layers_to_build(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                            pp_size: Optional[int] = None) -> int:
    """Number of transformer layers the stage (pp_rank, vp_stage) builds."""
    pp_rank, pp_size = _pp_rank_and_size(pp_rank, pp_size)
    if pp_size == 1:
        return config.num_layers
    return stage_layer_counts(config, pp_size)[_stage_index(config, vp_stage, pp_rank, pp_size)]


def get_transformer_layer_offset(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                                 pp_size: Optional[int] = None) -> int:
    """Global index of the first transformer layer the stage (pp_rank, vp_stage) builds."""
    pp_rank, pp_size = _pp_rank_and_size(pp_rank, pp_size)
    if pp_size == 1:
        return 0
    return sum(stage_layer_counts(config, pp_size)[:_stage_index(config, vp_stage, pp_rank, pp_size)])


def validate_pipeline_config(config) -> None:
    """Check the layer placement against the layer count and (virtual) pipeline sizes.

    Called from TransformerConfig.__post_init__. A layout string or list becomes a
    PipelineParallelLayerLayout; its number of virtual stages sets
    virtual_pipeline_model_parallel_size when that is None. Bad input raises a one-line ValueError.
    """
    pp = config.pipeline_model_parallel_size
    uneven = (config.num_layers_in_first_pipeline_stage is not None
              or config.num_layers_in_last_pipeline_stage is not None)
    accounts = config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split
    for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if value is not None and pp == 1:
            raise ValueError(f"{name}={value} needs pipeline_model_parallel_size > 1; unset it")
    if uneven and accounts:
        raise ValueError("num_layers_in_first/last_pipeline_stage cannot be combined with "
                         "account_for_embedding/loss_in_pipeline_split; choose one way to place layers")
    if config.pipeline_model_parallel_layout is not None:
        _validate_layout(config, uneven or accounts)
    elif pp > 1:
        stage_layer_counts(config, pp)


def _validate_layout(config, other_placement: bool) -> None:
    if other_placement:
        raise ValueError("pipeline_model_parallel_layout cannot be combined with "
                         "num_layers_in_first/last_pipeline_stage or account_for_*_in_pipeline_split")
    pp, layout = config.pipeline_model_parallel_size, config.pipeline_model_parallel_layout
    if not isinstance(layout, PipelineParallelLayerLayout):
        layout = PipelineParallelLayerLayout(layout, pp)
        object.__setattr__(config, "pipeline_model_parallel_layout", layout)
    if layout.pipeline_model_parallel_size != pp:
        raise ValueError(f"pipeline_model_parallel_layout was built for pipeline_model_parallel_size "
                         f"{layout.pipeline_model_parallel_size}, the config has {pp}; rebuild it")
    vpp = layout.virtual_pipeline_model_parallel_size
    if config.virtual_pipeline_model_parallel_size is None and vpp > 1:
        if pp == 1:
            raise ValueError(f"pipeline_model_parallel_layout has {vpp} stages but "
                             f"pipeline_model_parallel_size is 1; give one stage or raise the PP size")
        object.__setattr__(config, "virtual_pipeline_model_parallel_size", vpp)
    elif (config.virtual_pipeline_model_parallel_size or 1) != vpp:
        raise ValueError(f"pipeline_model_parallel_layout has {len(layout.stages)} stages = {pp} pipeline "
                         f"x {vpp} virtual stages, but virtual_pipeline_model_parallel_size is "
                         f"{config.virtual_pipeline_model_parallel_size}; make them agree")
    layout.validate_layer_layout(config.num_layers, config.mtp_num_layers)
