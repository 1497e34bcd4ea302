"""Speculative sampling: verify a token the draft model drew from its distribution q against the
target's distribution p, so that the token that comes out is distributed exactly as p.

At one position the draft proposed x ~ q. Keep x with probability min(1, p(x) / q(x)); otherwise
emit a token drawn from the residual r = max(0, p - q) / sum(max(0, p - q)). The chance of
emitting t is

    q(t) min(1, p(t) / q(t)) + P(reject) r(t)  =  min(p(t), q(t)) + max(0, p(t) - q(t))  =  p(t),

because P(reject) = sum_x q(x) (1 - min(1, p(x) / q(x))) = 1 - sum_x min(p(x), q(x)), which is the
residual's normaliser sum_y max(0, p(y) - q(y)) (p and q both sum to 1). With n drafts the
positions are verified in order: each kept draft is followed by the next position's verdict, the
first rejection emits its residual token and ends the step, and after n kept drafts the target's
distribution after them gives one more token. Each emitted token, given the ones before it, is
thus distributed as the target's at its position. (Leviathan et al. 2023; Chen et al. 2023.)

All functions take d rows, one per draft token: target and draft probabilities [d, V] (the
request's sampling distributions, after temperature, top-k and top-p) and the draft tokens [d].
"""

import torch


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) normalised [d, V]: what a rejected position draws from. A row with no mass
    (p <= q everywhere, i.e. p = q up to rounding) stays all zeros; such a row never rejects
    (`acceptance_probability`)."""
    excess = (target_probs - draft_probs).clamp(min=0)
    return excess / excess.sum(-1, keepdim=True).clamp(min=torch.finfo(excess.dtype).tiny)


def acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                           draft_tokens: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) at each draft token x [d] (1 where q(x) = 0, a token the draft never
    proposes); 1 where the residual has no mass (there p = q up to rounding, so a rejection would
    have probability 0 and nothing to draw)."""
    p = target_probs.gather(-1, draft_tokens[:, None])[:, 0]
    q = draft_probs.gather(-1, draft_tokens[:, None])[:, 0]
    no_residual = (target_probs - draft_probs).clamp(min=0).sum(-1) == 0
    return torch.where((p >= q) | no_residual, 1.0, p / q)


def verify_draft_tokens(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                        uniforms: torch.Tensor, residual_tokens: torch.Tensor) -> torch.Tensor:
    """The token each position emits [d]: its draft token when uniforms [d] (U[0, 1)) fall below
    the acceptance probability, else residual_tokens [d] (drawn from `residual_distribution`,
    which gives the rejected draft token probability 0, so a rejected position always emits a
    different token: the first mismatch with the drafts marks the first rejection)."""
    keep = uniforms < acceptance_probability(target_probs, draft_probs, draft_tokens)
    return torch.where(keep, draft_tokens, residual_tokens)
