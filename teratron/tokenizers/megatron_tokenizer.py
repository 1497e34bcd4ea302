"""`MegatronTokenizer`: the interface every teratron tokenizer implements (Megatron's names).

    tokenizer.tokenize("Hello world")   -> [15496, 995]
    tokenizer.detokenize([15496, 995])  -> "Hello world"
    tokenizer.vocab_size, tokenizer.eod, tokenizer.vocab, tokenizer.inv_vocab

Special tokens a tokenizer does not have (`cls` on GPT-2, say) raise `AttributeError`, so
`getattr(tokenizer, "pad", None)` is the way to ask for an optional one.
"""

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections import OrderedDict


class MegatronTokenizer(ABC):
    """Base class. `tokenizer_paths` and `tokenizer_options` form `unique_identifiers`, which the
    datasets hash into their cache keys (as in Megatron), so two tokenizers that would give
    different ids never share a cached index. A subclass sets `_vocab` and `_inv_vocab` (or
    overrides `vocab` / `inv_vocab`)."""

    def __init__(self, *tokenizer_paths, **tokenizer_options):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = [str(p) for p in tokenizer_paths]
        for name, value in tokenizer_options.items():
            self.unique_identifiers[name] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Text to token ids."""

    @abstractmethod
    def detokenize(self, ids) -> str:
        """Token ids to text."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before the model pads it)."""

    @property
    def vocab(self) -> dict:
        """Token -> id."""
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        """Id -> token."""
        return self._inv_vocab

    def fingerprint(self) -> dict:
        """What identifies the ids this tokenizer produces, recorded with checkpoints: its class,
        vocabulary size and a sha256 of its id -> token table (of its options where it has no
        table), so a run that resumes with another tokenizer is noticed whatever the file paths."""
        try:
            table = sorted((i, repr(t)) for t, i in self.vocab.items())
        except (AttributeError, NotImplementedError):
            table = sorted((k, v) for k, v in self.unique_identifiers.items() if k != "tokenizer_path")
        digest = hashlib.sha256(repr(table).encode()).hexdigest()
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "sha256": digest}

    @property
    @abstractmethod
    def eod(self) -> int:
        """The end-of-document id that separates documents in a packed sequence."""

    def _missing(self, name: str):
        raise AttributeError(f"{type(self).__name__} has no {name} token")

    @property
    def cls(self) -> int:
        self._missing("cls")

    @property
    def sep(self) -> int:
        self._missing("sep")

    @property
    def mask(self) -> int:
        self._missing("mask")

    @property
    def pad(self) -> int:
        self._missing("pad")

    @property
    def bos(self) -> int:
        self._missing("bos")

    @property
    def eos(self) -> int:
        self._missing("eos")


def check_file(path, flag: str, what: str) -> str:
    """Return `path` as a string if it is a readable file, else raise a ValueError naming `flag`."""
    if path is None:
        raise ValueError(f"{flag} is required: pass the path to {what}")
    path = os.fspath(path)
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise ValueError(f"{flag} {path!r} is not a readable file: pass the path to {what}")
    return path
