"""Token sampling.

`Sampler` picks the next token of every request in an engine step at once: per request greedy,
temperature, top-k and top-p, its own generator, and OpenAI-style log-probabilities; for
speculative decoding it also draws a draft model's tokens with their distributions (`propose`) and
verifies sampled draft tokens against the target's distributions (`speculative_sampling`).
`sample_next_token` and `generate` are the demo's one-request path on top of it (no KV cache: the
whole context is recomputed for every new token; fine for a demo's few short lines).

Vocabulary padding is not a token: ids at or past the real vocabulary size are never returned,
whatever their logits (a GPTModel built with `unpadded_vocab_size` already returns them as -inf;
a model without it, e.g. an old checkpoint, may not).
"""

from typing import Optional

import torch

from teratron.inference.sampling_params import SamplingParams
from teratron.inference.speculative_sampling import residual_distribution, verify_draft_tokens


class Sampler:
    """Samples one token per row of logits [r, V'] (V' >= vocab_size, the padded vocabulary).

    A row draws `torch.multinomial`'s draw (the exponential race: argmax of probs / Exp(1) noise,
    the noise from the row's generator), so a request with its own generator consumes the same
    V random numbers per row every step (and one uniform per row verifying a draft token) and its
    tokens do not depend on the rest of the batch; rows sharing a generator (or None: the default
    one) draw from it in row order. Nothing here waits for the device.
    """

    def __init__(self, vocab_size: int):
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size} must be >= 1")
        self.vocab_size = vocab_size

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[Optional[torch.Generator]],
               drafts: Optional[list[Optional[tuple[int, torch.Tensor]]]] = None):
        """-> tokens LongTensor [r]; log_probs FloatTensor [r] (log-softmax of the unmodified
        logits at the chosen ids) or None when no request asked; top_n: per request a dict
        {id: log-prob} of its top_n_logprobs most likely ids (None for a request that did not
        ask), or None when no request asked.

        drafts: per row None, or (a draft token x, the draft's distribution q [V] it was drawn
        from, as `propose` returns it) for a sampled row to verify by speculative sampling: the
        row's token is x with probability min(1, p(x) / q(x)), else a token from
        norm(max(0, p - q)), which is never x (`speculative_sampling`). Greedy rows ignore it."""
        self._check(logits, params, generators)
        logits = logits[:, : self.vocab_size].float()  # [r, V]
        tokens, _ = self._choose(logits, params, generators, drafts or [None] * len(params))
        return (tokens, *_log_probs(logits, tokens, params))

    @torch.no_grad()
    def propose(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[Optional[torch.Generator]]) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """A draft model's tokens [r], chosen as `sample` chooses them, and per row the
        distribution q [V] a sampled row's token was drawn from (None for a greedy row)."""
        self._check(logits, params, generators)
        return self._choose(logits[:, : self.vocab_size].float(), params, generators, [None] * len(params))

    def _check(self, logits, params, generators):
        if logits.dim() != 2 or not logits.shape[0] == len(params) == len(generators):
            raise ValueError(f"Sampler.sample takes logits [r, V'] with r = len(params) = len(generators); "
                             f"got {tuple(logits.shape)}, {len(params)} params, {len(generators)} generators")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"vocab_size={self.vocab_size} is more than the logits' {logits.shape[1]} columns: "
                             "pass the tokenizer's vocabulary size")

    def _choose(self, logits, params, generators, drafts) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """Tokens [r] from logits [r, V]: greedy rows' argmax, sampled rows' draw (verifying the
        row's draft when it has one); and per row the sampled row's distribution [V] (None for a
        greedy row)."""
        tokens = logits.argmax(-1)
        distributions = [None] * len(params)
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            probs = sampling_probs(logits[rows], [params[i] for i in sampled])
            tokens[rows] = _draw(probs, [generators[i] for i in sampled], [drafts[i] for i in sampled])
            for i, row in zip(sampled, probs):
                distributions[i] = row
        return tokens, distributions


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of logits [n, V] is sampled from [n, V]: softmax(logits / T)
    over its top-k / top-p set (every row's temperature > 0)."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature[:, None]
    keep = _top_k_top_p_mask(logits, params)
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _draw(probs, generators, drafts) -> torch.Tensor:
    """One id per row of probs [n, V]; a row with a draft (x, q) verifies x against it
    (speculative sampling) and draws its replacement from the residual."""
    drafted = [i for i, draft in enumerate(drafts) if draft is not None]
    if not drafted:
        return _race(probs, generators)
    rows = torch.tensor(drafted, device=probs.device)
    draft_tokens = torch.tensor([drafts[i][0] for i in drafted], device=probs.device)
    draft_probs = torch.stack([drafts[i][1] for i in drafted]).to(probs)  # [d, V]
    target_probs = probs[rows]
    tokens = _race(probs.index_copy(0, rows, residual_distribution(target_probs, draft_probs)), generators)
    uniforms = _random_rows(len(drafted), 1, [generators[i] for i in drafted], probs.device,
                            lambda block, generator: block.uniform_(generator=generator))[:, 0]
    tokens[rows] = verify_draft_tokens(target_probs, draft_probs, draft_tokens, uniforms, tokens[rows])
    return tokens


def _race(probs, generators) -> torch.Tensor:
    """One id per row of probs [n, V], row i drawn with generators[i]: argmax of probs / Exp(1)."""
    noise = _random_rows(probs.shape[0], probs.shape[1], generators, probs.device,
                         lambda block, generator: block.exponential_(generator=generator))
    # Exp(1) is > 0 but a draw that rounds to 0 would make 0 / 0 = nan win the argmax.
    return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(-1)


def _top_k_top_p_mask(logits, params) -> Optional[torch.Tensor]:
    """Bool [n, V]: the ids each row may draw (None: all of them, for every row). Top-k keeps the
    k largest logits; top-p then keeps the smallest set of those whose renormalised probability
    reaches top_p (always the most likely id)."""
    n, vocab = logits.shape
    if all(p.top_k == 0 or p.top_k >= vocab for p in params) and all(p.top_p == 1.0 for p in params):
        return None
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, V]
    keep = torch.arange(vocab, device=logits.device)[None] < top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    # top_p = 1 keeps all: the rounded cumulative sum may reach 1 before the last id.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    return torch.empty_like(keep).scatter_(-1, order, keep)


