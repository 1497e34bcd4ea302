"""Which transformer layers each pipeline stage builds.

TransformerBlock calls `get_num_layers_to_build` and `get_transformer_layer_offset`; nothing else
decides layer placement. All placements reduce to one table: the number of decoder layers of
each (virtual) stage in flat order i = vp_stage * pp + pp_rank, whose prefix sums are the offsets.
The table comes from, in order of precedence:
- `pipeline_model_parallel_layout`, a PipelineParallelLayerLayout (below);
- `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`: those ranks get the
  given counts, the other ranks split the rest evenly;
- an even split, where `account_for_embedding_in_pipeline_split` /
  `account_for_loss_in_pipeline_split` count the embedding / loss as one more layer of the first /
  last stage.
With virtual stages each rank's layers are split evenly over its model chunks.

PipelineParallelLayerLayout is an explicit list of the layers (LayerType) each (virtual) pipeline
stage holds. A layout is a string or a list of stages. String grammar (commas and spaces are
cosmetic):

    layout := item*                 stages are separated by '|'
    item   := atom ('*' N)?         repeat the atom N times
    atom   := 'E' | 't' | 'm' | 'L' | '|' | '(' layout ')'

E = embedding, t = transformer decoder layer, m = multi-token-prediction layer, L = loss (the
final norm and output layer). 'Et*3|(tt|)*2,tL' is [[E,t,t,t], [t,t], [t,t], [t,L]]. A list
gives the stages directly, each a list of 'E'/'embedding', 't'/'decoder', 'm'/'mtp', 'L'/'loss'
or LayerType members. The MTP layers all sit in the last stage, after its decoder layers and
before 'L' (without a layout they go there too: `get_mtp_num_layers_to_build`).

Stage i of the flat list is virtual stage a = i // pp on pipeline rank b = i % pp (i = a * pp + b),
so the layer order is vpp0 pp0, vpp0 pp1, ..., vpp0 pp(-1), vpp1 pp0, ... and the number of
virtual stages is len(stages) / pp.

This module sits below the transformer (it needs only the topology), so TransformerConfig
validates placement with it and everything above reads it; Megatron's module paths re-export its
names (`transformer.pipeline_parallel_layer_layout`, `transformer.enums.LayerType`).
"""

import enum
from typing import Optional, Union

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.topology import resolve_pg_collection


class LayerType(enum.Enum):
    """The entries of a pipeline layout: which kind of layer a stage holds."""

    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


_LETTERS = {"E": LayerType.embedding, "t": LayerType.decoder, "m": LayerType.mtp, "L": LayerType.loss}
_COSMETIC = ", \t\n"


class _Parser:
    """Recursive descent over the layout string; expands repetitions into flat text."""

    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"pipeline_model_parallel_layout {self.text!r}: {what} at position "
                          f"{self.pos}; use E, t, m, L, '|', (...) and x*N or (...)*N")

    def peek(self) -> str:
        while self.pos < len(self.text) and self.text[self.pos] in _COSMETIC:
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def sequence(self) -> str:
        out = []
        while self.peek() not in ("", ")"):
            out.append(self.item())
        return "".join(out)

    def item(self) -> str:
        char = self.peek()
        if char == "(":
            self.pos += 1
            atom = self.sequence()
            if self.peek() != ")":
                raise self.error("unclosed '('")
            self.pos += 1
        elif char in _LETTERS or char == "|":
            atom = char
            self.pos += 1
        else:
            raise self.error(f"unexpected {char!r}")
        if self.peek() != "*":
            return atom
        self.pos += 1
        self.peek()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isdigit():
            self.pos += 1
        if start == self.pos:
            raise self.error("'*' must be followed by a repeat count")
        return atom * int(self.text[start:self.pos])

    def parse(self) -> str:
        flat = self.sequence()
        if self.peek() == ")":
            raise self.error("unmatched ')'")
        return flat


def _layer_type(entry) -> LayerType:
    if isinstance(entry, LayerType):
        return entry
    if isinstance(entry, str):
        name = entry.strip()
        if name in _LETTERS:
            return _LETTERS[name]
        if name.lower() in LayerType.__members__:
            return LayerType[name.lower()]
    raise ValueError(f"pipeline_model_parallel_layout: unknown layer {entry!r}; use 'E'/'embedding', "
                     f"'t'/'decoder', 'm'/'mtp' or 'L'/'loss'")


