"""SentencePiece tokenizers with Megatron's three behaviours.

- `SentencePieceTokenizer`: adds `<CLS> <SEP> <EOD> <MASK>` (and pad/bos/eos, and
  `--vocab-extra-ids` `<extra_id_i>` sentinels) after the model's pieces when it lacks them;
  these strings inside text become their ids.
- `GPTSentencePieceTokenizer`: the model's own pieces and ids only; eod is the model's eos.
- `Llama2Tokenizer`: as GPTSentencePiece, but `tokenize` prepends bos by default.
"""

import sentencepiece

from teratron.tokenizers.megatron_tokenizer import MegatronTokenizer, check_file


def _load(model_file) -> tuple[str, sentencepiece.SentencePieceProcessor]:
    path = check_file(model_file, "--tokenizer-model", "a SentencePiece .model file")
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(path)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"--tokenizer-model {path!r} is not a SentencePiece model: {e}") from None
    return path, processor


class GPTSentencePieceTokenizer(MegatronTokenizer):
    def __init__(self, model_file):
        path, self._sp = _load(model_file)
        super().__init__(path)
        self._inv_vocab = {i: self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())}
        self._vocab = {t: i for i, t in self._inv_vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        return self._sp.decode_ids([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return [self.bos] * bos + self._sp.encode_as_ids(text) + [self.eos] * eos


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    def __init__(self, model_file, vocab_extra_ids: int = 0):
        if vocab_extra_ids < 0:
            raise ValueError(f"--vocab-extra-ids {vocab_extra_ids} must be >= 0")
        super().__init__(model_file)
        self.unique_identifiers["vocab_extra_ids"] = str(vocab_extra_ids)
        self._special_tokens: dict[str, int] = {}
        self._cls_id, self._sep_id, self._eod_id, self._mask_id = (
            self._add_special_token(t) for t in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"))
        self._pad_id = self._add_special_token(self._piece_or(self._sp.pad_id(), "<PAD>"))
        self._bos_id = self._add_special_token(self._piece_or(self._sp.bos_id(), "<BOS>"))
        self._eos_id = self._add_special_token(self._piece_or(self._sp.eos_id(), "<EOS>"))
        self._extra_ids = [self._add_special_token(f"<extra_id_{i}>") for i in range(vocab_extra_ids)]
        self._inv_special_tokens = {i: t for t, i in self._special_tokens.items()}

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        return self._sp.id_to_piece(piece_id) if 0 <= piece_id < self._sp.get_piece_size() else fallback

    def _add_special_token(self, token: str) -> int:
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
            self._inv_vocab[self._vocab[token]] = token
        self._special_tokens[token] = self._vocab[token]
        return self._vocab[token]

    def tokenize(self, text: str) -> list[int]:
        """Special-token strings become their ids; the text between them goes to SentencePiece."""
        ids, start = [], 0
        while True:
            found = [(text.find(t, start), -len(t), t) for t in self._special_tokens]
            found = [f for f in found if f[0] >= 0]
            if not found:
                return ids + self._sp.encode_as_ids(text[start:])
            at, _, token = min(found)  # the earliest, the longest on a tie
            ids += self._sp.encode_as_ids(text[start:at]) + [self._special_tokens[token]]
            start = at + len(token)

    def detokenize(self, ids) -> str:
        """Megatron's rendering: each special token is set off by spaces."""
        text, run = "", []
        for i in (int(i) for i in ids):
            if i in self._inv_special_tokens:
                text += self._sp.decode_ids(run) + " " + self._inv_special_tokens[i] + " "
                run = []
            else:
                run.append(i)
        return text + self._sp.decode_ids(run)

    @property
    def cls(self) -> int:
        return self._cls_id

    @property
    def sep(self) -> int:
        return self._sep_id

    @property
    def mask(self) -> int:
        return self._mask_id

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """The `<extra_id_i>` sentinels (T5 span masking)."""
        return self._extra_ids
