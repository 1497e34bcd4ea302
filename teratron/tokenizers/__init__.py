"""Tokenizers with Megatron's interface (`MegatronTokenizer`) and its `--tokenizer-type` names."""

from teratron.tokenizers.build import TOKENIZER_BUILDERS, add_tokenizer_args, build_tokenizer
from teratron.tokenizers.byte_level import ByteLevelTokenizer
from teratron.tokenizers.gpt2_bpe import GPT2BPETokenizer, default_gpt2_files
from teratron.tokenizers.huggingface import HuggingFaceTokenizer
from teratron.tokenizers.megatron_tokenizer import MegatronTokenizer
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.tokenizers.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from teratron.tokenizers.tiktokenizer import TIKTOKEN_PATTERNS, TikTokenizer

__all__ = [
    "MegatronTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "ByteLevelTokenizer",
    "TOKENIZER_BUILDERS",
    "TIKTOKEN_PATTERNS",
    "add_tokenizer_args",
    "build_tokenizer",
    "default_gpt2_files",
]
