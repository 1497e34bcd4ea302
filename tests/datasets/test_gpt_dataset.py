import os

import numpy
import pytest
import torch

from teratron.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
    get_ltor_masks_and_position_ids,
)
from teratron.datasets.helpers import build_sample_idx
from teratron.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from teratron.datasets.utils import Split

EOD = 0


class FakeTokenizer:
    vocab_size = 100
    eod = EOD


def write_dataset(prefix, documents, dtype=numpy.uint16):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        builder.add_document(doc, [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return IndexedDataset(str(prefix))


def config(**kw):
    kw.setdefault("random_seed", 1234)
    kw.setdefault("sequence_length", 4)
    kw.setdefault("blend", ([""], None))
    kw.setdefault("split", "1,0,0")
    return GPTDatasetConfig(tokenizer=FakeTokenizer(), **kw)


def reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, extra):
    """A line-by-line transcription of Megatron's C++ `build_sample_idx` loop."""
    total = num_epochs * tokens_per_epoch - extra
    num_samples = total // seq_length if drop_last else int(numpy.ceil(numpy.float32(total) / seq_length))
    out = [(0, 0)]
    d, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + extra
        while remaining != 0:
            length = int(sizes[doc_idx[d]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - extra
                remaining = 0
            else:
                if d == len(doc_idx) - 1:
                    assert len(out) == num_samples
                    offset = int(sizes[doc_idx[d]]) - extra
                    break
                d += 1
                offset = 0
        out.append((d, offset))
    return numpy.array(out)


def test_sample_index_matches_megatron_loop():
    rng = numpy.random.default_rng(0)
    cases = 0
    for trial in range(60):
        n_docs = int(rng.integers(1, 12))
        # Some empty documents, some shorter and some longer than a sample.
        sizes = rng.integers(0, 15, size=n_docs).astype(numpy.int32)
        sizes[rng.integers(0, n_docs)] += 2
        num_epochs = int(rng.integers(1, 4))
        doc_idx = numpy.tile(numpy.arange(n_docs, dtype=numpy.int32), num_epochs)
        rng.shuffle(doc_idx)
        tokens_per_epoch = int(sizes.sum())
        for seq_length in (2, 3, 5, 8):
            for drop_last in (True, False):
                for extra in (1, 0):
                    if num_epochs * tokens_per_epoch - extra < seq_length or tokens_per_epoch < 2:
                        continue
                    ours = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch,
                                            drop_last, bool(extra))
                    ref = reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch,
                                               drop_last, extra)
                    numpy.testing.assert_array_equal(ours, ref)
                    assert ours.dtype == numpy.int32
                    cases += 1
    assert cases > 500


def test_hand_case(tmp_path):
    # Three one-sequence documents, EOD = 0: 12 tokens in all.
    docs = [[1, 2, 3, 0], [4, 5, 0], [6, 7, 8, 9, 0]]
    indexed = write_dataset(tmp_path / "hand", docs)
    # Megatron's recipe with seed 16: the documents are shuffled by RandomState(16) into
    # [2, 0, 1], then the samples are shuffled by the same generator.
    rs = numpy.random.RandomState(16)
    order = numpy.arange(3, dtype=numpy.int32)
    rs.shuffle(order)
    assert order.tolist() == [2, 0, 1]

    # Stream: 6 7 8 9 0 | 1 2 3 0 | 4 5 0. Samples are 5-token windows every 4 tokens; only
    # (12 - 1) // 4 = 2 fit: [6 7 8 9 0] and [0 1 2 3 0]. Sample 0 ends on doc 2's EOD, so sample 1
    # starts at (position 0, offset 4); sample 1 ends on doc 0's EOD: (position 1, offset 3).
    cfg = config(random_seed=16, path_to_cache=str(tmp_path / "cache"))
    ds = GPTDataset(indexed, str(tmp_path / "hand"), numpy.arange(3, dtype=numpy.int32), None,
                    Split.train, cfg)
    assert ds.document_index.tolist() == [2, 0, 1]
    assert ds.sample_index.tolist() == [[0, 0], [0, 4], [1, 3]]
    assert sorted(ds.shuffle_index.tolist()) == [0, 1]
    by_window = {tuple(ds[i]["tokens"].tolist()): ds[i] for i in range(len(ds))}
    assert set(by_window) == {(6, 7, 8, 9), (0, 1, 2, 3)}
    assert by_window[(6, 7, 8, 9)]["labels"].tolist() == [7, 8, 9, 0]
    assert by_window[(0, 1, 2, 3)]["labels"].tolist() == [1, 2, 3, 0]
    s = by_window[(0, 1, 2, 3)]
    assert s["position_ids"].tolist() == [0, 1, 2, 3]
    assert s["loss_mask"].tolist() == [1, 1, 1, 1]
    assert s["attention_mask"].shape == (1, 4, 4) and s["attention_mask"].dtype == torch.bool
    assert s["attention_mask"][0].tolist() == [[False, True, True, True], [False, False, True, True],
                                               [False, False, False, True], [False, False, False, False]]

    # Validation keeping its last partial sample: ceil(11 / 4) = 3 samples, the third starting
    # at doc 0's EOD: [0 4 5 0] then padding. Its labels [4 5 0 pad]: no loss on the pad.
    cfg = config(random_seed=16, drop_last_partial_validation_sequence=False, create_attention_mask=False)
    valid = GPTDataset(indexed, None, numpy.arange(3, dtype=numpy.int32), None, Split.valid, cfg)
    assert valid.sample_index.tolist() == [[0, 0], [0, 4], [1, 3], [2, 2]]
    rs = numpy.random.RandomState(16)
    rs.shuffle(numpy.arange(3))
    sample_order = numpy.arange(3, dtype=numpy.uint32)
    rs.shuffle(sample_order)
    assert valid.shuffle_index.tolist() == sample_order.tolist() == [0, 2, 1]
    last = valid[1]  # shuffle_index[1] == 2
    assert last["tokens"].tolist() == [0, 4, 5, 0]
    assert last["labels"].tolist() == [4, 5, 0, 0]
    assert last["loss_mask"].tolist() == [1, 1, 1, 0]
    assert "attention_mask" not in last
    # A batch-padding sample (idx None) carries no loss.
    assert valid[None]["loss_mask"].sum() == 0

    # Without the extra token: 4-token windows every 4 tokens, 12 // 4 = 3 of them; the labels are
    # the window shifted left, the last one without a target.
    cfg = config(random_seed=16, add_extra_token_to_sequence=False)
    plain = GPTDataset(indexed, None, numpy.arange(3, dtype=numpy.int32), None, Split.train, cfg)
    assert plain.sample_index.tolist() == [[0, 0], [0, 4], [1, 3], [2, 3]]
    samples = {tuple(plain[i]["tokens"].tolist()): plain[i] for i in range(3)}
    assert set(samples) == {(6, 7, 8, 9), (0, 1, 2, 3), (0, 4, 5, 0)}
    assert samples[(0, 4, 5, 0)]["labels"].tolist() == [4, 5, 0, 0]
    assert samples[(0, 4, 5, 0)]["loss_mask"].tolist() == [1, 1, 1, 0]


def test_masks_and_positions_hand_case():
    # Two documents end in EOD (0), a third starts: segments [0 0 | 1 1 1 | 2].
    data = torch.tensor([5, 0, 6, 7, 0, 8])
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        data, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
        create_attention_mask=True)
    assert loss_mask.tolist() == [1, 0, 1, 1, 0, 1]
    assert position_ids.tolist() == [0, 1, 0, 1, 2, 0]
    x, o = True, False  # x = masked out
    assert attention_mask[0].tolist() == [
        [o, x, x, x, x, x],
        [o, o, x, x, x, x],
        [x, x, o, x, x, x],
        [x, x, o, o, x, x],
        [x, x, o, o, o, x],
        [x, x, x, x, x, o],
    ]
    # Without the resets: plain causal mask, positions 0..5, full loss.
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        data, EOD, False, False, False, True)
    assert torch.equal(attention_mask[0], ~torch.ones(6, 6, dtype=torch.bool).tril())
    assert position_ids.tolist() == list(range(6)) and loss_mask.tolist() == [1] * 6
    # Resetting attention alone keeps positions running.
    _, _, position_ids = get_ltor_masks_and_position_ids(data, EOD, False, True, False, True)
    assert position_ids.tolist() == list(range(6))


