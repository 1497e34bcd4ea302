"""Sample text from a single-stage GPT model: temperature and top-k, the whole context
recomputed for every new token (no KV cache; fine for a demo's few short lines).

Vocabulary padding is not a token: ids at or past the real vocabulary size are never returned,
whatever their logits (a GPTModel built with `unpadded_vocab_size` already returns them as -inf;
a model without it, e.g. an old checkpoint, may not).
"""

from typing import Optional

import torch


def sample_next_token(logits: torch.Tensor, temperature: float, top_k: Optional[int],
                      generator: Optional[torch.Generator] = None, vocab_size: Optional[int] = None) -> int:
    """One token id from logits [V'] (V' >= vocab_size, the padded vocabulary): greedy at
    temperature 0, else softmax(logits / T) over the top_k largest logits (all of them when
    top_k is None). Only ids below `vocab_size` (None: all V') can come out."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1, or None for the whole vocabulary")
    if vocab_size is not None:
        if not 1 <= vocab_size <= logits.numel():
            raise ValueError(f"vocab_size={vocab_size} must be in [1, {logits.numel()}] (the logits' length)")
        logits = logits[:vocab_size]
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int, max_sequence_length: int,
             temperature: float = 0.8, top_k: Optional[int] = 40,
             generator: Optional[torch.Generator] = None) -> str:
    """Continue `prompt` until the end-of-document token or `max_new_tokens` tokens.

    `model(tokens [1, s], position_ids [1, s], None)` must return full-vocabulary logits
    [1, s, V'] (V' >= the tokenizer's vocabulary; padding ids are never sampled).
    """
    device = next(model.parameters()).device
    ids = list(tokenizer.tokenize(prompt))
    if not ids:
        raise ValueError(f"prompt {prompt!r} tokenizes to no tokens; give at least one token to continue")
    eod = getattr(tokenizer, "eod", None)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = ids[-max_sequence_length:]
            tokens = torch.tensor([context], device=device)
            positions = torch.arange(len(context), device=device).unsqueeze(0)
            logits = model(tokens, positions, None)[0, -1]
            next_id = sample_next_token(logits, temperature, top_k, generator,
                                        vocab_size=tokenizer.vocab_size)
            if next_id == eod:
                break
            ids.append(next_id)
    finally:
        model.train(was_training)
    return tokenizer.detokenize(ids)
