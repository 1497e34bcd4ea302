"""Megatron's hybrid layer pattern: one symbol per layer, `|` between pipeline stages.

    M  Mamba-2 layer        (norm, Mamba mixer, residual)
    G  Gated DeltaNet layer (norm, Gated DeltaNet, residual)
    *  attention layer      (norm, self-attention, residual; no MLP)
    -  MLP layer            (norm, MLP, residual)
    E  MoE layer            (norm, MoE, residual)
    |  a pipeline-stage boundary (not a layer)

"M-M*-" is five layers. The pattern's layers are the model's (`num_layers` is their count); its
`|` place them on pipeline stages, which the run turns into a pipeline layout (`pipeline_layout`),
so the model itself (and what a checkpoint records) is the pattern without them. Megatron's `D`
(DeepSeek sparse attention), `+` (multi-latent attention) and `/` (hybrid MTP depths) are refused
with one line.
"""

from dataclasses import dataclass


class Symbols:
    MAMBA = "M"
    GDN = "G"
    ATTENTION = "*"
    MLP = "-"
    MOE = "E"
    PIPE = "|"
    MTP_SEPARATOR = "/"
    VALID_LAYERS = frozenset({MAMBA, GDN, ATTENTION, MLP, MOE})


_NOT_YET = {"D": "DeepSeek sparse attention layers (D)", "+": "multi-latent attention layers (+)",
            "/": "multi-token prediction depths in the pattern (/)"}


@dataclass(frozen=True)
class HybridPattern:
    """A parsed --hybrid-layer-pattern: the layers in order, and the layers of each pipeline
    segment (one segment when the pattern has no `|`)."""

    layers: str
    segments: tuple

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def parse_hybrid_pattern(pattern: str) -> HybridPattern:
    """The layers and pipeline segments of a pattern; ValueError naming the first bad symbol."""
    if not isinstance(pattern, str) or not pattern.strip(Symbols.PIPE):
        raise ValueError(f"--hybrid-layer-pattern {pattern!r} has no layers; give one symbol per layer "
                         "(M Mamba, G Gated DeltaNet, * attention, - MLP, E MoE, | a pipeline boundary)")
    for symbol in pattern:
        if symbol in _NOT_YET:
            raise NotImplementedError(f"--hybrid-layer-pattern {pattern!r}: {_NOT_YET[symbol]} are not supported "
                                      "yet; use M, G, *, - and E layers")
        if symbol not in Symbols.VALID_LAYERS and symbol != Symbols.PIPE:
            raise ValueError(f"--hybrid-layer-pattern {pattern!r}: {symbol!r} is not a layer symbol; use M (Mamba), "
                             "G (Gated DeltaNet), * (attention), - (MLP), E (MoE) and | (pipeline boundary)")
    segments = tuple(pattern.split(Symbols.PIPE))
    if len(segments) > 1 and not all(segments):
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: a pipeline segment between '|' has no layers; "
                         "give every stage at least one layer")
    return HybridPattern(layers="".join(segments), segments=segments)


def pipeline_layout(pattern: HybridPattern):
    """Megatron's --pipeline-model-parallel-layout for the pattern's `|` (embedding on the first
    segment, loss on the last), or None without them."""
    if len(pattern.segments) == 1:
        return None
    last = len(pattern.segments) - 1
    return "|".join(("E" if i == 0 else "") + "t" * len(segment) + ("L" if i == last else "")
                    for i, segment in enumerate(pattern.segments))
