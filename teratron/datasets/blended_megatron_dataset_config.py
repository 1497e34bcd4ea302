"""`BlendedMegatronDatasetConfig`: what every dataset of the blend builder is configured by."""

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from teratron.datasets.utils import (
    Blend,
    Split,
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)


@dataclass
class BlendedMegatronDatasetConfig:
    random_seed: int
    """Seed of every shuffle made while building the dataset indices."""

    sequence_length: int
    """Tokens per sample (the model's input length)."""

    blend: Optional[Blend] = None
    """(prefixes, weights or None), e.g. (["a", "b"], [0.3, 0.7]); all splits are drawn from it by
    `split`. None weights mean "in proportion to the dataset sizes". Not with `blend_per_split`."""

    blend_per_split: Optional[List[Optional[Blend]]] = None
    """One blend per split (train, valid, test), or None for a split to skip. Not with `blend`."""

    split: Optional[str] = None
    """Train/valid/test shares of every dataset of `blend`, e.g. "949,50,1"."""

    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)
    """The [begin, end) fraction of the documents each split takes; derived from `split`."""

    path_to_cache: Optional[str] = None
    """Directory for the dataset index caches (default: beside each dataset)."""

    mmap_bin_files: bool = True
    """Memory-map the .bin files (else read them with file reads)."""

    mock: bool = False
    """Synthetic data (`--mock-data`); also set when neither `blend` nor `blend_per_split` is given."""

    tokenizer: Optional[Any] = None
    """The tokenizer (its `eod` marks document ends)."""

    mid_level_dataset_surplus: float = 0.005
    """Extra samples each blended dataset builds beyond its share, so the greedy blend, which can
    run a few samples ahead of a dataset's share, never reads past its end."""

    def __post_init__(self) -> None:
        if self.sequence_length is None or self.sequence_length < 1:
            raise ValueError(f"sequence_length must be >= 1 (got {self.sequence_length}); "
                             f"set --seq-length")
        has_blend_per_split = self.blend_per_split is not None and any(self.blend_per_split)
        if self.mock and (self.blend is not None or has_blend_per_split):
            raise ValueError("--mock-data replaces the data paths; drop --data-path / "
                             "--train/valid/test-data-path or --mock-data")
        if has_blend_per_split:
            if self.blend is not None:
                raise ValueError("give either --data-path (blend) or --train/valid/test-data-path "
                                 "(blend_per_split), not both")
            if self.split is not None:
                raise ValueError("--split applies to --data-path only; drop it when giving "
                                 "--train/valid/test-data-path")
            if len(self.blend_per_split) != len(Split):
                raise ValueError(f"blend_per_split needs {len(Split)} entries (train, valid, test), "
                                 f"got {len(self.blend_per_split)}")
            for blend in self.blend_per_split:
                _check_blend(blend)
            return
        if self.blend is not None:
            _check_blend(self.blend)
            if self.split is None:
                raise ValueError("split is required with a blend; set --split, e.g. 949,50,1")
        else:
            self.mock = True
            self.split = "1,1,1"  # Megatron's mock split, whatever --split says
        self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))


def _check_blend(blend: Optional[Blend]) -> None:
    if blend is None:
        return
    prefixes, weights = blend
    if weights is not None and len(weights) != len(prefixes):
        raise ValueError(f"blend has {len(prefixes)} prefixes but {len(weights)} weights; "
                         f"give one weight per prefix")
