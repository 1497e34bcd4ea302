"""Megatron's `NullTokenizer`: the text is the ids, written as space-separated integers.

For runs where the data is already token ids (mock data, benchmarks). `vocab_size` counts the
end-of-document id, which is the last one: `eod == vocab_size - 1`.
"""

from teratron.tokenizers.megatron_tokenizer import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    def __init__(self, vocab_size: int):
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"--vocab-size {vocab_size!r} is invalid for NullTokenizer: pass an integer >= 2")
        super().__init__(vocab_size=vocab_size)
        self._vocab_size = vocab_size

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer reads space-separated integers, got {text[:50]!r}") from None
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} is outside [0, --vocab-size {self._vocab_size})")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def offsets(self, ids, text: str) -> list[int]:
        """Character offset where each id starts in `detokenize(ids)`."""
        starts, at = [], 0
        for i in ids:
            starts.append(at)
            at += len(str(int(i))) + 1
        return starts

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self._vocab_size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: str(i) for i in range(self._vocab_size)}

    @property
    def eod(self) -> int:
        return self._vocab_size - 1
