"""Speculative sampling on a vocabulary of 5: summed over every accept / reject path, the chance of
emitting each token is exactly the target's probability (for pairs of distributions with partial,
equal and disjoint supports); the Sampler's verification, drawn 100,000 times, emits tokens with
the target's frequencies and keeps the draft token as often as sum_x min(p(x), q(x)) says (counts
within 5 binomial standard deviations; a rejected position emitting its draft token would raise
the second count); a draft model's proposals are drawn as `sample` draws them, with their
distributions."""

import math

import pytest
import torch

from teratron.inference.sampling import Sampler, sampling_probs
from teratron.inference.sampling_params import SamplingParams
from teratron.inference.speculative_sampling import acceptance_probability, residual_distribution

V = 5
# (target p, draft q): overlapping, the target's support inside the draft's (top-k cut), the
# draft's inside the target's, equal, disjoint.
PAIRS = [
    ([0.1, 0.2, 0.3, 0.25, 0.15], [0.3, 0.3, 0.1, 0.2, 0.1]),
    ([0.5, 0.0, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]),
    ([0.05, 0.15, 0.2, 0.3, 0.3], [0.0, 0.0, 0.6, 0.4, 0.0]),
    ([0.4, 0.1, 0.1, 0.3, 0.1], [0.4, 0.1, 0.1, 0.3, 0.1]),
    ([0.5, 0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.3, 0.7, 0.0]),
]


def emission_probabilities(p, q):
    """P(emit t) = sum_x q(x) [a(x) 1{t = x} + (1 - a(x)) r(t)], a the acceptance probability and
    r the residual distribution: every path of one verified position."""
    drafts = torch.arange(V)
    accept = acceptance_probability(p.expand(V, V), q.expand(V, V), drafts)  # [x]
    residual = residual_distribution(p[None], q[None])[0]  # [t]
    return q * accept + (q * (1 - accept)).sum() * residual


@pytest.mark.parametrize("p, q", PAIRS)
def test_every_path_summed_emits_exactly_the_target_distribution(p, q):
    p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    torch.testing.assert_close(emission_probabilities(p, q), p, rtol=0, atol=1e-6)
    # The acceptance probability is min(1, p/q) on the draft's support, and a token that can be
    # rejected is never drawn from the residual (the first mismatch marks the first rejection).
    accept = acceptance_probability(p.expand(V, V), q.expand(V, V), torch.arange(V))
    support = q > 0
    torch.testing.assert_close(accept[support], (p / q).clamp(max=1)[support])
    assert torch.all(residual_distribution(p[None], q[None])[0][support & (accept < 1)] == 0)


def test_a_residual_with_no_mass_accepts_and_the_rest_sum_to_one():
    p = torch.tensor([[0.4, 0.1, 0.1, 0.3, 0.1], [0.5, 0.5, 0.0, 0.0, 0.0]])
    q = torch.tensor([[0.4, 0.1, 0.1, 0.3, 0.1 + 1e-7], [0.0, 0.0, 0.3, 0.7, 0.0]])
    residual = residual_distribution(p, q)
    assert torch.all(residual[0] == 0) and residual[1].tolist() == p[1].tolist()
    # p = q up to rounding: p(x) / q(x) < 1 at token 4, but nothing could replace it.
    assert acceptance_probability(p, q, torch.tensor([4, 2])).tolist() == [1.0, 0.0]


def within_binomial_bound(count, n, prob, deviations=5):
    return abs(count - n * prob) <= deviations * math.sqrt(n * prob * (1 - prob))


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
def test_the_sampler_verifies_drafts_into_the_target_distribution(temperature, top_k):
    """Each of n rows: the target's logits, a draft token drawn from q and q. Per id, the count of
    emitted tokens is within 5 binomial standard deviations of n p (a false alarm has probability
    < 1e-5 over the ids; the seeds make the test deterministic), as is the count of kept drafts
    of n sum_x min(p(x), q(x)). With top_k 4 the target's distribution cuts one id off."""
    n = 100_000
    params = SamplingParams(temperature=temperature, top_k=top_k)
    target_logits = torch.tensor([0.3, -1.0, 1.2, 0.0, 0.8])
    draft_logits = torch.tensor([1.0, 0.5, -0.5, 0.2, 0.0])
    p, q = (sampling_probs(logits[None], [params])[0] for logits in (target_logits, draft_logits))
    draft_tokens = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    tokens, _, _ = Sampler(V).sample(target_logits.expand(n, V), [params] * n, [generator] * n,
                                     [(int(x), q) for x in draft_tokens])
    counts = torch.bincount(tokens, minlength=V)
    assert all(within_binomial_bound(int(c), n, float(prob)) for c, prob in zip(counts, p))
    kept = int((tokens == draft_tokens).sum())
    assert within_binomial_bound(kept, n, float(torch.minimum(p, q).sum()))
    if top_k:
        assert counts[p == 0].tolist() == [0]


def test_proposals_are_drawn_as_sample_draws_with_their_distributions():
    logits = torch.randn(4, V + 3, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8),
              SamplingParams(temperature=1.3, top_k=2), SamplingParams(temperature=0.0)]
    sampler = Sampler(V)

    def seeded():
        return [torch.Generator().manual_seed(10 + i) for i in range(4)]

    tokens, probs = sampler.propose(logits, params, seeded())
    assert torch.equal(tokens, sampler.sample(logits, params, seeded())[0])
    assert probs[0] is None and probs[3] is None
    assert tokens[0] == logits[0, :V].argmax() and tokens[3] == logits[3, :V].argmax()
    for i in (1, 2):
        torch.testing.assert_close(probs[i], sampling_probs(logits[i:i + 1, :V], params[i:i + 1])[0])
        assert probs[i][tokens[i]] > 0
    assert int((probs[2] > 0).sum()) == 2
