import math

import numpy
import pytest
import torch

from dist import run_distributed
from teratron.datasets.blended_dataset import BlendedDataset
from teratron.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from teratron.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from teratron.datasets.helpers import build_blending_indices, build_exhaustive_blending_indices
from teratron.datasets.indexed_dataset import IndexedDatasetBuilder
from teratron.datasets.utils import (
    convert_split_vector_to_split_matrix,
    get_blend_from_list,
    get_train_valid_test_num_samples,
    parse_and_normalize_split,
)

EOD = 0


class FakeTokenizer:
    vocab_size = 1000
    eod = EOD


def reference_blending(weights, size):
    """Megatron's C++ greedy loop, transcribed with numpy arrays."""
    counts = numpy.zeros(len(weights), dtype=numpy.int64)
    index, sample = [], []
    for i in range(size):
        errors = numpy.asarray(weights) * max(i, 1) - counts
        j = int(numpy.argmax(errors))  # first maximum, as the strict '>' of the C++ loop
        index.append(j)
        sample.append(int(counts[j]))
        counts[j] += 1
    return numpy.array(index), numpy.array(sample)


def test_blending_index_greedy():
    for weights in ([0.3, 0.7], [0.5, 0.5], [0.2, 0.1, 0.45, 0.25], [1.0]):
        index, sample = build_blending_indices(weights, 3000)
        ref_index, ref_sample = reference_blending(weights, 3000)
        numpy.testing.assert_array_equal(index, ref_index)
        numpy.testing.assert_array_equal(sample, ref_sample)
        assert index.dtype == numpy.int16 and sample.dtype == numpy.int64
    # 0.3 / 0.7: after every prefix of i samples each count is within one sample of w * i
    # (the greedy rule always serves the dataset furthest below its share).
    index, sample = build_blending_indices([0.3, 0.7], 10_000)
    counts = numpy.cumsum(numpy.stack([index == 0, index == 1]), axis=1)
    i = numpy.arange(1, 10_001)
    assert numpy.abs(counts[0] - 0.3 * i).max() <= 1.0
    assert numpy.abs(counts[1] - 0.7 * i).max() <= 1.0
    assert counts[:, -1].tolist() == [3000, 7000]
    # Sample indices count up per dataset.
    assert sample[index == 0].tolist() == list(range(3000))


def test_exhaustive_blending_takes_everything_once():
    index, sample = build_exhaustive_blending_indices([5, 0, 12, 3])
    assert len(index) == 20
    for j, n in enumerate([5, 0, 12, 3]):
        assert sample[index == j].tolist() == list(range(n))


