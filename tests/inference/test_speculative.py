"""Speculative decoding in DynamicInferenceEngine (tiny random models, fp32, CPU).

Greedy output with a draft model equals plain decoding: with the target as its own draft (every
draft token accepted, fewer target forwards, counted exactly), with an unrelated random draft
(rejections), with several requests, chunked prefill, a tight buffer and prefix caching. Stop
tokens apply token by token; sampled requests decode as without a draft; every block of both
caches is free at the end."""

import pytest
import torch

from inference.test_engine import GREEDY, NEW_TOKENS, PROMPTS, VOCAB, assert_all_blocks_free, engine_for, \
    save_hf_model, tight_buffer_gb
from teratron.convert.hf import from_hf
from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
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


def test_stop_token_in_the_accepted_tokens_and_sampled_requests(models):
    model, _ = models
    reference = plain_outputs(model, [PROMPTS[0]])[0]
    stop = reference[5]
    expected = reference[:reference.index(stop) + 1]
    engine = speculative_engine(model, model, 4)
    output = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS,
                                                          stop_token_ids=[stop], ignore_eod=True))[0]
    assert output.token_ids == expected and output.finish_reason == "stop"
    # A sampled request draws one token a step with its own generator, as without a draft.
    sampled = SamplingParams(temperature=1.0, seed=7, num_tokens_to_generate=NEW_TOKENS, ignore_eod=True)
    params = [GREEDY, sampled]
    plain = plain_outputs(model, PROMPTS[:2], params)
    assert [o.token_ids for o in engine.generate(PROMPTS[:2], params)] == plain
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
    with pytest.raises(ValueError, match="draft model and num_speculative_tokens"):
        speculative_engine(model, None, 2)
    with pytest.raises(ValueError, match="draft model and num_speculative_tokens"):
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
