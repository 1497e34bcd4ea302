"""Megatron's hybrid layer pattern: one symbol per layer, `|` between pipeline stages.

    M  Mamba-2 layer        (norm, Mamba mixer, residual; a Gated Delta Product mixer with gdp_layers)
    G  Gated DeltaNet layer (norm, Gated DeltaNet, residual)
    *  attention layer      (norm, self-attention, residual; no MLP)
    +  multi-latent attention layer (norm, MLA, residual; with --multi-latent-attention)
    -  MLP layer            (norm, MLP, residual)
    E  MoE layer            (norm, MoE, residual)
    |  a pipeline-stage boundary (not a layer)
    /  multi-token prediction: "M*M*/M-/M-" is the model M*M* and two MTP depths, each of layers M-

"M-M*-" is five layers. The pattern's layers are the model's (`num_layers` is their count); its
`|` place them on pipeline stages, which the run turns into a pipeline layout (`pipeline_layout`),
so the model itself (and what a checkpoint records) is the pattern without them. After `/`, every
MTP depth repeats one pattern (Megatron's rule); each depth wraps its layers as a GPT MTP depth wraps
its one layer (`mtp_num_layers` is the count of depths; they sit on the last stage). Megatron's `D`
(DeepSeek sparse attention) is refused with one line.
"""

from dataclasses import dataclass


class Symbols:
    MAMBA = "M"
    GDN = "G"
    ATTENTION = "*"
    MLA = "+"
    MLP = "-"
    MOE = "E"
    PIPE = "|"
    MTP_SEPARATOR = "/"
    VALID_LAYERS = frozenset({MAMBA, GDN, ATTENTION, MLA, MLP, MOE})


_NOT_YET = {"D": "DeepSeek sparse attention layers (D)"}

# Megatron's `--spec` of a hybrid model: its module, and the stacks teratron builds (Megatron's aliases and
# its inference-optimized stacks too: the same layers) -> gdp_layers; its older Mamba module's stack is Mamba-2
HYBRID_SPECS_MODULE = "megatron.core.models.hybrid.hybrid_layer_specs"
HYBRID_STACK_SPECS = {
    "hybrid_stack_spec": False, "hybrid_inference_stack_spec": False, "mamba_stack_spec": False,
    "mamba_inference_stack_spec": False, "gdp_stack_spec": True, "gdp_inference_stack_spec": True,
    "gated_delta_product_stack_spec": True, "gated_delta_product_inference_stack_spec": True,
}
_OLDER_MAMBA_SPEC = ("megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec")


def gdp_layers_of_spec(spec) -> bool:
    """Megatron's `--spec MODULE NAME` (None: not given) -> gdp_layers; ValueError for other specs."""
    if spec is None or tuple(spec) == _OLDER_MAMBA_SPEC:
        return False
    if len(spec) == 2 and spec[0] == HYBRID_SPECS_MODULE and spec[1] in HYBRID_STACK_SPECS:
        return HYBRID_STACK_SPECS[spec[1]]
    names = " or ".join(f"'{HYBRID_SPECS_MODULE} {name}'" for name in ("gdp_stack_spec", "hybrid_stack_spec"))
    raise ValueError(f"--spec {' '.join(spec)}: teratron builds its layers without Megatron's specs and takes only "
                     f"{names}; drop it (build custom layers with ModuleSpec in Python)")


@dataclass(frozen=True)
class HybridPattern:
    """A parsed --hybrid-layer-pattern: the layers in order, the layers of each pipeline segment
    (one segment when the pattern has no `|`), and each MTP depth's layers with the depth count."""

    layers: str
    segments: tuple
    mtp_layers: str = ""
    mtp_depths: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def model_pattern(self) -> str:
        """What the config records: the layers, then each MTP depth's after '/' (no '|')."""
        return self.layers + f"{Symbols.MTP_SEPARATOR}{self.mtp_layers}" * self.mtp_depths


def parse_hybrid_pattern(pattern: str) -> HybridPattern:
    """The layers and pipeline segments of a pattern; ValueError naming the first bad symbol."""
    if not isinstance(pattern, str) or not pattern.strip(Symbols.PIPE):
        raise ValueError(f"--hybrid-layer-pattern {pattern!r} has no layers; give one symbol per layer (M Mamba, "
                         "G Gated DeltaNet, * attention, + multi-latent attention, - MLP, E MoE, | a pipeline "
                         "boundary)")
    for symbol in pattern:
        if symbol in _NOT_YET:
            raise NotImplementedError(f"--hybrid-layer-pattern {pattern!r}: {_NOT_YET[symbol]} are not supported "
                                      "yet; use M, G, *, +, - and E layers")
        if symbol not in Symbols.VALID_LAYERS and symbol not in (Symbols.PIPE, Symbols.MTP_SEPARATOR):
            raise ValueError(f"--hybrid-layer-pattern {pattern!r}: {symbol!r} is not a layer symbol; use M (Mamba), "
                             "G (Gated DeltaNet), * (attention), + (multi-latent attention), - (MLP), E (MoE), | "
                             "(pipeline boundary) and / (multi-token prediction depths)")
    main, *depths = pattern.split(Symbols.MTP_SEPARATOR)
    if depths and (not all(depths) or len(set(depths)) > 1 or Symbols.PIPE in depths[0]):
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: every multi-token-prediction depth after '/' must "
                         "repeat one non-empty pattern without '|' (e.g. 'M*M*/M-/M-')")
    if not main.strip(Symbols.PIPE):
        raise ValueError(f"--hybrid-layer-pattern {pattern!r} has no decoder layers before '/'; give the model's "
                         "layers first (e.g. 'M*M*/M-')")
    segments = tuple(main.split(Symbols.PIPE))
    if len(segments) > 1 and not all(segments):
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: a pipeline segment between '|' has no layers; "
                         "give every stage at least one layer")
    return HybridPattern(layers="".join(segments), segments=segments, mtp_layers=depths[0] if depths else "",
                         mtp_depths=len(depths))


def mtp_depth_layer_numbers(num_layers: int, layers_per_depth: int, depth: int) -> range:
    """The global (1-based) layer numbers of MTP depth `depth` (1-based): they continue past the
    decoder's, depth d's i-th layer num_layers + (d - 1) k + i (k layers a depth; with k = 1, GPT's
    MTP layer numbers)."""
    first = num_layers + (depth - 1) * layers_per_depth + 1
    return range(first, first + layers_per_depth)


def pipeline_layout(pattern: HybridPattern):
    """Megatron's --pipeline-model-parallel-layout for the pattern's `|` (embedding on the first
    segment, MTP depths and loss on the last), or None without them."""
    if len(pattern.segments) == 1:
        return None
    last = len(pattern.segments) - 1
    return "|".join(("E" if i == 0 else "") + "t" * len(segment) + ("m" * pattern.mtp_depths + "L" if i == last else "")
                    for i, segment in enumerate(pattern.segments))
