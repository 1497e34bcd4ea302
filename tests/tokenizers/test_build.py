"""`add_tokenizer_args` + `build_tokenizer`: every --tokenizer-type, and every bad input as a
one-line ValueError naming the flag (and the file)."""

import argparse
import json
import shutil
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from teratron.tokenizers import (
    TOKENIZER_BUILDERS,
    ByteLevelTokenizer,
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    HuggingFaceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
    add_tokenizer_args,
    build_tokenizer,
    default_gpt2_files,
)


def parse(*argv):
    return add_tokenizer_args(argparse.ArgumentParser()).parse_args([str(a) for a in argv])


def test_every_type_builds_from_flags(sp_model, hf_dir, tiktoken_files):
    cases = [
        (["GPT2BPETokenizer"], GPT2BPETokenizer, 50257),
        (["ByteLevelTokenizer"], ByteLevelTokenizer, 259),
        (["NullTokenizer", "--vocab-size", 1000], NullTokenizer, 1000),
        (["HuggingFaceTokenizer", "--tokenizer-model", hf_dir], HuggingFaceTokenizer,
         Tokenizer.from_file(str(hf_dir / "tokenizer.json")).get_vocab_size()),
        (["TikTokenizer", "--tokenizer-model", tiktoken_files["json"], "--tiktoken-pattern", "v1",
          "--tiktoken-num-special-tokens", 8, "--tiktoken-special-tokens", "<unk>", "<s>", "</s>", "<eot>"],
         TikTokenizer, 8 + 256 + 13),
        (["SentencePieceTokenizer", "--tokenizer-model", sp_model, "--vocab-extra-ids", 3],
         SentencePieceTokenizer, 330 + 5 + 3),
        (["GPTSentencePieceTokenizer", "--tokenizer-model", sp_model], GPTSentencePieceTokenizer, 330),
        (["Llama2Tokenizer", "--tokenizer-model", sp_model], Llama2Tokenizer, 330),
    ]
    assert sorted(c[0][0] for c in cases) == sorted(TOKENIZER_BUILDERS)
    for (kind, *rest), cls, vocab_size in cases:
        tok = build_tokenizer(parse("--tokenizer-type", kind, *rest))
        assert type(tok) is cls and tok.vocab_size == vocab_size, kind
        assert tok.unique_identifiers["class"] == cls.__name__
        text = "the quick brown fox" if kind != "NullTokenizer" else "5 7 9"
        assert tok.detokenize(tok.tokenize(text)) == text, kind
    hf_with_bos = build_tokenizer(parse("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir,
                                        "--tokenizer-hf-include-special-tokens"))
    assert hf_with_bos.tokenize("the")[0] == hf_with_bos.bos


def test_duck_typed_args_take_flag_defaults():
    tok = build_tokenizer(SimpleNamespace(tokenizer_type="NullTokenizer", vocab_size=10))
    assert tok.eod == 9


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    vocab_file, merge_file = default_gpt2_files()
    lines = open(merge_file, encoding="utf-8").read().split("\n")
    lines[1], lines[2] = lines[2], lines[1]  # swap the first two merges
    (folder / "swapped.bpe").write_text("\n".join(lines), encoding="utf-8")
    (folder / "garbage.json").write_text("{not json")
    (folder / "garbage.model").write_bytes(b"\x00\x01 not a model")
    (folder / "empty_dir").mkdir()
    shutil.copy(vocab_file, folder / "encoder.json")
    return folder


def error_cases(f, sp_model, tiktoken_files):
    tt = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", tiktoken_files["text"]]
    return [
        (["--tokenizer-type", "BertWordPieceCase"], ["'BertWordPieceCase'", *TOKENIZER_BUILDERS]),
        ([], ["--tokenizer-type None", "GPT2BPETokenizer"]),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f / "missing.json"], ["--vocab-file", "missing.json"]),
        (["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", f / "missing.bpe"], ["--merge-file", "missing.bpe"]),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f / "encoder.json", "--merge-file", f / "swapped.bpe"],
         ["--merge-file", "swapped.bpe", "does not match"]),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f / "garbage.json"], ["--vocab-file", "garbage.json"]),
        (["--tokenizer-type", "HuggingFaceTokenizer"], ["--tokenizer-model is required"]),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f / "empty_dir"], ["empty_dir", "no tokenizer.json"]),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f / "garbage.json"],
         ["--tokenizer-model", "garbage.json", "not a valid tokenizer.json"]),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f / "nope"], ["--tokenizer-model", "nope"]),
        (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f / "garbage.model"],
         ["--tokenizer-model", "garbage.model", "not a SentencePiece model"]),
        (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", f / "nope.model"], ["--tokenizer-model", "nope.model"]),
        (["--tokenizer-type", "GPTSentencePieceTokenizer"], ["--tokenizer-model is required"]),
        (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--vocab-extra-ids", -1],
         ["--vocab-extra-ids"]),
        (["--tokenizer-type", "NullTokenizer"], ["--vocab-size is required"]),
        (tt, ["--tiktoken-pattern is required", "v1", "v2"]),
        ([*tt, "--tiktoken-pattern", "v3"], ["--tiktoken-pattern 'v3'"]),
        ([*tt, "--tiktoken-pattern", "v2", "--tokenizer-model", f / "garbage.json"],
         ["--tokenizer-model", "garbage.json", "not a tiktoken rank file"]),
        ([*tt, "--tiktoken-pattern", "v2", "--tiktoken-special-tokens", "<s>", "</s>"], ["<unk>", "missing"]),
        ([*tt, "--tiktoken-pattern", "v2", "--tiktoken-special-tokens", "<unk>", "<s>", "</s>", "<s>"], ["duplicates"]),
        ([*tt, "--tiktoken-pattern", "v2", "--tiktoken-num-special-tokens", 2], ["--tiktoken-num-special-tokens 2"]),
        ([*tt, "--tiktoken-pattern", "v2", "--vocab-size", 10**6], ["--vocab-size 1000000"]),
        ([*tt, "--tiktoken-pattern", "v2", "--vocab-size", 1100], ["--vocab-size 1100", "single bytes"]),
    ]


def test_bad_inputs_raise_one_line_value_errors(bad_files, sp_model, tiktoken_files):
    for argv, fragments in error_cases(bad_files, sp_model, tiktoken_files):
        with pytest.raises(ValueError) as info:
            build_tokenizer(parse(*argv))
        message = str(info.value)
        assert "\n" not in message, message
        for fragment in fragments:
            assert str(fragment) in message, (argv, message)
