"""Round trips and special tokens of every tokenizer, on fixtures built offline."""

import pytest
import regex
import sentencepiece
from tokenizers import Tokenizer

from teratron.tokenizers import (
    TIKTOKEN_PATTERNS,
    ByteLevelTokenizer,
    GPTSentencePieceTokenizer,
    HuggingFaceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
)


def test_byte_level_round_trip_and_specials(sample):
    tok = ByteLevelTokenizer()
    ids = tok.tokenize(sample)
    assert ids == list(sample.encode("utf-8"))
    assert tok.detokenize(ids) == sample
    assert (tok.eod, tok.pad, tok.bos, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.detokenize([tok.bos, *tok.tokenize("hé"), tok.eod]) == "<|begin_of_text|>hé<|endoftext|>"
    assert len(tok.vocab) == len(tok.inv_vocab) == tok.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.detokenize([259])


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert tok.tokenize("3 14  15\n9") == [3, 14, 15, 9]
    assert tok.detokenize([3, 14, 15, 9]) == "3 14 15 9"
    assert tok.offsets([3, 14, 15], "3 14 15") == [0, 2, 5]
    assert (tok.vocab_size, tok.eod) == (100, 99)
    assert tok.vocab["42"] == 42 and tok.inv_vocab[42] == "42"
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.tokenize("1 two")
    with pytest.raises(ValueError, match="--vocab-size"):
        NullTokenizer(1)


def test_huggingface_file_and_folder(hf_dir, sample):
    ref = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for model in (hf_dir, hf_dir / "tokenizer.json"):
        tok = HuggingFaceTokenizer(model)
        ids = tok.tokenize(sample)
        assert ids == ref.encode(sample, add_special_tokens=False).ids
        assert tok.detokenize(ids) == sample
        assert tok.vocab_size == ref.get_vocab_size() == len(tok.vocab)
        assert tok.eod == tok.eos == ref.token_to_id("<|endoftext|>")
        assert tok.bos == ref.token_to_id("<bos>") and tok.pad == ref.token_to_id("<pad>")
        starts = tok.offsets(ids, sample)
        assert starts[0] == 0 and starts == sorted(starts) and len(starts) == len(ids)
    with_bos = HuggingFaceTokenizer(hf_dir, include_special_tokens=True)
    assert with_bos.tokenize("the fox") == [with_bos.bos, *tok.tokenize("the fox")]
    with pytest.raises(AttributeError, match="no mask token"):
        tok.mask


def test_huggingface_without_config_finds_eod(hf_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    tok = HuggingFaceTokenizer(tmp_path)
    assert tok.eod == tok.vocab["<|endoftext|>"]
    with pytest.raises(AttributeError, match="bos_token"):
        tok.bos


def reference_bpe(text: str, ranks: dict[bytes, int], pattern: str) -> list[int]:
    """Textbook byte-level BPE: split by the pattern, then merge the lowest-ranked adjacent pair."""
    ids = []
    for piece in regex.findall(pattern, text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while True:
            pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
            if not pairs:
                break
            _, i = min(pairs)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_matches_textbook_bpe(tiktoken_files, tiktoken_ranks, sample, fmt, pattern):
    text = sample + " the other thing at the inn: öuter 'theatre'"
    tok = TikTokenizer(tiktoken_files[fmt], pattern=pattern, num_special_tokens=10)
    ranks = tiktoken_ranks
    expected = [i + 10 for i in reference_bpe(text, ranks, TIKTOKEN_PATTERNS[pattern])]
    assert tok.tokenize(text) == expected
    assert tok.detokenize(expected) == text
    assert tok.vocab_size == 10 + len(ranks)
    assert (tok.unk, tok.bos, tok.eos, tok.eod) == (0, 1, 2, 2)
    assert tok.tokenize("the", bos=True, eos=True) == [1, ranks[b"the"] + 10, 2]
    assert tok.vocab["<SPECIAL_9>"] == 9 and tok.inv_vocab[10] == b"\x00"
    ids = tok.tokenize("the inn at")
    lengths = [len(tok.detokenize([i])) for i in ids]
    assert tok.offsets(ids, "the inn at") == [sum(lengths[:k]) for k in range(len(ids))]


def test_tiktokenizer_special_tokens_and_cut(tiktoken_files):
    tok = TikTokenizer(tiktoken_files["text"], vocab_size=4 + 258, num_special_tokens=4,
                       special_tokens=["<s>", "<unk>", "</s>", "<|im_end|>"])
    assert (tok.bos, tok.unk, tok.eod, tok.vocab["<|im_end|>"]) == (0, 1, 2, 3)
    assert tok.vocab_size == 262 and len(tok.inv_vocab) == 262
    # Only the first two merges ("th", "the") survive the cut, so " the" is " " + "the".
    assert tok.tokenize(" the") == [4 + ord(" "), 4 + 257]


def test_sentencepiece_family(sp_model, sample):
    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    gpt = GPTSentencePieceTokenizer(sp_model)
    ids = gpt.tokenize(sample)
    assert ids == sp.encode_as_ids(sample) and gpt.detokenize(ids) == sample
    assert (gpt.vocab_size, gpt.bos, gpt.eos, gpt.eod, gpt.pad) == (330, sp.bos_id(), sp.eos_id(), sp.eos_id(), -1)

    llama = Llama2Tokenizer(sp_model)
    assert llama.tokenize(sample) == [sp.bos_id(), *ids]
    assert llama.tokenize(sample, bos=False, eos=True) == [*ids, sp.eos_id()]
    assert llama.detokenize(llama.tokenize(sample)) == sample

    megatron = SentencePieceTokenizer(sp_model, vocab_extra_ids=2)
    # Added after the 330 pieces: <CLS> <SEP> <EOD> <MASK> <PAD> (the model has no pad), sentinels.
    assert (megatron.cls, megatron.sep, megatron.eod, megatron.mask, megatron.pad) == (330, 331, 332, 333, 334)
    assert (megatron.bos, megatron.eos) == (sp.bos_id(), sp.eos_id())
    assert megatron.additional_special_tokens_ids == [335, 336] and megatron.vocab_size == 337
    assert megatron.tokenize(sample) == ids
    text = "the fox<EOD>jumps<extra_id_1>"
    assert megatron.tokenize(text) == [*sp.encode_as_ids("the fox"), 332, *sp.encode_as_ids("jumps"), 336]
    assert megatron.detokenize(megatron.tokenize(text)) == "the fox <EOD> jumps <extra_id_1> "
