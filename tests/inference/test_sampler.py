"""Sampler: greedy is argmax, top-k / top-p / temperature give the distributions derived by hand
(counts within a binomial bound), padding ids never come out, a seeded request's tokens do not
depend on its batch, and log-probs are those of the unmodified logits."""

import math

import pytest
import torch

from teratron.inference.sampling import Sampler
from teratron.inference.sampling_params import SamplingParams

REAL, PADDED = 100, 128


def _logits(rows, seed=0):
    """[rows, PADDED]: real logits, and padding logits far above them (trained padding rows)."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(rows, REAL, generator=g) * 2, torch.full((rows, PADDED - REAL), 1e4)], 1)


def _seeded(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _tokens(logits, params, generators, vocab_size=REAL):
    return Sampler(vocab_size).sample(logits, params, generators)[0]


def test_greedy_is_the_argmax_of_the_real_vocabulary():
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0, top_k=k, top_p=p) for k, p in ((0, 1.0), (5, 0.3))] * 3
    tokens = _tokens(logits, params, [None] * 6)
    assert tokens.dtype == torch.long and tokens.tolist() == logits[:, :REAL].argmax(-1).tolist()


def test_top_k_one_and_a_tiny_top_p_are_greedy_whatever_the_temperature():
    logits = _logits(8, seed=1)
    argmax = logits[:, :REAL].argmax(-1).tolist()
    for temperature in (0.5, 1.0, 5.0):
        for params in (SamplingParams(temperature=temperature, top_k=1),
                       SamplingParams(temperature=temperature, top_p=1e-6)):
            for seed in range(5):
                assert _tokens(logits, [params] * 8, _seeded(8, seed)).tolist() == argmax


def test_a_mixed_batch_keeps_greedy_rows_greedy():
    logits = _logits(4, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    tokens = _tokens(logits, params, _seeded(4))
    argmax = logits[:, :REAL].argmax(-1)
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]


def _frequencies_match(probs, params, draws=4000, seed=0):
    """Draw `draws` tokens from logits log(probs) (+ padding) and check every id's count is within
    5 binomial standard deviations of draws * expected (a false alarm has probability < 1e-6;
    the seed makes the test deterministic)."""
    vocab = len(probs)
    logits = torch.cat([torch.tensor(probs).log(), torch.full((3,), 50.0)]).expand(draws, vocab + 3)
    generator = torch.Generator().manual_seed(seed)
    tokens = Sampler(vocab).sample(logits, [params] * draws, [generator] * draws)[0]
    return torch.bincount(tokens, minlength=vocab).tolist()


def _within_binomial_bound(counts, expected, draws=4000):
    for count, p in zip(counts, expected, strict=True):
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(count - draws * p) <= 5 * sigma, (counts, expected)  # sigma 0: exactly draws * p


def test_two_token_distribution_follows_softmax_and_temperature():
    p = 0.3
    for temperature in (1.0, 2.0, 0.5):
        q = p ** (1 / temperature) / (p ** (1 / temperature) + (1 - p) ** (1 / temperature))
        counts = _frequencies_match([p, 1 - p], SamplingParams(temperature=temperature))
        _within_binomial_bound(counts, [q, 1 - q])


def test_top_k_and_top_p_keep_the_right_set_and_renormalise():
    probs = [0.5, 0.3, 0.2]
    cases = [  # params, expected frequencies derived by hand
        (SamplingParams(top_k=2), [0.625, 0.375, 0.0]),
        (SamplingParams(top_p=0.7), [0.625, 0.375, 0.0]),   # 0.5 < 0.7, 0.5 + 0.3 reaches it
        (SamplingParams(top_p=0.9), [0.5, 0.3, 0.2]),       # 0.8 < 0.9: all three
        (SamplingParams(top_p=0.4), [1.0, 0.0, 0.0]),       # the most likely id alone reaches 0.4
        # top-k first, then top-p over the renormalised [0.625, 0.375]: 0.625 reaches 0.6
        (SamplingParams(top_k=2, top_p=0.6), [1.0, 0.0, 0.0]),
        (SamplingParams(top_p=0.6), [0.625, 0.375, 0.0]),   # without top-k, 0.5 does not
        # temperature first: p^2 is 25, 9, 4 (/38); 25/38 < 0.7, 34/38 reaches it
        (SamplingParams(temperature=0.5, top_p=0.7), [25 / 34, 9 / 34, 0.0]),
    ]
    for seed, (params, expected) in enumerate(cases):
        _within_binomial_bound(_frequencies_match(probs, params, seed=seed), expected)


def test_padding_ids_are_never_sampled():
    logits = _logits(64, seed=3)
    for params in (SamplingParams(temperature=3.0), SamplingParams(top_k=PADDED + 5),
                   SamplingParams(top_k=REAL), SamplingParams(top_p=0.999), SamplingParams(temperature=0.0)):
        tokens = _tokens(logits, [params] * 64, _seeded(64))
        assert bool((tokens < REAL).all())
    with pytest.raises(ValueError, match="vocab_size"):
        _tokens(logits, [SamplingParams()] * 64, [None] * 64, vocab_size=PADDED + 1)


def test_a_seeded_request_samples_the_same_tokens_in_any_batch():
    params = SamplingParams(temperature=1.5, top_k=50, top_p=0.95)
    alone_generator = torch.Generator().manual_seed(7)
    batched_generator = torch.Generator().manual_seed(7)
    shared = torch.Generator().manual_seed(1)
    for step in range(5):
        logits = _logits(5, seed=10 + step)
        mine = logits[3:4]
        alone = _tokens(mine, [params], [alone_generator])
        others = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_p=0.5),
                  SamplingParams(temperature=2.0, top_k=3)]
        batch = torch.cat([logits[:1], mine, logits[1:3], logits[4:]])  # mine at row 1, then other rows
        tokens = _tokens(batch, [others[0], params, *others[1:]], [None, batched_generator, shared, shared, None])
        assert tokens[1] == alone[0]


def test_log_probs_are_those_of_the_unmodified_logits():
    logits = _logits(4, seed=4)
    params = [SamplingParams(temperature=2.0, top_k=3, return_log_probs=True),
              SamplingParams(temperature=0.0, return_log_probs=True),
              SamplingParams(top_p=0.2, return_log_probs=True, top_n_logprobs=5),
              SamplingParams(temperature=0.7, top_n_logprobs=REAL + 10)]
    tokens, log_probs, top_n = Sampler(REAL).sample(logits, params, _seeded(4))
    reference = torch.log_softmax(logits[:, :REAL].double(), -1)
    assert log_probs.dtype == torch.float32 and log_probs.shape == (4,)
    torch.testing.assert_close(log_probs.double(), reference.gather(1, tokens[:, None])[:, 0])
    assert top_n[0] is None and top_n[1] is None
    for row, n in ((2, 5), (3, REAL)):
        order = reference[row].argsort(descending=True)[:n].tolist()
        assert list(top_n[row]) == order
        torch.testing.assert_close(torch.tensor(list(top_n[row].values()), dtype=torch.double),
                                   reference[row, order])


def test_no_log_probs_unless_asked():
    tokens, log_probs, top_n = Sampler(REAL).sample(_logits(2), [SamplingParams()] * 2, [None] * 2)
    assert tokens.shape == (2,) and log_probs is None and top_n is None


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="len\\(params\\)"):
        Sampler(REAL).sample(_logits(3), [SamplingParams()] * 2, [None] * 3)
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(0)
