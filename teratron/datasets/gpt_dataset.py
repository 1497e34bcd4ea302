"""GPT pretraining samples: documents concatenated and cut into `sequence_length + 1` token windows.

Three indices, built as Megatron builds them and cached on disk:
- document index: the split's documents repeated `num_epochs` times, shuffled;
- sample index: where each window starts (position in the document index, token offset);
- shuffle index: a permutation of the windows (the last, partial epoch shuffled on its own).
"""

import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy
import torch

from teratron.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from teratron.datasets.helpers import build_sample_idx
from teratron.datasets.indexed_dataset import IndexedDataset
from teratron.datasets.megatron_dataset import MegatronDataset, load_or_build_indices
from teratron.datasets.utils import Split
from teratron.datasets.vocab_check import check_token_ids

logger = logging.getLogger(__name__)

_PAD_TOKEN_ID = -1
# A final epoch that would give fewer than this share of an epoch's samples is shuffled on its
# own, so its few samples are not spread over (and diluting) the full epochs before it.
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    reset_position_ids: bool = False
    """Restart position ids after every end-of-document token."""

    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens (block-diagonal causal mask)."""

    eod_mask_loss: bool = False
    """Give no loss to positions whose input token is the end-of-document token."""

    create_attention_mask: bool = True
    """Return an explicit attention mask (off when the attention kernel makes its own). Off with
    reset_attention_mask, samples carry their documents' boundaries instead (`cu_seqlens`, see
    `document_boundaries`), which the training step turns into PackedSeqParams."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the final, shorter-than-sequence_length validation sample (else pad it)."""

    add_extra_token_to_sequence: bool = True
    """Draw sequence_length + 1 tokens so inputs and labels both have sequence_length tokens."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig.tokenizer is required (its eod marks documents)")
        if self.sequence_length < 2:
            raise ValueError(f"sequence_length must be >= 2 for GPT samples (got {self.sequence_length})")
        self._check_eod()

    def _check_eod(self) -> None:
        """The options that find documents by their end-of-document token need the tokenizer's."""
        needs_eod = {"--reset-position-ids": self.reset_position_ids,
                     "--reset-attention-mask": self.reset_attention_mask,
                     "--eod-mask-loss": self.eod_mask_loss, "--mock-data": self.mock}
        users = [flag for flag, on in needs_eod.items() if on]
        if not users:
            return
        try:
            self.tokenizer.eod  # noqa: B018 (a tokenizer without one raises AttributeError)
        except AttributeError as err:
            raise ValueError(f"{', '.join(users)}: {err}; or drop {' and '.join(users)}") from None


