"""A Hugging Face `tokenizer.json` (a file, or a folder holding one), run by the `tokenizers` library.

Local files only: nothing is downloaded. Special-token names come from a `tokenizer_config.json`
beside the tokenizer.json (as in Hugging Face model folders); without one, the end-of-document
token is the first of `EOD_CANDIDATES` the vocabulary has.
"""

import json
import os

from tokenizers import Tokenizer

from teratron.tokenizers.megatron_tokenizer import MegatronTokenizer

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
_SPECIAL_NAMES = ("eos", "bos", "pad", "cls", "sep", "mask")


class HuggingFaceTokenizer(MegatronTokenizer):
    def __init__(self, tokenizer_model, include_special_tokens: bool = False):
        path = _find_tokenizer_json(tokenizer_model)
        super().__init__(path, include_special_tokens=include_special_tokens)
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # the Rust loader raises a bare Exception for any malformed file
            raise ValueError(f"--tokenizer-model {path!r} is not a valid tokenizer.json: {e}") from None
        self._include_special_tokens = include_special_tokens
        self._vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._special_ids = self._read_special_ids(os.path.dirname(path))

    def _read_special_ids(self, folder: str) -> dict[str, int]:
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{config_path!r} is not valid JSON: {e}") from None
        ids = {}
        for name in _SPECIAL_NAMES:
            token = config.get(f"{name}_token")
            if isinstance(token, dict):  # a serialised AddedToken
                token = token.get("content")
            if isinstance(token, str) and token in self._vocab:
                ids[name] = self._vocab[token]
        if "eos" not in ids:
            found = [t for t in EOD_CANDIDATES if t in self._vocab]
            if found:
                ids["eos"] = self._vocab[found[0]]
        return ids

    def _special(self, name: str) -> int:
        if name not in self._special_ids:
            raise AttributeError(
                f"HuggingFaceTokenizer has no {name} token: set {name}_token in a tokenizer_config.json "
                "beside the tokenizer.json"
            )
        return self._special_ids[name]

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=self._include_special_tokens).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def offsets(self, ids, text: str) -> list[int]:
        """Character offset in `text` where each token of `tokenize(text)` starts."""
        encoding = self._tokenizer.encode(text, add_special_tokens=self._include_special_tokens)
        return [start for start, _ in encoding.offsets[: len(ids)]]

    @property
    def vocab_size(self) -> int:
        return max(self._inv_vocab) + 1

    @property
    def eod(self) -> int:
        return self._special("eos")

    @property
    def eos(self) -> int:
        return self._special("eos")

    @property
    def bos(self) -> int:
        return self._special("bos")

    @property
    def pad(self) -> int:
        return self._special("pad")

    @property
    def cls(self) -> int:
        return self._special("cls")

    @property
    def sep(self) -> int:
        return self._special("sep")

    @property
    def mask(self) -> int:
        return self._special("mask")


def _find_tokenizer_json(tokenizer_model) -> str:
    if tokenizer_model is None:
        raise ValueError("--tokenizer-model is required: pass a tokenizer.json or a folder containing one")
    path = os.fspath(tokenizer_model)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"--tokenizer-model folder {os.fspath(tokenizer_model)!r} has no tokenizer.json: "
                "pass a folder saved by a Hugging Face fast tokenizer, or the tokenizer.json itself"
            )
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise ValueError(
            f"--tokenizer-model {path!r} is not a readable file or folder: "
            "pass a tokenizer.json or a folder containing one"
        )
    return path