def test_dataset_flags_reach_samples(tmp_path):
    indexed = write_dataset(tmp_path / "d", [[1, 2, 0], [3, 4, 5, 6, 0], [7, 0]])
    cfg = config(sequence_length=9, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    ds = GPTDataset(indexed, None, numpy.arange(3, dtype=numpy.int32), None, Split.train, cfg)
    sample = ds[0]
    tokens = sample["tokens"]
    expected_mask, expected_loss, expected_pos = get_ltor_masks_and_position_ids(
        tokens, EOD, True, True, True, True)
    assert torch.equal(sample["attention_mask"], expected_mask)
    assert torch.equal(sample["loss_mask"], expected_loss)
    assert torch.equal(sample["position_ids"], expected_pos)
    assert (sample["loss_mask"][tokens == EOD] == 0).all() and (tokens == EOD).sum() >= 2


def test_determinism_epochs_and_cache(tmp_path):
    rng = numpy.random.default_rng(3)
    docs = [rng.integers(1, 50, size=int(n)).tolist() + [EOD] for n in rng.integers(1, 20, size=40)]
    indexed = write_dataset(tmp_path / "det", docs)
    indices = numpy.arange(30, dtype=numpy.int32)
    tokens_per_epoch = sum(len(d) for d in docs[:30])
    num_samples = 3 * tokens_per_epoch // 8  # about 2.3 epochs of 8-token samples

    def build(seed, cache):
        cfg = config(random_seed=seed, sequence_length=8, path_to_cache=str(tmp_path / cache))
        return GPTDataset(indexed, str(tmp_path / "det"), indices, num_samples, Split.train, cfg)

    a, b, c = build(1, "c1"), build(1, "c2"), build(2, "c3")
    assert a.built_anew_on_cache_miss and b.built_anew_on_cache_miss
    for name in ("document_index", "sample_index", "shuffle_index"):
        numpy.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not numpy.array_equal(a.document_index, c.document_index)
    assert not numpy.array_equal(a.shuffle_index, c.shuffle_index)
    assert len(a) >= num_samples
    # Documents of the split only, each exactly num_epochs times.
    counts = numpy.bincount(a.document_index, minlength=40)
    assert set(counts[:30].tolist()) == {3} and counts[30:].sum() == 0
    # Every sample is its window of the shuffled document stream.
    stream = numpy.concatenate([docs[d] for d in a.document_index])
    for i in range(0, len(a), 7):
        j = int(a.shuffle_index[i])
        window = stream[j * 8: j * 8 + 9]
        assert a[i]["tokens"].tolist() == window[:-1].tolist()
        assert a[i]["labels"].tolist() == window[1:].tolist()

    # Second build with the same description reads the cache files and does not rebuild them.
    files = sorted(os.listdir(tmp_path / "c1"))
    assert len(files) == 4 and any(f.endswith("description.txt") for f in files)
    mtimes = {f: os.stat(tmp_path / "c1" / f).st_mtime_ns for f in files}
    again = build(1, "c1")
    assert not again.built_anew_on_cache_miss
    assert {f: os.stat(tmp_path / "c1" / f).st_mtime_ns for f in files} == mtimes
    for name in ("document_index", "sample_index", "shuffle_index"):
        numpy.testing.assert_array_equal(getattr(again, name), getattr(a, name))
    assert not any(f.endswith(".tmp") for f in os.listdir(tmp_path / "c1"))


def test_separate_final_epoch(tmp_path):
    # 10 documents of 10 tokens, 9-token windows of 10 tokens: 11 samples per epoch. Asking for
    # 12 samples needs a second epoch that gives only 1 < 0.8 * 11 samples: it is shuffled on its
    # own, so the first 11 shuffled samples are exactly those of the first epoch.
    docs = [[i + 1] * 9 + [EOD] for i in range(10)]
    indexed = write_dataset(tmp_path / "e", docs)
    cfg = config(sequence_length=9)
    ds = GPTDataset(indexed, None, numpy.arange(10, dtype=numpy.int32), 12, Split.train, cfg)
    assert sorted(ds.document_index[:10].tolist()) == list(range(10))
    assert sorted(ds.document_index[10:].tolist()) == list(range(10))
    assert sorted(ds.shuffle_index[:11].tolist()) == list(range(11))
    assert sorted(ds.shuffle_index[11:].tolist()) == list(range(11, len(ds)))


def test_mock_dataset_is_deterministic_and_in_vocab():
    cfg = GPTDatasetConfig(random_seed=5, sequence_length=16, tokenizer=FakeTokenizer())
    assert cfg.mock and cfg.split == "1,1,1"
    low = MockGPTLowLevelDataset(FakeTokenizer())
    assert len(low) == 100000
    doc = low[3]
    assert doc[-1] == EOD and len(doc) == low.sequence_lengths[3]
    assert doc[:-1].max() < FakeTokenizer.vocab_size and doc[:-1].min() >= 1
    ids = numpy.arange(0, 200, dtype=numpy.int32)
    a = MockGPTDataset(low, None, ids, 50, Split.train, cfg)
    b = MockGPTDataset(MockGPTLowLevelDataset(FakeTokenizer()), None, ids, 50, Split.train, cfg)
    for i in (0, 17, 49):
        assert torch.equal(a[i]["tokens"], b[i]["tokens"])
        assert a[i]["tokens"].shape == (16,)


def test_empty_split_is_an_error(tmp_path):
    indexed = write_dataset(tmp_path / "x", [[1, 2, 0]])
    with pytest.raises(ValueError, match="valid split has no tokens"):
        GPTDataset(indexed, str(tmp_path / "x"), numpy.arange(0, dtype=numpy.int32), 4, Split.valid, config())


def test_document_boundaries_are_the_reset_attention_masks_documents():
    """A sample's cu_seqlens (instead of the dense mask) give the same documents, and a batch's
    rows join into one 'sbhd' PackedSeqParams."""
    from teratron.datasets.gpt_dataset import document_boundaries
    from teratron.packed_seq_params import document_ids, packed_rows

    data = torch.tensor([5, EOD, 6, 7, EOD, EOD, 8, 9])
    boundaries = document_boundaries(data, EOD)
    assert boundaries.tolist() == [0, 2, 5, 6, 8, -1, -1, -1, -1] and boundaries.dtype == torch.int32
    dense, _, _ = get_ltor_masks_and_position_ids(data, EOD, False, True, False, True)
    packed = packed_rows(torch.stack([boundaries, document_boundaries(torch.tensor([1, 2, 3, 4, 5, 6, 7, EOD]), EOD)]))
    assert packed.qkv_format == "sbhd" and packed.cu_seqlens_q.tolist() == [0, 2, 5, 6, 8, 16]
    documents = document_ids(packed, 2, 8, "cpu")
    allowed = (documents[0, :, None] == documents[0, None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(~allowed, dense[0])
