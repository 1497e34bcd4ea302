"""Speculative decoding in DynamicInferenceEngine (tiny random models, fp32, CPU).

Greedy output with a draft model equals plain decoding: with the target as its own draft (every
draft token accepted, fewer target forwards, counted exactly), with an unrelated random draft
(rejections), with several requests, chunked prefill, a tight buffer and prefix caching. Stop
tokens apply token by token; every block of both caches is free at the end.

Sampled requests (speculative sampling): with the target as its own draft every draft is accepted;
with an unrelated draft some are, the tokens depend on the request's seed only (alone or batched),
log-probs are the target's, and over 4000 seeds the second and third tokens (verified drafts)
follow the target's sampling distribution, computed exactly from full forwards, and the first
decode step keeps 0, 1 or 2 drafts as often as speculative sampling says."""

import copy
import itertools
import math
from dataclasses import replace

import pytest
import torch

from inference.test_engine import GREEDY, NEW_TOKENS, PROMPTS, VOCAB, assert_all_blocks_free, engine_for, \
    save_hf_model, tight_buffer_gb
from teratron.convert.hf import from_hf
from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.sampling import sampling_probs
from teratron.inference.sampling_params import SamplingParams
from teratron.tokenizers.null_tokenizer import NullTokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target llama, unrelated draft qwen3 with the same vocabulary)."""
    target_path, draft_path = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    save_hf_model("llama", target_path, seed=0)
    save_hf_model("qwen3", draft_path, seed=1)
    return from_hf(str(target_path))[0], from_hf(str(draft_path))[0]


def speculative_engine(model, draft, n, **config):
    config = {"buffer_size_gb": 0.01, "block_size": 4, "num_speculative_tokens": n, **config}
    return DynamicInferenceEngine(model, NullTokenizer(VOCAB), InferenceConfig(**config), draft_model=draft)


def assert_both_caches_free(engine):
    assert_all_blocks_free(engine)
    draft = engine.draft.context
    assert draft.block_tables == {} and engine.draft.computed == {}
    assert draft.allocator.num_allocatable() == draft.num_blocks


def plain_outputs(model, prompts, params=GREEDY, **config):
    return [o.token_ids for o in engine_for(model, **config).generate(prompts, params)]


def test_target_as_its_own_draft_accepts_every_token_in_fewer_forwards(models):
    model, _ = models
    plain = engine_for(model)
    reference = plain.generate([PROMPTS[0]], GREEDY)[0].token_ids
    assert plain.num_forwards == NEW_TOKENS  # the prefill gives the first token, then one per step
    engine = speculative_engine(model, model, 3)
    assert engine.generate([PROMPTS[0]], GREEDY)[0].token_ids == reference
    # Prefill: token 1; then 3 drafts + 1 (tokens 2-5), 3 + 1 (6-9), and no draft for the last.
    assert engine.num_forwards == 4
    assert engine.num_draft_tokens_proposed == engine.num_draft_tokens_accepted == 6
    assert_both_caches_free(engine)


def test_unrelated_draft_is_rejected_often_and_output_is_unchanged(models):
    model, draft = models
    reference = plain_outputs(model, PROMPTS)
    for prompt, tokens in zip(PROMPTS, reference):
        engine = speculative_engine(model, draft, 3)
        assert engine.generate([prompt], GREEDY)[0].token_ids == tokens
        assert_both_caches_free(engine)
    engine = speculative_engine(model, draft, 3)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        assert_blocks_hold_only_final_tokens(engine)
    assert [final[i].token_ids for i in ids] == reference
    assert 0 < engine.num_draft_tokens_proposed - engine.num_draft_tokens_accepted
    assert engine.num_draft_tokens_accepted < engine.num_draft_tokens_proposed / 2
    assert_both_caches_free(engine)


def assert_blocks_hold_only_final_tokens(engine):
    """After a step, each running request holds the blocks of its computed tokens, no more, in
    both caches (the blocks of rejected draft tokens are free again)."""
    for request in engine.running:
        assert request.num_computed == len(request.token_ids) - 1
        table = engine.context.block_tables[request.request_id]
        assert len(table) == engine.context.blocks_for(request.num_computed)
        if request.request_id in engine.draft.computed:
            computed = engine.draft.computed[request.request_id]
            assert computed <= request.num_computed
            assert len(engine.draft.context.block_tables[request.request_id]) == engine.context.blocks_for(computed)


@pytest.mark.parametrize("draft_is_target", [True, False])
def test_concurrent_requests_chunked_prefill_tight_buffer_and_prefix_caching(models, draft_is_target):
    model, draft = models
    draft = model if draft_is_target else draft
    reference = plain_outputs(model, PROMPTS)
    chunked = speculative_engine(model, draft, 2, max_tokens_per_step=5)
    assert [o.token_ids for o in chunked.generate(PROMPTS, GREEDY)] == reference
    tight = speculative_engine(model, draft, 4, buffer_size_gb=tight_buffer_gb(engine_for(model), 6))
    assert tight.context.num_blocks == 6
    assert [o.token_ids for o in tight.generate(PROMPTS, GREEDY)] == reference
    prefix = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12]
    shared = [prefix + [40], prefix + [41, 42], prefix[:9]]
    caching = speculative_engine(model, draft, 3, prefix_caching=True)
    for _ in range(2):  # the second round reuses blocks the first registered
        assert [o.token_ids for o in caching.generate(shared, GREEDY)] == plain_outputs(model, shared)
    for engine in (chunked, tight, caching):
        assert (engine.num_draft_tokens_accepted == engine.num_draft_tokens_proposed) == draft_is_target
        assert_both_caches_free(engine)


def test_stop_token_in_the_accepted_tokens(models):
    model, _ = models
    reference = plain_outputs(model, [PROMPTS[0]])[0]
    stop = reference[5]
    expected = reference[:reference.index(stop) + 1]
    engine = speculative_engine(model, model, 4)
    output = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS,
                                                          stop_token_ids=[stop], ignore_eod=True))[0]
    assert output.token_ids == expected and output.finish_reason == "stop"
    assert_both_caches_free(engine)


def test_log_probs_of_accepted_tokens_equal_plain_decoding(models):
    model, _ = models
    params = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eod=True,
                            return_log_probs=True)
    plain = engine_for(model).generate([PROMPTS[2]], params)[0]
    output = speculative_engine(model, model, 3).generate([PROMPTS[2]], params)[0]
    assert output.token_ids == plain.token_ids
    torch.testing.assert_close(torch.tensor(output.log_probs), torch.tensor(plain.log_probs))


def test_speculative_settings_are_refused_in_one_line(models):
    model, draft = models
    with pytest.raises(ValueError, match="num_speculative_tokens=2 needs a draft model or a model with "
                                         "multi-token-prediction layers"):
        speculative_engine(model, None, 2)
    with pytest.raises(ValueError, match="a draft model needs num_speculative_tokens >= 1"):
        speculative_engine(model, draft, 0)
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        InferenceConfig(num_speculative_tokens=-1)


def test_prefix_caching_registers_only_blocks_of_accepted_tokens(models):
    model, draft = models
    engine = speculative_engine(model, draft, 3, prefix_caching=True)
    first = engine.generate([PROMPTS[0]], GREEDY)[0]
    assert engine.num_draft_tokens_accepted < engine.num_draft_tokens_proposed  # drafts were rejected
    # 11 + 10 tokens, the last never computed: 5 full blocks of 4, registered under their final
    # tokens, so the whole sequence as a new prompt computes its last token only.
    sequence = PROMPTS[0] + first.token_ids
    one = SamplingParams(temperature=0, num_tokens_to_generate=1, ignore_eod=True)
    computed = engine.num_tokens_computed
    output = engine.generate([sequence], one)[0]
    assert engine.num_tokens_computed - computed == 1
    assert [output.token_ids] == plain_outputs(model, [sequence], one)
    assert_both_caches_free(engine)


SAMPLED = SamplingParams(temperature=1.0, num_tokens_to_generate=NEW_TOKENS, ignore_eod=True)


def valid(tokens, length=NEW_TOKENS):
    return len(tokens) == length and all(0 <= t < VOCAB for t in tokens)


def test_sampled_requests_with_the_target_as_its_own_draft_accept_every_draft(models):
    model, _ = models
    for params in (replace(SAMPLED, seed=7), replace(SAMPLED, seed=8, temperature=0.7, top_k=20, top_p=0.9)):
        engine = speculative_engine(model, model, 3)
        assert valid(engine.generate([PROMPTS[0]], params)[0].token_ids)
        assert engine.num_forwards == 4  # as greedy: the prefill, then 3 drafts + 1 twice, then 1
        assert engine.num_draft_tokens_proposed == engine.num_draft_tokens_accepted == 6
        assert_both_caches_free(engine)


def test_sampled_requests_with_an_unrelated_draft_depend_on_their_seed_only(models):
    model, draft = models
    params = [replace(SAMPLED, seed=seed) for seed in range(len(PROMPTS))]
    engine = speculative_engine(model, draft, 3)
    batched = [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert all(valid(tokens) for tokens in batched)
    assert 0 < engine.num_draft_tokens_accepted < engine.num_draft_tokens_proposed
    assert_both_caches_free(engine)
    alone = [speculative_engine(model, draft, 3).generate([prompt], p)[0].token_ids
             for prompt, p in zip(PROMPTS, params)]
    assert alone == batched
    reseeded = [replace(p, seed=p.seed + 100) for p in params]
    assert [o.token_ids for o in speculative_engine(model, draft, 3).generate(PROMPTS, reseeded)] != batched
    # A buffer of 6 blocks: requests wait and are preempted, fewer drafts when a cache is short.
    tight = speculative_engine(model, draft, 4, buffer_size_gb=tight_buffer_gb(engine_for(model), 6))
    ids = [tight.add_request(prompt, p) for prompt, p in zip(PROMPTS, params)]
    final = {}
    while tight.has_unfinished_requests():
        final.update({o.request_id: o for o in tight.step() if o.finished})
        assert_blocks_hold_only_final_tokens(tight)
    assert all(valid(final[i].token_ids) for i in ids)
    assert 0 < tight.num_draft_tokens_accepted < tight.num_draft_tokens_proposed
    assert_both_caches_free(tight)


@pytest.mark.parametrize("draft_is_target", [True, False])
def test_log_probs_of_sampled_tokens_are_the_targets(models, draft_is_target):
    model, draft = models
    params = replace(SAMPLED, seed=3, return_log_probs=True, top_n_logprobs=2)
    engine = speculative_engine(model, model if draft_is_target else draft, 3)
    output = engine.generate([PROMPTS[2]], params)[0]
    assert engine.num_draft_tokens_accepted > 0
    sequence = PROMPTS[2] + output.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([sequence[:-1]]), None)[0, len(PROMPTS[2]) - 1:]  # [NEW_TOKENS, V']
    log_softmax = torch.log_softmax(logits[:, :VOCAB], -1)
    expected = log_softmax.gather(1, torch.tensor(output.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(output.log_probs), expected, rtol=0, atol=1e-5)
    assert [list(top) for top in output.top_n_logprobs] == log_softmax.topk(2).indices.tolist()


def sampling_distributions(model, contexts, params):
    """The model's sampling distribution [c, V] after each context, from a full forward."""
    with torch.no_grad():
        logits = model(torch.tensor(contexts), None)[:, -1, :VOCAB]
    return sampling_probs(logits, [params] * len(contexts))