class GPTDataset(MegatronDataset):
    """Samples of `sequence_length` tokens over the documents `indexed_indices` of an
    `IndexedDataset`; `num_samples=None` means one epoch."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: Optional[str],
                 indexed_indices: numpy.ndarray, num_samples: Optional[int], index_split: Split,
                 config: GPTDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        if len(indexed_indices) == 0 or self._get_num_tokens_per_epoch() < 2:
            raise ValueError(f"{dataset_path}: the {index_split.name} split has no tokens; "
                             f"give it a larger --split share or more data")
        self._causal_mask = None
        self.document_index, self.sample_index, self.shuffle_index = (
            self._build_document_sample_shuffle_indices())

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        return low_level_dataset.sequence_lengths.shape[0]

    @classmethod
    def build_low_level_dataset(cls, dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """The `.bin/.idx` pair, its layout checked on open and its token ids against the
        tokenizer's vocabulary (`vocab_check`), before any sample is drawn."""
        dataset = IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)
        check_token_ids(dataset, config.tokenizer.vocab_size, cls._cache_dir(config, dataset_path))
        return dataset

    @classmethod
    def _cache_dir(cls, config: GPTDatasetConfig, path_prefix: Optional[str]) -> Optional[str]:
        """Where the indices of the dataset at `path_prefix` are cached (Megatron's default: a
        `cache` folder under the prefix; mock data: only in `path_to_cache`)."""
        if config.path_to_cache is not None or config.mock:
            return config.path_to_cache
        return f"{path_prefix}/cache/{cls.__name__}_indices"

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MegatronDataset._key_config_attributes() + [
            "add_extra_token_to_sequence", "drop_last_partial_validation_sequence"]

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """`idx=None` gives a batch-padding sample: real tokens, no loss."""
        text, num_real = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        text = torch.from_numpy(text)
        if self.config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
            num_real_labels = num_real - 1
        else:
            tokens, labels = text, torch.roll(text, shifts=-1, dims=0)
            num_real_labels = num_real - 1  # the last label wraps around: no target there
        attention_mask, loss_mask, position_ids = self._masks_and_position_ids(tokens)
        boundaries = None
        if self.config.reset_attention_mask and not self.config.create_attention_mask:
            boundaries = document_boundaries(tokens, self.config.tokenizer.eod)
        # Padding past the data: id 0 so the embedding can look it up, and no loss.
        tokens[num_real:] = 0
        labels[num_real_labels:] = 0
        loss_mask[max(num_real_labels, 0):] = 0.0
        if idx is None:
            loss_mask.zero_()
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        if boundaries is not None:
            sample["cu_seqlens"] = boundaries
        return sample

    def _masks_and_position_ids(self, tokens: torch.Tensor):
        c = self.config
        if not (c.reset_position_ids or c.reset_attention_mask or c.eod_mask_loss):
            if c.create_attention_mask and self._causal_mask is None:
                # Plain causal: no EOD is looked for (the tokenizer need not have one).
                self._causal_mask = get_ltor_masks_and_position_ids(
                    tokens, _PAD_TOKEN_ID, False, False, False, True)[0]
            loss_mask = torch.ones(tokens.numel(), dtype=torch.float)
            position_ids = torch.arange(tokens.numel(), dtype=torch.long)
            return (self._causal_mask if c.create_attention_mask else None), loss_mask, position_ids
        return get_ltor_masks_and_position_ids(tokens, c.tokenizer.eod, c.reset_position_ids,
                                               c.reset_attention_mask, c.eod_mask_loss,
                                               c.create_attention_mask)

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[numpy.ndarray, int]:
        """The `sequence_length + extra` token ids of sample `idx` (int64, padded past the data
        with -1, which no EOD matches) and how many of them are real."""
        idx = self.shuffle_index[idx]
        doc_beg, offset_beg = (int(v) for v in self.sample_index[idx])
        doc_end, offset_end = (int(v) for v in self.sample_index[idx + 1])
        extra = int(self.config.add_extra_token_to_sequence)
        if doc_beg == doc_end:
            parts = [self.dataset.get(self.document_index[doc_beg], offset=offset_beg,
                                      length=offset_end - offset_beg + extra)]
        else:
            parts = []
            for i in range(doc_beg, doc_end + 1):
                offset = offset_beg if i == doc_beg else 0
                length = offset_end + extra if i == doc_end else None
                parts.append(self.dataset.get(self.document_index[i], offset=offset, length=length))
        window = self.config.sequence_length + extra
        text = numpy.full(window, _PAD_TOKEN_ID, dtype=numpy.int64)
        num_real = sum(map(len, parts))
        text[:num_real] = numpy.concatenate(parts)
        return text, num_real

    def _build_document_sample_shuffle_indices(self):
        path_to_cache = self._cache_dir(self.config, None if self.config.mock else self.dataset.path_prefix)
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        arrays, self.built_anew_on_cache_miss = load_or_build_indices(
            path_to_cache, base, self.unique_description,
            ["document_index", "sample_index", "shuffle_index"], self._build_indices)
        return arrays

    def _build_indices(self) -> List[numpy.ndarray]:
        sequence_length = self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        num_tokens_per_epoch = self._get_num_tokens_per_epoch()
        num_epochs = self._get_num_epochs(num_tokens_per_epoch)

        separate_final_epoch = False
        if num_epochs > 1:
            num_samples_sans_final_epoch = ((num_epochs - 1) * num_tokens_per_epoch - extra) // sequence_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (num_tokens_per_epoch - extra) // sequence_length
            assert 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1
            separate_final_epoch = num_samples_from_final_epoch < int(
                _SEPARATE_FINAL_EPOCH_THRESHOLD * num_samples_per_epoch)

        random_state = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(self.indices, num_epochs, random_state, separate_final_epoch)

        drop_last = True
        if self.index_split == Split.valid:
            drop_last = self.config.drop_last_partial_validation_sequence
        sample_index = build_sample_idx(self.dataset.sequence_lengths, document_index, sequence_length,
                                        num_epochs, num_tokens_per_epoch, drop_last, bool(extra))

        num_samples_total = sample_index.shape[0] - 1
        first = num_samples_sans_final_epoch if separate_final_epoch else num_samples_total
        shuffle_index = _build_shuffle_index(first, num_samples_total, random_state)
        logger.info("%s %s: %d samples over %d epoch(s)", type(self).__name__,
                    self.index_split.name, num_samples_total, num_epochs)
        return [document_index, sample_index, shuffle_index]

    def _get_num_tokens_per_epoch(self) -> int:
        return int(numpy.sum(self.dataset.sequence_lengths[self.indices], dtype=numpy.int64))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        """Fewest epochs whose tokens cover `num_samples` windows."""
        if self.num_samples is None:
            return 1
        needed = self.num_samples * self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        return max(1, math.ceil(needed / num_tokens_per_epoch))


