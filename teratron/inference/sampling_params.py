"""SamplingParams: how one request's tokens are chosen and when it stops (Megatron's
`inference.sampling_params`, with OpenAI's stop strings, seed and logprobs)."""

import math
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 is greedy (argmax); otherwise softmax(logits / temperature)."""
    top_k: int = 0
    """Keep the k largest logits (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probabilities sum to at least top_p (1.0: all)."""
    seed: Optional[int] = None
    """Seed of this request's own generator: the same request samples the same tokens whatever
    else is in the batch (None: drawn from the engine's generator)."""
    num_tokens_to_generate: int = 30
    """The most new tokens (OpenAI's max_tokens)."""
    stop: tuple = ()
    """Strings that end the request; the text returned stops before the first one."""
    stop_token_ids: tuple = ()
    """Token ids that end the request (the tokenizer's end-of-document id always does unless
    ignore_eod)."""
    ignore_eod: bool = False
    return_log_probs: bool = False
    """Return the log-probability of each generated token."""
    top_n_logprobs: int = 0
    """Also return the n most likely tokens and their log-probabilities at each step."""
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 keeps every token)")
        if self.num_tokens_to_generate < 1:
            raise ValueError(f"num_tokens_to_generate={self.num_tokens_to_generate} must be >= 1")
        if self.top_n_logprobs < 0:
            raise ValueError(f"top_n_logprobs={self.top_n_logprobs} must be >= 0")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
