"""Tokenizer fixtures built offline in tmp folders: nothing is downloaded."""

import base64
import json

import pytest
import sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs; the jugs are heavy.",
    "Héllo wörld, the naïve café serves crème brûlée at 10:45!",
    "It's a truth universally acknowledged, that they'll need 12345 tokens.",
]
# Non-ASCII (accents, CJK, emoji), contractions, digit runs, whitespace runs and newlines.
SAMPLE = "Hello world! It's 2024, the naïve café — 日本語 テキスト 🙂.\n\n  Tabs\tand   spaces   \nend"


@pytest.fixture(scope="session")
def sample() -> str:
    return SAMPLE


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return SENTENCES


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("sp") / "tiny"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES * 10), model_prefix=str(prefix), vocab_size=330,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        character_coverage=1.0, remove_extra_whitespaces=False, minloglevel=2,
    )
    return f"{prefix}.model"


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json with <|endoftext|>, <pad> and a bos-adding post-processor,
    plus a tokenizer_config.json naming them."""
    folder = tmp_path_factory.mktemp("hf")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<pad>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(SENTENCES * 10, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.token_to_id("<bos>"))])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": {"content": "<bos>"}, "pad_token": "<pad>"}))
    return folder


# A tiny byte-level BPE: the 256 bytes (rank = byte value, as NeMo files have them), then merges
# in order; each merged token is the concatenation of two lower-ranked tokens.
MERGES = [b"th", b"the", b" t", b" the", b"he", b"in", b"ing", b" a", b"an", b"er", b"at", b"ou", b"o\xcc"]


@pytest.fixture(scope="session")
def tiktoken_ranks() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for token in MERGES:
        ranks[token] = len(ranks)
    return ranks


@pytest.fixture(scope="session")
def tiktoken_files(tmp_path_factory, tiktoken_ranks) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("tiktoken")
    ranks = tiktoken_ranks
    text_file = folder / "tiny.tiktoken"
    text_file.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    json_file = folder / "tiny.json"
    json_file.write_text(json.dumps([
        {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
        for t, r in ranks.items()]))
    return {"text": str(text_file), "json": str(json_file)}
