"""GPT-2 BPE (tiktoken path) against a second, independent implementation: the `tokenizers`
library's byte-level BPE loaded from the same shipped encoder.json / vocab.bpe."""

import os
import sysconfig

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from teratron.tokenizers import GPT2BPETokenizer, default_gpt2_files


@pytest.fixture(scope="module")
def gpt2():
    return GPT2BPETokenizer()


@pytest.fixture(scope="module")
def reference():
    vocab_file, merge_file = default_gpt2_files()
    ref = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ref.decoder = decoders.ByteLevel()
    return ref


EXTRA_TEXTS = ["<|endoftext|> is plain text here", "   leading spaces\n\n\n trailing   ",
               "I'm, you're, we've, they'd, it'll... 3.14159 + 2**64 = ?", "ÀÉÎÕÜ ß ø Ω ж 中文 😀👍🏽"]


def test_ids_match_independent_bpe(gpt2, reference, sample, sentences):
    for text in [sample, *sentences, *EXTRA_TEXTS]:
        ids = gpt2.tokenize(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert gpt2.detokenize(ids) == text


def test_ids_match_on_a_large_mixed_text(gpt2, reference):
    """100k characters of CPython source: prose, code, escapes, odd whitespace."""
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py"), encoding="utf-8") as f:
        text = f.read(100_000)
    ids = gpt2.tokenize(text)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert gpt2.detokenize(ids) == text


def test_vocab_and_special_tokens(gpt2, reference):
    assert gpt2.vocab_size == reference.get_vocab_size() == 50257
    assert gpt2.eod == gpt2.eos == reference.token_to_id("<|endoftext|>")
    assert gpt2.vocab == reference.get_vocab()
    assert all(gpt2.inv_vocab[i] == t for t, i in gpt2.vocab.items())
    with pytest.raises(AttributeError, match="no pad token"):
        gpt2.pad


def test_offsets(gpt2):
    text = "Hello world, naïve café"
    ids = gpt2.tokenize(text)
    starts = gpt2.offsets(ids, text)
    assert starts[0] == 0 and starts == sorted(starts)
    assert "".join(text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])) == text