def test_parse_data_path_and_split(tmp_path):
    assert get_blend_from_list(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert get_blend_from_list(["a", "b"]) == (["a", "b"], None)
    assert get_blend_from_list(["a"]) == (["a"], None)
    assert get_blend_from_list(None) is None
    with pytest.raises(ValueError, match="--data-path: odd number of entries"):
        get_blend_from_list(["0.3", "a", "0.7"])
    with pytest.raises(ValueError, match="weight 'x' .* is not a number"):
        get_blend_from_list(["0.3", "a", "x", "b"])
    with pytest.raises(ValueError, match="weight -1 of 'b' must be a finite number >= 0"):
        get_blend_from_list(["0.3", "a", "-1", "b"])
    with pytest.raises(ValueError, match="mixes weights and prefixes"):
        get_blend_from_list(["a", "0.5", "b"])
    with pytest.raises(ValueError, match="the weights sum to 0"):
        get_blend_from_list(["0", "a"])

    assert parse_and_normalize_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_and_normalize_split("99,1") == pytest.approx([0.99, 0.01, 0.0])
    assert parse_and_normalize_split("1") == [1.0, 0.0, 0.0]
    for bad, message in (("a,b", "'a' is not a number"), ("1,2,3,4", "up to 3"), ("0,0,0", "sum to 0"),
                         ("1,,2", "up to 3"), ("1,-1", "'-1' is not a number >= 0")):
        with pytest.raises(ValueError, match=message):
            parse_and_normalize_split(bad)
    assert convert_split_vector_to_split_matrix([0.9, 0.1, 0.0]) == [(0.0, 0.9), (0.9, 1.0), None]
    # Megatron's training loop: every evaluation (each interval and at the end) runs eval_iters.
    assert get_train_valid_test_num_samples(100, 8, 40, 5) == [800, (100 // 40 + 1) * 5 * 8, 40]


def write_dataset(prefix, n_docs, first_token):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    rng = numpy.random.default_rng(first_token)
    for d in range(n_docs):
        body = [first_token + d % 50] * int(rng.integers(2, 12))
        builder.add_document(body + [EOD], [len(body) + 1])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def make_config(tmp_path, **kw):
    kw.setdefault("random_seed", 7)
    kw.setdefault("sequence_length", 8)
    kw.setdefault("path_to_cache", str(tmp_path / "cache"))
    return GPTDatasetConfig(tokenizer=FakeTokenizer(), **kw)


def test_builder_weighted_blend_sizes(tmp_path):
    a = write_dataset(tmp_path / "a", 120, 100)
    b = write_dataset(tmp_path / "b", 200, 200)
    cfg = make_config(tmp_path, blend=([a, b], [3, 7]), split="90,10,0")
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [100, 10, 0], lambda: True, cfg).build()
    assert test is None
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset)
    # Blend sizes: sum of ceil(size * w); each member asked for ceil(ceil(size * w) * 1.005).
    assert len(train) == math.ceil(100 * 0.3) + math.ceil(100 * 0.7) == 100
    assert [d.num_samples for d in train.datasets] == [math.ceil(30 * 1.005), math.ceil(70 * 1.005)] == [31, 71]
    assert len(valid) == 3 + 7 and [d.num_samples for d in valid.datasets] == [4, 8]
    counts = numpy.bincount(numpy.asarray(train.dataset_index), minlength=2)
    assert counts.tolist() == [30, 70]
    # The train split holds the first 90% of each dataset's documents, valid the rest.
    assert train.datasets[0].indices.tolist() == list(range(108))
    assert valid.datasets[1].indices.tolist() == list(range(180, 200))
    for i in (0, 1, 55, 99):
        sample = train[i]
        j = int(train.dataset_index[i])
        member = train.datasets[j][int(train.dataset_sample_index[i])]
        assert sample["dataset_id"].item() == j and torch.equal(sample["tokens"], member["tokens"])
        # Tokens come from the right source: dataset a's ids are 100..149, b's 200..249.
        real = sample["tokens"][sample["tokens"] != EOD]
        assert ((real >= 100 + 100 * j) & (real < 150 + 100 * j)).all()
    with pytest.raises(IndexError):
        train[100]
    # Built again: every index comes from the cache.
    again = BlendedMegatronDatasetBuilder(GPTDataset, [100, 10, 0], lambda: True, cfg).build()[0]
    assert not again.built_anew_on_cache_miss and not any(d.built_anew_on_cache_miss for d in again.datasets)
    numpy.testing.assert_array_equal(again.dataset_index, train.dataset_index)


def test_builder_other_blends(tmp_path):
    a = write_dataset(tmp_path / "a", 60, 100)
    b = write_dataset(tmp_path / "b", 30, 200)
    # One prefix without weights: the GPTDataset itself.
    cfg = make_config(tmp_path, blend=([a], None), split="2,1,1")
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [40, 5, 5], lambda: True, cfg).build()
    assert type(train) is GPTDataset and len(train) >= 40
    assert train.indices.tolist() == list(range(30)) and test.indices.tolist() == list(range(45, 60))
    # Several prefixes without weights: one epoch each, blended by their sizes, capped at size.
    cfg = make_config(tmp_path, blend=([a, b], None), split="1,0,0")
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [20, None, None], lambda: True, cfg).build()
    assert valid is None and len(train) == 20
    assert train.weights == pytest.approx([len(train.datasets[0]) / sum(map(len, train.datasets)),
                                           len(train.datasets[1]) / sum(map(len, train.datasets))])
    # One blend per split.
    cfg = make_config(tmp_path, blend_per_split=[([a, b], [1, 1]), ([b], None), None])
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [16, 4, 0], lambda: True, cfg).build()
    assert len(train) == 16 and numpy.bincount(numpy.asarray(train.dataset_index)).tolist() == [8, 8]
    assert type(valid) is GPTDataset and valid.indices.tolist() == list(range(30)) and test is None
    # Mock data (long samples keep its 100000-document indices small).
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=512, tokenizer=FakeTokenizer())
    splits = BlendedMegatronDatasetBuilder(MockGPTDataset, [10, 2, 2], lambda: True, cfg).build()
    assert all(isinstance(d, MockGPTDataset) and len(d) >= n for d, n in zip(splits, [10, 2, 2]))
    assert GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=FakeTokenizer(), mock=True).mock
    with pytest.raises(ValueError, match="--mock-data replaces the data paths"):
        make_config(tmp_path, blend=([a], None), split="1", mock=True)
    # Missing files are named.
    cfg = make_config(tmp_path, blend=([a, str(tmp_path / "gone")], [1, 1]), split="1,0,0")
    with pytest.raises(ValueError, match=r"missing dataset file\(s\) .*gone\.bin, .*gone\.idx"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], lambda: True, cfg)
    with pytest.raises(ValueError, match="split is required"):
        make_config(tmp_path, blend=([a], None))


def _build_on_ranks(prefix_a, prefix_b, cache):
    cfg = GPTDatasetConfig(random_seed=3, sequence_length=8, tokenizer=FakeTokenizer(),
                           blend=([prefix_a, prefix_b], [0.4, 0.6]), split="1,0,0", path_to_cache=cache)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [50, 0, 0], lambda: True, cfg).build()[0]
    flags = [train.built_anew_on_cache_miss] + [d.built_anew_on_cache_miss for d in train.datasets]
    return flags, torch.stack([train[i]["tokens"] for i in range(len(train))])


def test_builder_rank0_writes_cache_others_read(tmp_path):
    a = write_dataset(tmp_path / "a", 50, 100)
    b = write_dataset(tmp_path / "b", 50, 200)
    results = run_distributed(_build_on_ranks, 2, a, b, str(tmp_path / "cache"))
    (flags0, tokens0), (flags1, tokens1) = results
    assert flags0 == [True, True, True] and flags1 == [False, False, False]
    assert torch.equal(tokens0, tokens1)