def _build_document_index(documents: numpy.ndarray, num_epochs: int,
                          random_state: numpy.random.RandomState,
                          separate_final_epoch: bool) -> numpy.ndarray:
    """`documents` repeated `num_epochs` times and shuffled (the final epoch apart if asked)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents, dtype=numpy.int32), num_epochs)
        random_state.shuffle(document_index)
        return document_index
    first = _build_document_index(documents, num_epochs - 1, random_state, False)
    last = _build_document_index(documents, 1, random_state, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(num_samples: int, total_size: int,
                         random_state: numpy.random.RandomState) -> numpy.ndarray:
    """A shuffle of [0, num_samples), followed by a separate shuffle of [num_samples, total_size)."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(num_samples, dtype=dtype)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    random_state.shuffle(last)
    return numpy.concatenate((first, last))


def get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool,
                                    create_attention_mask: bool):
    """Left-to-right masks for one sample `data` [s].

    Returns attention_mask (bool [1, s, s], True = masked out; None unless asked), loss_mask
    (float [s]) and position_ids (long [s]). With the resets, a document starts after each EOD:
    its positions restart at 0 and it cannot attend to the tokens before it."""
    s = data.numel()
    is_eod = data == eod_token
    # Document number of each position: EODs strictly before it (an EOD ends its own document).
    segment = torch.cumsum(is_eod.long(), 0) - is_eod.long()

    loss_mask = torch.ones(s, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    positions = torch.arange(s, dtype=torch.long)
    position_ids = positions.clone()
    if reset_position_ids:
        # Start of each position's document: one past the latest EOD before it.
        eod_next = torch.where(is_eod, positions + 1, torch.zeros_like(positions))
        starts = torch.cummax(eod_next, 0).values
        position_ids = positions - torch.cat([positions.new_zeros(1), starts[:-1]])

    attention_mask = None
    if create_attention_mask:
        allowed = torch.ones(s, s, dtype=torch.bool).tril()
        if reset_attention_mask:
            allowed &= segment[:, None] == segment[None, :]
        attention_mask = (~allowed).unsqueeze(0)
    return attention_mask, loss_mask, position_ids


def document_boundaries(data: torch.Tensor, eod_token: int) -> torch.Tensor:
    """int32 [s + 1]: where the documents of sample `data` [s] start (0, and after each EOD but
    the last token), then s, then -1 up to s + 1 entries (one size for every sample, so samples
    batch): Megatron's -1-padded cu_seqlens of one sample. The documents are those of
    `get_ltor_masks_and_position_ids(reset_attention_mask=True)`."""
    s = data.numel()
    starts = torch.nonzero(data[:-1] == eod_token).flatten() + 1
    edges = torch.cat([starts.new_zeros(1), starts, starts.new_tensor([s])])
    boundaries = torch.full((s + 1,), -1, dtype=torch.int32)
    boundaries[:edges.numel()] = edges
    return boundaries


class MockGPTLowLevelDataset:
    """Megatron's synthetic documents: 100000 of them, lengths uniform in [1, 4096) from a fixed
    seed, document i = `1, 2, ..., len - 1, eod`. Token ids wrap below the vocabulary size when it
    is smaller than the documents (same ids as Megatron's otherwise)."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096
    content_signature = None  # no files: nothing to key the index cache by

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        rng = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size,
                                             dtype=numpy.int32)
        vocab_size = getattr(tokenizer, "vocab_size", None)
        self._id_range = (vocab_size - 1) if vocab_size and vocab_size > 1 else None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        body = numpy.arange(int(self.sequence_lengths[idx]) - 1, dtype=numpy.int64)
        if self._id_range is not None:
            body %= self._id_range
        return numpy.concatenate([body + 1, [self.tokenizer.eod]]).astype(numpy.int64)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset: offset + length]


class MockGPTDataset(GPTDataset):
    """`GPTDataset` over `MockGPTLowLevelDataset` (`--mock-data`); deterministic, no files."""

    def __init__(self, dataset: MockGPTLowLevelDataset, dataset_path: Optional[str],
                 indices: numpy.ndarray, num_samples: Optional[int], index_split: Split,
                 config: GPTDatasetConfig) -> None:
        assert config.mock
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)
