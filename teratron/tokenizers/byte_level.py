"""`ByteLevelTokenizer`: UTF-8 bytes are ids 0..255, then three special tokens. Needs no files.

Any text round-trips exactly. Special ids decode to their strings (`<|endoftext|>` ...); those
strings inside text are encoded as ordinary bytes. `vocab` keys are 1-byte `bytes` and the
special-token strings.
"""

from teratron.tokenizers.megatron_tokenizer import MegatronTokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|begin_of_text|>")  # eod, pad, bos: ids 256, 257, 258


class ByteLevelTokenizer(MegatronTokenizer):
    def __init__(self):
        super().__init__()
        self._inv_vocab = {**{b: bytes([b]) for b in range(256)},
                           **{256 + n: t for n, t in enumerate(SPECIAL_TOKENS)}}
        self._vocab = {t: i for i, t in self._inv_vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        text, run = "", bytearray()
        for i in (int(i) for i in ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"ByteLevelTokenizer: id {i} is outside the vocabulary [0, {self.vocab_size})")
            if i < 256:
                run.append(i)
            else:
                text += run.decode("utf-8", errors="replace") + self._inv_vocab[i]
                run.clear()
        return text + run.decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    @property
    def eod(self) -> int:
        return 256

    @property
    def eos(self) -> int:
        return 256

    @property
    def pad(self) -> int:
        return 257

    @property
    def bos(self) -> int:
        return 258