def _random_rows(num_rows, width, generators, device, fill) -> torch.Tensor:
    """Random numbers [num_rows, width]; row i from generators[i] (rows sharing one draw it in
    row order); fill(block, generator) draws a block in place."""
    groups: dict[int, tuple[Optional[torch.Generator], list[int]]] = {}
    for row, generator in enumerate(generators):
        groups.setdefault(id(generator), (generator, []))[1].append(row)
    numbers = torch.empty(num_rows, width, device=device)
    for generator, rows in groups.values():
        block = torch.empty(len(rows), width, device=device)
        fill(block, generator)
        numbers[torch.tensor(rows, device=device)] = block
    return numbers


def _log_probs(logits, tokens, params):
    """(log_probs [r] or None, top_n list or None) from the log-softmax of logits [r, V]."""
    want_log_probs = any(p.return_log_probs for p in params)
    most = min(max(p.top_n_logprobs for p in params), logits.shape[1])
    if not want_log_probs and not most:
        return None, None
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(1, tokens[:, None])[:, 0] if want_log_probs else None
    top_n = None
    if most:
        values, ids = (t.tolist() for t in log_softmax.topk(most, dim=-1))
        top_n = [dict(zip(ids[i][: p.top_n_logprobs], values[i][: p.top_n_logprobs])) if p.top_n_logprobs
                 else None for i, p in enumerate(params)]
    return log_probs, top_n


def sample_next_token(logits: torch.Tensor, temperature: float, top_k: Optional[int],
                      generator: Optional[torch.Generator] = None, vocab_size: Optional[int] = None) -> int:
    """One token id from logits [V'] (V' >= vocab_size, the padded vocabulary): greedy at
    temperature 0, else softmax(logits / T) over the top_k largest logits (all of them when
    top_k is None). Only ids below `vocab_size` (None: all V') can come out."""
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1, or None for the whole vocabulary")
    params = SamplingParams(temperature=temperature, top_k=top_k or 0)
    sampler = Sampler(logits.numel() if vocab_size is None else vocab_size)
    tokens, _, _ = sampler.sample(logits[None], [params], [generator])
    return int(tokens[0])


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