def assert_counts_follow(counts, probs, draws, false_alarm=1e-6):
    """Each id's count of `draws` within a Bernstein bound of draws * probs, the ids' bounds
    together failing with probability < false_alarm: P(|X - np| >= t) <= 2 exp(-t^2 / (2 (v + t/3)))
    for X ~ Binomial(n, p), v = np(1 - p). Ids of probability 0 never occur."""
    log_odds = math.log(2 * len(probs) / false_alarm)
    for count, p in zip(counts.tolist(), probs.tolist()):
        variance = draws * p * (1 - p)
        bound = log_odds / 3 + math.sqrt((log_odds / 3) ** 2 + 2 * log_odds * variance)
        assert abs(count - draws * p) <= bound and (count == 0 or p > 0), (count, draws * p, bound)


def near_copy(model, scale=0.05, seed=2):
    """The model with N(0, scale^2) added to every weight: a draft whose distributions overlap the
    target's by about 0.7 (sum of min(p, q) on these prompts), so most drafts are kept."""
    near = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in near.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return near


def test_sampled_tokens_follow_the_targets_distribution(models):
    """One prompt, seeds 0..3999, 2 drafts from a perturbed copy of the target. The first token
    comes from the prefill; the second and third from verified drafts (or the step after a
    rejection). Their frequencies match the target's marginals, summed over every earlier token
    exactly, and the first decode step keeps 0, 1 or 2 drafts as often as speculative sampling
    says: x1 ~ q is kept with probability min(1, p(x1) / q(x1)), so both are kept with probability
    sum_a p(a) sum_x min(p, q)(x | a) sum_y min(p, q)(y | a, x)."""
    model, _ = models
    draft = near_copy(model)
    draws, prompt = 4000, PROMPTS[2]
    params = SamplingParams(temperature=1.5, top_k=20, num_tokens_to_generate=4, ignore_eod=True)
    engine = speculative_engine(model, draft, 2, max_requests=draws, max_tokens_per_step=32768,
                                buffer_size_gb=0.05)
    ids = [engine.add_request(prompt, replace(params, seed=seed)) for seed in range(draws)]
    engine.step()  # every prompt: its first token
    engine.step()  # every request: 2 drafts verified (the first tokens reported)
    decode = engine.step()  # the verified drafts reported (outputs come one step after their tokens)
    kept = torch.bincount(torch.tensor([len(o.new_token_ids) - 1 for o in decode]), minlength=3)
    final = {o.request_id: o for o in decode}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step()})
    tokens = torch.tensor([final[i].token_ids for i in ids])  # [draws, 4]

    contexts = [[prompt], [prompt + [a] for a in range(VOCAB)],
                [prompt + [a, b] for a, b in itertools.product(range(VOCAB), repeat=2)]]
    p1, p2, p3 = (sampling_distributions(model, c, params) for c in contexts)  # [1, V], [V, V], [V * V, V]
    _, q2, q3 = (sampling_distributions(draft, c, params) for c in contexts)
    p1 = p1[0]
    assert_counts_follow(torch.bincount(tokens[:, 1], minlength=VOCAB), p1 @ p2, draws)
    assert_counts_follow(torch.bincount(tokens[:, 2], minlength=VOCAB), (p1[:, None] * p2).reshape(-1) @ p3, draws)
    first_kept = torch.minimum(p2, q2)  # [a, x]: P(x1 = x and kept | a)
    both_kept = float(p1 @ (first_kept * torch.minimum(p3, q3).sum(-1).reshape(VOCAB, VOCAB)).sum(-1))
    one_kept = float(p1 @ first_kept.sum(-1)) - both_kept
    assert_counts_follow(kept, torch.tensor([1 - one_kept - both_kept, one_kept, both_kept]), draws)
    assert 0 < engine.num_draft_tokens_accepted < engine.num_draft_tokens_proposed
