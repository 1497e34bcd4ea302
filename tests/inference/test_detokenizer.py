"""IncrementalDetokenizer: streamed text never shows half a character, adds up to the tokenizer's
decode of all ids, and stops before the first stop string even when it is split over tokens."""

import pytest
import sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from teratron.inference.detokenizer import IncrementalDetokenizer
from teratron.tokenizers.byte_level import ByteLevelTokenizer
from teratron.tokenizers.gpt2_bpe import GPT2BPETokenizer
from teratron.tokenizers.huggingface import HuggingFaceTokenizer
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.tokenizers.sentencepiece_tokenizer import GPTSentencePieceTokenizer

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs.",
             "Héllo wörld, the naïve café serves crème brûlée!"]
SAMPLE = "Héllo wörld! 日本語 テキスト 🙂 café\n\n  tabs\tand   spaces"


@pytest.fixture(scope="module")
def hf_byte_level(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCES * 10, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return HuggingFaceTokenizer(folder)


@pytest.fixture(scope="module")
def sentence_piece(tmp_path_factory):
    """Byte fallback (characters it has not seen are byte pieces) and a leading-space marker that
    decoding drops at the start of a sequence."""
    prefix = tmp_path_factory.mktemp("sp") / "tiny"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES * 10), model_prefix=str(prefix), vocab_size=320, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", character_coverage=1.0,
        remove_extra_whitespaces=False, minloglevel=2)
    return GPTSentencePieceTokenizer(f"{prefix}.model")


def _tokenizers(request):
    return {"byte_level": ByteLevelTokenizer(), "gpt2": GPT2BPETokenizer(),
            "hf": request.getfixturevalue("hf_byte_level"),
            "sentencepiece": request.getfixturevalue("sentence_piece")}


def _stream(detokenizer, ids, chunk=1):
    pieces = [detokenizer.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return [text for text, _ in pieces], [stopped for _, stopped in pieces]


@pytest.mark.parametrize("name", ["byte_level", "gpt2", "hf", "sentencepiece"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_adds_up_to_the_decode_of_all_ids(request, name, chunk):
    tokenizer = _tokenizers(request)[name]
    ids = tokenizer.tokenize(SAMPLE)
    assert tokenizer.detokenize(ids) == SAMPLE  # the tokenizers here round-trip the sample
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces, stopped = _stream(detokenizer, ids, chunk)
    assert not any(stopped) and not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == detokenizer.text == SAMPLE and detokenizer.flush() == ""


def test_null_tokenizer_streams_its_spaces():
    detokenizer = IncrementalDetokenizer(NullTokenizer(100))
    assert _stream(detokenizer, [5, 17, 9])[0] == ["5", " 17", " 9"]
    assert detokenizer.add([]) == ("", False) and detokenizer.add([42, 0]) == (" 42 0", False)
    assert detokenizer.text == NullTokenizer(100).detokenize([5, 17, 9, 42, 0])


def test_a_character_split_over_byte_tokens_comes_out_whole():
    detokenizer = IncrementalDetokenizer(ByteLevelTokenizer())
    ids = list("a日🙂".encode())  # 1 + 3 + 4 bytes
    assert _stream(detokenizer, ids)[0] == ["a", "", "", "日", "", "", "", "🙂"]


def test_an_unfinished_character_is_flushed_as_the_decoder_renders_it():
    tokenizer = ByteLevelTokenizer()
    ids = list("a".encode() + "日".encode()[:2])
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert _stream(detokenizer, ids)[0] == ["a", "", ""]
    assert detokenizer.flush() == "\ufffd" and detokenizer.text == tokenizer.detokenize(ids) == "a\ufffd"


def test_a_stop_string_split_over_tokens_is_trimmed():
    detokenizer = IncrementalDetokenizer(ByteLevelTokenizer(), stop=["END"])
    pieces, stopped = _stream(detokenizer, list(b"abcENDxyz"))
    # "E" and "N" wait: they could begin "END"; nothing after the stop comes out.
    assert pieces == ["a", "b", "c", "", "", "", "", "", ""] and stopped == [False] * 5 + [True] * 4
    assert detokenizer.text == "abc" and detokenizer.flush() == ""


def test_text_held_for_a_stop_string_that_does_not_come_is_released():
    detokenizer = IncrementalDetokenizer(ByteLevelTokenizer(), stop=["ENDX"])
    assert _stream(detokenizer, list(b"aEND b"))[0] == ["a", "", "", "", "END ", "b"]
    detokenizer = IncrementalDetokenizer(ByteLevelTokenizer(), stop=["END"])
    assert _stream(detokenizer, list(b"aEN"))[0] == ["a", "", ""]
    assert detokenizer.flush() == "EN" and detokenizer.text == "aEN"


def test_a_stop_string_across_multi_token_characters_and_word_tokens():
    tokenizer = GPT2BPETokenizer()
    ids = tokenizer.tokenize("Hello 日本語 world\n\nEND")
    for stop, expected in (("本語", "Hello 日"), ("\n\n", "Hello 日本語 world"), ("lo 日", "Hel")):
        detokenizer = IncrementalDetokenizer(tokenizer, stop=[stop])
        pieces, stopped = _stream(detokenizer, ids)
        assert "".join(pieces) == detokenizer.text == expected and stopped[-1]


def test_the_earliest_stop_string_wins_and_stops_inside_a_token_are_found():
    detokenizer = IncrementalDetokenizer(NullTokenizer(100), stop=["world", "7 8", "9"])
    assert _stream(detokenizer, [5, 7, 8, 9]) == (["5", " ", "", ""], [False, False, True, True])
    assert detokenizer.text == "5 "
    tokenizer = GPT2BPETokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["world", "lo w"])
    _stream(detokenizer, tokenizer.tokenize("hello world"))
    assert detokenizer.text == "hel"


def test_prompt_context_renders_the_first_tokens_as_after_the_prompt(sentence_piece):
    prompt, continuation = "Pack my box", " with five dozen jugs"
    prompt_ids, full_ids = sentence_piece.tokenize(prompt), sentence_piece.tokenize(prompt + continuation)
    assert full_ids[:len(prompt_ids)] == prompt_ids
    generated = full_ids[len(prompt_ids):]
    alone = IncrementalDetokenizer(sentence_piece)
    _stream(alone, generated)
    assert alone.text == sentence_piece.detokenize(generated) == continuation.lstrip()  # decode drops it
    after_prompt = IncrementalDetokenizer(sentence_piece, prompt_token_ids=prompt_ids)
    _stream(after_prompt, generated)
    assert after_prompt.text == continuation
