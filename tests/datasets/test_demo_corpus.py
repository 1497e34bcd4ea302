"""The embedded demo corpus: built offline, cached, English prose, readable by the dataset and
tokenizer layers."""

import collections
import os

import numpy
import pytest

from teratron.datasets import demo_corpus
from teratron.datasets.demo_corpus import DemoData, prepare_demo_data
from teratron.datasets.indexed_dataset import IndexedDataset
from teratron.tokenizers import HuggingFaceTokenizer, build_tokenizer


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> DemoData:
    return prepare_demo_data(tmp_path_factory.mktemp("cache"))


def test_builds_a_megatron_dataset(demo):
    dataset = IndexedDataset(demo.data_prefix)
    tokenizer = HuggingFaceTokenizer(demo.tokenizer_model)
    assert tokenizer.vocab_size == demo.vocab_size == demo_corpus.DEMO_VOCAB_SIZE
    assert dataset.dtype == numpy.uint16
    lengths = dataset.sequence_lengths
    assert int(lengths.sum()) == demo.num_tokens > 200_000
    assert len(dataset) > 1000 and list(dataset.document_indices) == list(range(len(dataset) + 1))
    eod = tokenizer.eod
    for i in (0, len(dataset) // 2, len(dataset) - 1):
        ids = dataset[i]
        assert ids[-1] == eod and eod not in ids[:-1].tolist()
        assert int(ids.max()) < tokenizer.vocab_size
    args = type("Args", (), {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": demo.tokenizer_model})
    assert build_tokenizer(args).tokenize("The object is returned.") == tokenizer.tokenize("The object is returned.")


def test_is_english_prose(demo):
    dataset = IndexedDataset(demo.data_prefix)
    tokenizer = HuggingFaceTokenizer(demo.tokenizer_model)
    sample = numpy.concatenate([dataset[i] for i in range(0, len(dataset), 10)])
    text = tokenizer.detokenize(sample[sample != tokenizer.eod].tolist())
    letters = sum(c.isascii() and (c.isalpha() or c == " ") for c in text)
    assert letters > 0.9 * len(text)
    words = collections.Counter(text.lower().split())
    assert {"the", "of", "is", "a", "to"} <= {w for w, _ in words.most_common(10)}
    assert words["the"] > 0.03 * sum(words.values())
    assert ">>>" not in text and "::=" not in text and "def __init__(self" not in text
    assert len(tokenizer.tokenize(text)) < 0.3 * len(text)  # the BPE learned real words


def test_second_call_uses_the_cache(demo, monkeypatch):
    mtime = os.path.getmtime(demo.data_prefix + ".bin")

    def no_rebuild(*args):
        raise AssertionError("the cached demo data was rebuilt")

    monkeypatch.setattr(demo_corpus, "_build", no_rebuild)
    again = prepare_demo_data(os.path.dirname(os.path.dirname(demo.data_prefix)))
    assert again == demo and os.path.getmtime(demo.data_prefix + ".bin") == mtime
    cache_dir = os.path.dirname(os.path.dirname(demo.data_prefix))
    assert sorted(os.listdir(cache_dir)) == [".demo.lock", os.path.basename(os.path.dirname(demo.data_prefix))]


def test_tokenizer_training_is_deterministic():
    documents = demo_corpus.demo_documents(demo_corpus._source_files()[:1])  # topics.py only: fast
    first = demo_corpus._train_tokenizer(documents).to_str()
    assert first == demo_corpus._train_tokenizer(documents).to_str()


def test_losing_a_publish_race_keeps_the_winner(tmp_path):
    winner = tmp_path / "demo-x"
    winner.mkdir()
    (winner / "meta.json").write_text("{}")
    scratch = tmp_path / ".demo-build-1"
    scratch.mkdir()
    (scratch / "meta.json").write_text('{"loser": 1}')
    demo_corpus._publish(str(scratch), str(winner))
    assert (winner / "meta.json").read_text() == "{}"


def test_clean_text_keeps_prose_only():
    raw = (
        "The \"if\" statement\n******************\n\n"
        "The :func:`len` function returns the *number* of items in a ``list``\nor any other container.\n\n"
        "   if_stmt ::= \"if\" assignment_expression \":\" suite\n\n"
        ">>> len([1, 2])\n2\n\n"
        "   for i in range(10):\n       print(i)\n\n"
        "* It is used for conditional execution of the body.\n"
    )
    assert demo_corpus.clean_text(raw) == (
        "The len function returns the number of items in a list or any other container.\n"
        "It is used for conditional execution of the body."
    )