class PipelineParallelLayerLayout:
    """The parsed layout: `layout[pp_rank][vp_stage]` is the list of LayerType that stage holds."""

    def __init__(self, layout: Union[str, list], pipeline_model_parallel_size: int):
        self.input_data = layout
        if isinstance(layout, str):
            stages = self.parse_str_to_list(layout)
        elif isinstance(layout, (list, tuple)) and all(isinstance(s, (list, tuple)) for s in layout):
            stages = [[_layer_type(entry) for entry in stage] for stage in layout]
        else:
            raise ValueError(f"pipeline_model_parallel_layout must be a string or a list of lists of "
                             f"layers, got {layout!r}")
        pp = pipeline_model_parallel_size
        if not stages or len(stages) % pp:
            raise ValueError(f"pipeline_model_parallel_layout has {len(stages)} stages, which is not a "
                             f"multiple of pipeline_model_parallel_size ({pp}); give pp x vpp stages")
        self.pipeline_model_parallel_size = pp
        self.virtual_pipeline_model_parallel_size = len(stages) // pp
        self.stages = stages
        self.layout = [[stages[v * pp + p] for v in range(self.virtual_pipeline_model_parallel_size)]
                       for p in range(pp)]
        self.flatten_layout = [layer for stage in stages for layer in stage]

    @staticmethod
    def parse_str_to_list(layout_str: str) -> list:
        """'Et*3|(tt|)*2,tL' -> [[E,t,t,t], [t,t], [t,t], [t,L]] (as LayerType members)."""
        flat = _Parser(layout_str).parse()
        return [[_LETTERS[c] for c in stage] for stage in flat.split("|")]

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        """Number of pp x vpp stages a layout string describes."""
        return len(PipelineParallelLayerLayout.parse_str_to_list(layout))

    def __repr__(self) -> str:
        return str(self.input_data)

    def __eq__(self, other) -> bool:
        return (isinstance(other, PipelineParallelLayerLayout) and self.stages == other.stages
                and self.pipeline_model_parallel_size == other.pipeline_model_parallel_size)

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: Optional[int]) -> None:
        """Raise a one-line ValueError unless the layout holds exactly the model's layers."""
        flat, last = self.flatten_layout, len(self.stages) - 1
        counts = {kind: flat.count(kind) for kind in LayerType}
        if counts[LayerType.encoder]:
            raise ValueError("pipeline_model_parallel_layout names encoder layers; GPT layouts hold "
                             "only E, t, m and L")
        if counts[LayerType.embedding] != 1 or self.stages[0][:1] != [LayerType.embedding]:
            raise ValueError(f"pipeline_model_parallel_layout {self} must hold the embedding 'E' exactly "
                             f"once, first in the first stage (it has {counts[LayerType.embedding]})")
        if counts[LayerType.loss] != 1 or self.stages[last][-1:] != [LayerType.loss]:
            raise ValueError(f"pipeline_model_parallel_layout {self} must hold the loss 'L' exactly once, "
                             f"last in the last stage (it has {counts[LayerType.loss]})")
        if counts[LayerType.decoder] != num_layers:
            raise ValueError(f"pipeline_model_parallel_layout {self} names {counts[LayerType.decoder]} "
                             f"decoder layers 't' but num_layers is {num_layers}; make them match")
        if counts[LayerType.mtp] != (mtp_num_layers or 0):
            raise ValueError(f"pipeline_model_parallel_layout {self} names {counts[LayerType.mtp]} mtp "
                             f"layers 'm' but mtp_num_layers is {mtp_num_layers}; make them match")
        if counts[LayerType.mtp] and LayerType.decoder in flat[flat.index(LayerType.mtp):]:
            raise ValueError(f"pipeline_model_parallel_layout {self} places decoder layers after an "
                             f"mtp layer; put 'm' after every 't'")
        if self.stages[last].count(LayerType.mtp) != counts[LayerType.mtp]:
            raise ValueError(f"pipeline_model_parallel_layout {self} places mtp layers 'm' outside the last "
                             f"stage; the MTP layers share the loss's stage: put every 'm' before the 'L'")

    def _index(self, vp_stage: Optional[int], pp_rank: Optional[int]) -> int:
        """Flat stage index i = vp_stage * pp + pp_rank (pp_rank defaults to this rank's)."""
        if pp_rank is None:
            pp_rank = get_pg_rank(resolve_pg_collection().pp)
        if vp_stage is None:
            if self.virtual_pipeline_model_parallel_size > 1:
                raise ValueError("vp_stage must be given for a layout with virtual pipeline stages")
            vp_stage = 0
        return vp_stage * self.pipeline_model_parallel_size + pp_rank

    def get_num_layers_to_build(self, layer_type: LayerType = LayerType.decoder,
                                vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> int:
        """Number of `layer_type` layers in stage (pp_rank, vp_stage)."""
        return self.stages[self._index(vp_stage, pp_rank)].count(layer_type)

    def get_layer_offset(self, layer_type: LayerType = LayerType.decoder,
                         vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> int:
        """Number of `layer_type` layers in the stages before (pp_rank, vp_stage)."""
        index = self._index(vp_stage, pp_rank)
        return sum(stage.count(layer_type) for stage in self.stages[:index])

    def get_layer_id_list(self, layer_type: LayerType = LayerType.decoder,
                          vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> list:
        """Global indices of the `layer_type` layers in stage (pp_rank, vp_stage)."""
        offset = self.get_layer_offset(layer_type, vp_stage, pp_rank)
        return list(range(offset, offset + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))

    def pretty_repr(self) -> str:
        """One line per pipeline rank, one column per virtual stage, e.g. 'PP rank 0: E,t*2 | t'."""
        lines = []
        for p, row in enumerate(self.layout):
            cells = [_stage_repr(stage) for stage in row]
            lines.append(f"PP rank {p}: " + " | ".join(cells))
        return "\n".join(lines)


def _stage_repr(stage: list) -> str:
    runs = []
    for layer in stage:
        if runs and runs[-1][0] == layer:
            runs[-1][1] += 1
        else:
            runs.append([layer, 1])
    letter = {v: k for k, v in _LETTERS.items()}
    return ",".join(letter[t] + (f"*{n}" if n > 1 else "") for t, n in runs) or "(empty)"


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


def get_mtp_num_layers_to_build(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                                pp_size: Optional[int] = None) -> int:
    """Number of multi-token-prediction layers the stage (pp_rank, vp_stage) builds: all of them on
    the last (virtual) stage, the one holding the loss, none elsewhere (a layout's 'm' must be there)."""
    if not config.mtp_num_layers:
        return 0
    pp_rank, pp_size = _pp_rank_and_size(pp_rank, pp_size)
    vpp = config.virtual_pipeline_model_parallel_size or 1
    last = _stage_index(config, vp_stage, pp_rank, pp_size) == vpp * pp_size - 1
    return config.mtp_num_layers if last else 0


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
