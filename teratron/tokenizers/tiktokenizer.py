"""Megatron's `TikTokenizer`: a tiktoken BPE from a local rank file, special tokens first.

Ids `0 .. num_special_tokens-1` are special tokens (`<unk>`, `<s>`, `</s>`, then the user's, then
`<SPECIAL_i>` fillers); the file's ranks follow, shifted by `num_special_tokens` and cut so the
total is `vocab_size`. The rank file is either Megatron/NeMo's JSON list
(`[{"rank": 0, "token_bytes": "<base64>", "token_str": "..."}, ...]`) or tiktoken's own text
format (one `<base64 token> <rank>` per line). `vocab` maps token bytes (a special token: its
string) to ids.
"""

import base64
import binascii
import json

import tiktoken

from teratron.tokenizers.megatron_tokenizer import MegatronTokenizer, check_file

# Megatron's two split patterns (megatron/training/tokenizer/tokenizer.py), selected by --tiktoken-pattern.
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
REQUIRED_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
DEFAULT_VOCAB_SIZE = 2**17  # Megatron's default when --vocab-size is not given


class TikTokenizer(MegatronTokenizer):
    def __init__(self, tokenizer_model, pattern: str = "v2", vocab_size: int | None = None,
                 num_special_tokens: int = 1000, special_tokens: list[str] | None = None):
        path = check_file(tokenizer_model, "--tokenizer-model", "a tiktoken rank file (.json or .tiktoken)")
        super().__init__(path, pattern=pattern, vocab_size=vocab_size,
                         num_special_tokens=num_special_tokens, special_tokens=special_tokens)
        if pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern!r} is unknown: use one of {sorted(TIKTOKEN_PATTERNS)}")
        specials = _special_tokens(special_tokens, num_special_tokens)

        ranks = load_tiktoken_ranks(path)
        if vocab_size is None:
            vocab_size = min(DEFAULT_VOCAB_SIZE, num_special_tokens + len(ranks))
        # The cut must keep every single byte, or some text could not be encoded.
        smallest = num_special_tokens + 1 + max(ranks[bytes([b])] for b in range(256))
        if not smallest <= vocab_size <= num_special_tokens + len(ranks):
            raise ValueError(
                f"--vocab-size {vocab_size} must be between {smallest} (--tiktoken-num-special-tokens "
                f"{num_special_tokens} plus all single bytes of {path!r}) and {num_special_tokens + len(ranks)} "
                f"(plus all its {len(ranks)} tokens)"
            )
        inner = {t: r + num_special_tokens for t, r in ranks.items() if r < vocab_size - num_special_tokens}
        special_ids = {t: i for i, t in enumerate(specials)}
        self._vocab_size = vocab_size
        self._model = tiktoken.Encoding(
            name="teratron-tiktoken", pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks=inner, special_tokens=special_ids,
        )
        self._vocab = {**inner, **special_ids}
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._unk_id, self._bos_id, self._eos_id = (special_ids[t] for t in REQUIRED_SPECIAL_TOKENS)

    def tokenize(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._model.encode_ordinary(text)
        return [self._bos_id] * bos + ids + [self._eos_id] * eos

    def detokenize(self, ids) -> str:
        return self._model.decode([int(i) for i in ids], errors="replace")

    def offsets(self, ids, text: str) -> list[int]:
        """Character offset in `text` where each token starts."""
        return self._model.decode_with_offsets([int(i) for i in ids])[1]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def unk(self) -> int:
        return self._unk_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def eod(self) -> int:
        return self._eos_id


def _special_tokens(special_tokens: list[str] | None, num_special_tokens: int) -> list[str]:
    specials = list(REQUIRED_SPECIAL_TOKENS if special_tokens is None else special_tokens)
    if len(set(specials)) != len(specials):
        raise ValueError(f"--tiktoken-special-tokens {specials} has duplicates: list each token once")
    missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in specials]
    if missing:
        raise ValueError(f"--tiktoken-special-tokens must include {REQUIRED_SPECIAL_TOKENS}; missing {missing}")
    if num_special_tokens < len(specials):
        raise ValueError(
            f"--tiktoken-num-special-tokens {num_special_tokens} is smaller than the {len(specials)} "
            "--tiktoken-special-tokens: raise it"
        )
    return specials + [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Token bytes -> rank from a NeMo JSON list or a tiktoken text file; ranks must be 0..n-1."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if path.endswith(".json"):
            entries = [(base64.b64decode(e["token_bytes"], validate=True), int(e["rank"]))
                       for e in json.loads(raw)]
        else:
            entries = [(base64.b64decode(tok, validate=True), int(rank))
                       for tok, rank in (line.split() for line in raw.splitlines() if line.strip())]
    except (OSError, ValueError, KeyError, TypeError, binascii.Error) as e:
        raise ValueError(
            f"--tokenizer-model {path!r} is not a tiktoken rank file (JSON list of rank/token_bytes, or "
            f"'<base64> <rank>' lines): {e}"
        ) from None
    ranks = dict(entries)
    if len(ranks) != len(entries) or sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"--tokenizer-model {path!r}: tokens must be unique with ranks 0..n-1")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"--tokenizer-model {path!r}: a byte-level BPE must rank all 256 single bytes")
    return ranks
