"""PipelineParallelLayerLayout: an explicit list of the layers each (virtual) pipeline stage holds.

A layout is a string or a list of stages. String grammar (commas and spaces are cosmetic):

    layout := item*                 stages are separated by '|'
    item   := atom ('*' N)?         repeat the atom N times
    atom   := 'E' | 't' | 'm' | 'L' | '|' | '(' layout ')'

E = embedding, t = transformer decoder layer, m = multi-token-prediction layer, L = loss (the
final norm and output layer). 'Et*3|(tt|)*2,tL' is [[E,t,t,t], [t,t], [t,t], [t,L]]. A list
gives the stages directly, each a list of 'E'/'embedding', 't'/'decoder', 'm'/'mtp', 'L'/'loss'
or LayerType members.

Stage i of the flat list is virtual stage a = i // pp on pipeline rank b = i % pp (i = a * pp + b),
so the layer order is vpp0 pp0, vpp0 pp1, ..., vpp0 pp(-1), vpp1 pp0, ... and the number of
virtual stages is len(stages) / pp.
"""

from typing import Optional, Union

from teratron.process_groups import get_pg_rank
from teratron.topology import resolve_pg_collection
from teratron.transformer.enums import LayerType

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
