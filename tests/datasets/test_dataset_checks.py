"""Datasets are checked when a run builds them: every token id below the tokenizer's vocabulary
(a scan cached by the files' size and mtime), and the sample-index cache keyed by the dataset's
content, so a dataset written again at the same prefix never reuses stale indices."""

import json
import os

import numpy
import pytest

from teratron import cli
from teratron.datasets import vocab_check
from teratron.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from teratron.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from teratron.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


class Tokenizer:
    def __init__(self, vocab_size, eod=0):
        self.vocab_size, self.eod = vocab_size, eod


def write_dataset(prefix, documents, dtype=numpy.uint16):
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype) as builder:
        for doc in documents:
            builder.add_document(doc, [len(doc)])
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def build(prefix, vocab_size, cache, num_samples=20, sequence_length=4):
    config = GPTDatasetConfig(random_seed=1, sequence_length=sequence_length, blend=([prefix], None),
                              split="1,0,0", path_to_cache=cache, tokenizer=Tokenizer(vocab_size))
    return BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()[0]


def forbid_scan(monkeypatch):
    def scan(dataset):
        raise AssertionError(f"{dataset.path_prefix} was scanned again")
    monkeypatch.setattr(vocab_check, "token_id_range", scan)


def test_token_id_range_scans_every_chunk(tmp_path, monkeypatch):
    """The chunked scan finds the extremes wherever they sit (first, middle, last chunk)."""
    rng = numpy.random.default_rng(0)
    monkeypatch.setattr(vocab_check, "_SCAN_BYTES", 64)  # 16 int32 tokens a chunk
    for where in (0, 57, 199):
        tokens = rng.integers(0, 1000, 200).astype(numpy.int32)
        tokens[where], tokens[(where + 100) % 200] = 5000, -7
        prefix = write_dataset(tmp_path / f"d{where}", [tokens[:120], tokens[120:]], numpy.int32)
        assert vocab_check.token_id_range(IndexedDataset(prefix)) == (-7, 5000)
    prefix = write_dataset(tmp_path / "empty", [], numpy.int32)
    assert vocab_check.token_id_range(IndexedDataset(prefix)) == (0, -1)


def test_token_ids_at_or_above_the_vocabulary_are_refused(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    docs = [[1, 2, 3, 0]] * 10 + [[4, 99, 0]] + [[5, 6, 0]] * 10
    prefix = write_dataset(tmp_path / "data", docs)
    with pytest.raises(ValueError) as info:
        build(prefix, 99, cache)
    message = str(info.value)
    assert message.startswith(f"{prefix}.bin: token id 99 is not below the vocabulary size 99")
    assert "--tokenizer-type" in message and "\n" not in message
    assert not [f for f in os.listdir(cache) if f.endswith(".npy")]  # no sample index was built

    # The scanned range is cached: a run with a larger vocabulary reads it and passes.
    [range_file] = [f for f in os.listdir(cache) if f.endswith("token_id_range.json")]
    assert json.load(open(os.path.join(cache, range_file)))["max"] == 99
    with monkeypatch.context() as m:
        forbid_scan(m)
        train = build(prefix, 100, cache)
        assert len(train) >= 20
        with pytest.raises(ValueError, match="token id 99 is not below the vocabulary size 50"):
            build(prefix, 50, cache)

    # The same prefix written again (ids now fit) is scanned again, not judged by the old range.
    write_dataset(tmp_path / "data", [[1, 2, 3, 0]] * 30)
    assert len(build(prefix, 50, cache)) >= 20


def test_negative_ids_and_dtypes_that_cannot_overflow(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    signed = write_dataset(tmp_path / "signed", [[1, 2, 0]] * 10 + [[3, -4, 0]], numpy.int32)
    with pytest.raises(ValueError, match=r"signed\.bin: token id -4 is negative"):
        build(signed, 100, cache)
    # uint16 ids are all below a vocabulary of 65536: nothing to scan.
    wide = write_dataset(tmp_path / "wide", [[1, 65535, 0]] * 20)
    forbid_scan(monkeypatch)
    assert len(build(wide, 65536, cache)) >= 20
    floats = write_dataset(tmp_path / "floats", [[1.0, 2.0]] * 20, numpy.float32)
    with pytest.raises(ValueError, match=r"floats\.bin: holds float32 values, not token ids"):
        build(floats, 100, cache)


def test_sample_index_cache_is_keyed_by_the_dataset_content(tmp_path):
    """Re-preprocessing a prefix (fewer, different documents) must not reuse the indices cached for
    the old files: every sample is read from the new data."""
    cache = str(tmp_path / "cache")
    prefix = write_dataset(tmp_path / "data", [[7] * 9 + [0]] * 40)
    old = build(prefix, 100, cache, num_samples=60)
    assert old.built_anew_on_cache_miss and len(old) >= 60
    new_docs = [[8, 9, 0]] * 12
    write_dataset(tmp_path / "data", new_docs)
    new = build(prefix, 100, cache, num_samples=60)
    assert new.built_anew_on_cache_miss
    assert set(new.document_index.tolist()) == set(range(12))
    for i in range(len(new)):
        tokens = new[i]["tokens"]
        assert set(tokens.tolist()) <= {8, 9, 0}, i
    # Unchanged files: the cache is used.
    assert not build(prefix, 100, cache, num_samples=60).built_anew_on_cache_miss


def test_train_refuses_out_of_vocabulary_data_in_one_line(tmp_path, capsys):
    """`teratron train` on data tokenized for a larger vocabulary: exit 2, one line naming the
    .bin, no checkpoint written (before, a 78-line IndexError from the embedding)."""
    prefix = write_dataset(tmp_path / "corpus", [[1, 2, 3, 150, 99]] * 100)
    save = tmp_path / "ckpt"
    status = cli.main([
        "train", "--data-path", prefix, "--split", "1,0,0", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-3", "--eval-iters", "0", "--num-workers", "0", "--no-progress-bar", "--save", str(save)])
    out, err = capsys.readouterr()
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"teratron: error: {prefix}.bin: token id 150"), err
    assert "Traceback" not in out + err and not save.exists()


class TokenizerWithoutEod:
    vocab_size = 100

    @property
    def eod(self):
        raise AttributeError("HuggingFaceTokenizer has no eos token: set eos_token in a tokenizer_config.json")


def test_options_that_need_an_eod_token_refuse_a_tokenizer_without_one(tmp_path):
    prefix = write_dataset(tmp_path / "data", [[1, 2, 3, 4, 5]] * 20)
    common = dict(random_seed=1, sequence_length=4, blend=([prefix], None), split="1,0,0",
                  path_to_cache=str(tmp_path / "cache"), tokenizer=TokenizerWithoutEod())
    with pytest.raises(ValueError, match=r"^--reset-position-ids, --eod-mask-loss: HuggingFaceTokenizer has "
                                         r"no eos token: .*; or drop --reset-position-ids and --eod-mask-loss$"):
        GPTDatasetConfig(reset_position_ids=True, eod_mask_loss=True, **common)
    with pytest.raises(ValueError, match=r"^--mock-data: HuggingFaceTokenizer has no eos token"):
        GPTDatasetConfig(**{**common, "blend": None})
    # Plain causal samples (attention mask included) never look for an EOD.
    config = GPTDatasetConfig(create_attention_mask=True, **common)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], lambda: True, config).build()[0]
    sample = train[0]
    assert sample["attention_mask"].tolist() == [[[j > i for j in range(4)] for i in range(4)]]
