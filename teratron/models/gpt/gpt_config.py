"""GPTModelConfig: everything a GPTModel is built from, in one frozen value.

The transformer (`TransformerConfig`, Megatron's API) plus what sits around it: the vocabulary,
the position encoding and whether the output layer shares the input embedding. `build_gpt_model`
(teratron.models.gpt.builder) turns it into model chunks for any layout; `teratron train`,
`convert`, `merge`, `estimate` and the inference engine all build their models from it.
"""

from dataclasses import dataclass, field, fields

from teratron.models.gpt.gpt_model import POSITION_EMBEDDING_TYPES
from teratron.tensor_parallel.utils import pad_vocab_size
from teratron.transformer.transformer_config import YARN_FIELDS, TransformerConfig


@dataclass(frozen=True)
class GPTModelConfig:
    transformer: TransformerConfig
    vocab_size: int
    """Real token ids (the tokenizer's vocabulary); the ids past it are padding."""
    max_position_embeddings: int
    """Rows of the learned position table; for RoPE, the longest sequence the model expects."""
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    """Llama 3.x RoPE scaling of plain RoPE (Megatron's GPTModel `rope_scaling`); see
    teratron.transformer.rope."""
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    """Llama 3.x scaling's bounds (teratron's: Megatron fixes Llama 3.1's 1, 4 and 8192)."""
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    share_embeddings_and_output_weights: bool = True
    make_vocab_size_divisible_by: int = 128
    padded_vocab_size: int = field(default=None)
    """Rows of the embedding and output layer: `vocab_size` padded to a multiple of
    make_vocab_size_divisible_by x TP (Megatron's padding) unless given."""

    def __post_init__(self):
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type={self.position_embedding_type!r}; use one of "
                             f"{POSITION_EMBEDDING_TYPES}")
        for name in ("vocab_size", "max_position_embeddings", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.transformer.mtp_num_layers and self.position_embedding_type == "learned_absolute":
            raise ValueError("mtp_num_layers needs position_embedding_type 'rope' or 'none' (as in Megatron), "
                             "not 'learned_absolute'")
        if self.transformer.no_rope_freq is not None and self.position_embedding_type in ("learned_absolute", "none"):
            raise ValueError(f"no_rope_freq picks layers that skip RoPE, but position_embedding_type="
                             f"{self.position_embedding_type!r}; use position_embedding_type='rope'")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        self._check_yarn()
        self._check_rope_scaling()
        self._check_hybrid_pattern()
        if self.padded_vocab_size is None:
            padded = pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by,
                                    self.transformer.tensor_model_parallel_size)
            object.__setattr__(self, "padded_vocab_size", padded)
        elif self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size ({self.padded_vocab_size}) is smaller than vocab_size "
                             f"({self.vocab_size})")

    def _check_hybrid_pattern(self):
        """A hybrid model's pattern has valid symbols, one per layer."""
        pattern = self.transformer.hybrid_layer_pattern
        if pattern is None:
            return
        from teratron.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern

        layers = parse_hybrid_pattern(pattern).num_layers
        if layers != self.transformer.num_layers:
            raise ValueError(f"hybrid_layer_pattern has {layers} layers but num_layers is "
                             f"{self.transformer.num_layers}; make them agree (from the command line the pattern "
                             "alone sets them)")

    def _check_yarn(self):
        """The transformer's yarn_* fields are plain attention's YaRN: they need
        position_embedding_type 'yarn', which rotates every channel; MLA has its own (rope_type)."""
        t = self.transformer
        if self.position_embedding_type == "yarn":
            if t.multi_latent_attention:
                raise ValueError("position_embedding_type='yarn' is the YaRN of plain attention; multi-latent "
                                 "attention has its own (rope_type='yarn'): use position_embedding_type='rope'")
            if self.rotary_percent != 1.0:
                raise ValueError(f"position_embedding_type='yarn' rotates every channel; rotary_percent "
                                 f"{self.rotary_percent} must be 1.0")
            return
        defaults = {f.name: f.default for f in fields(TransformerConfig)}
        changed = [name for name in YARN_FIELDS if getattr(t, name) != defaults[name]]
        if changed:
            raise ValueError(f"{changed[0]}={getattr(t, changed[0])!r} is set but position_embedding_type="
                             f"{self.position_embedding_type!r}; use position_embedding_type='yarn'")

    def _check_rope_scaling(self):
        if not self.rope_scaling:
            return
        if self.position_embedding_type != "rope" or self.transformer.multi_latent_attention:
            raise ValueError(f"rope_scaling (Llama 3.x) scales plain RoPE; it needs position_embedding_type='rope' "
                             f"without multi-latent attention, got {self.position_embedding_type!r}")
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        if not high > low > 0:
            raise ValueError(f"rope_scaling_high_freq_factor={high} must exceed rope_scaling_low_freq_factor={low}, "
                             "which must be positive")
        if self.rope_scaling_factor <= 0 or self.rope_scaling_original_max_position_embeddings < 1:
            raise ValueError(f"rope_scaling_factor={self.rope_scaling_factor} and rope_scaling_original_max_position_"
                             f"embeddings={self.rope_scaling_original_max_position_embeddings} must be positive")
