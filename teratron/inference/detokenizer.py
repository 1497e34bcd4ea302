"""IncrementalDetokenizer: a request's generated tokens as streamed text, and its stop strings.

Text is released only once it is final:
- A byte-level token may hold part of a character; the tokenizers decode an incomplete UTF-8
  sequence as U+FFFD, so text whose decoded tail is U+FFFD waits for the next token.
- Text that could be the start of a stop string waits until it is known not to be one, so a stop
  string split over tokens is found and the caller never sees any of it.

Each step decodes only a short window of ids (the last released tokens as context, then the new
ones) and takes the difference, so the cost per token does not grow with the length, and
tokenizers whose rendering of a token depends on the one before (SentencePiece's leading space)
come out as the whole sequence decoded at once.
"""

REPLACEMENT_CHARACTER = "\ufffd"
PROMPT_CONTEXT_TOKENS = 4  # enough for the decoders in use to render a token as in context


class IncrementalDetokenizer:
    """`add(token_ids) -> (new_text, stopped)` per step, `flush()` when the request ends without
    a stop string; `text` is all text released so far (trimmed before the first stop string).

    Without `prompt_token_ids`, `text` ends as `tokenizer.detokenize(all ids)`; with them, the
    first tokens render as they do after the prompt (e.g. " Paris" rather than "Paris" from a
    SentencePiece tokenizer).
    """

    def __init__(self, tokenizer, stop=(), prompt_token_ids=()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._ids = [int(i) for i in list(prompt_token_ids)[-PROMPT_CONTEXT_TOKENS:]]
        self._window_start = 0  # ids[window_start:read] are the context the next ids decode after
        self._read = len(self._ids)  # ids before this are decoded into text + pending
        self._text = ""
        self._pending = ""  # decoded but not released: it may begin a stop string
        self.stopped = False

    @property
    def text(self) -> str:
        return self._text

    def add(self, token_ids) -> tuple[str, bool]:
        """Take the step's new ids; return the text they release and whether a stop string appeared
        (after which add returns ("", True))."""
        if self.stopped:
            return "", True
        self._ids.extend(int(i) for i in token_ids)
        self._pending += self._decode_new(complete_only=True)
        return self._release(final=False), self.stopped

    def flush(self) -> str:
        """The request ended (length, EOD or stop token): release what was held back (an
        incomplete character as U+FFFD, text that could have begun a stop string)."""
        if self.stopped:
            return ""
        self._pending += self._decode_new(complete_only=False)
        return self._release(final=True)

    def _decode_new(self, complete_only: bool) -> str:
        """Text of the ids from `read` on, rendered after the window's context ("" while it ends
        inside a character and complete_only)."""
        if self._read == len(self._ids):
            return ""  # nothing new: keep the context
        before = self.tokenizer.detokenize(self._ids[self._window_start:self._read])
        after = self.tokenizer.detokenize(self._ids[self._window_start:])
        if complete_only and after.endswith(REPLACEMENT_CHARACTER):
            return ""
        self._window_start, self._read = self._read, len(self._ids)
        return after[len(before):]

    def _release(self, final: bool) -> str:
        """Move pending text to `text`, up to the first stop string (then stopped) or, unless
        final, up to a tail that could begin one."""
        stop_at = min((i for i in (self._pending.find(s) for s in self.stop) if i >= 0), default=None)
        if stop_at is not None:
            released, self.stopped = self._pending[:stop_at], True
        else:
            held = 0 if final else self._stop_prefix_length()
            released = self._pending[: len(self._pending) - held]
        self._pending = self._pending[len(released):]
        self._text += released
        return released

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of pending text that is the start of a stop string."""
        longest = min(max((len(s) for s in self.stop), default=1) - 1, len(self._pending))
        for length in range(longest, 0, -1):
            tail = self._pending[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0
