"""MTPProposer: drafts from the target model's own multi-token-prediction layers (fp32, CPU).

Driven step by step as the engine drives a draft (the target's steps through its paged cache,
proposals, verification, rollback), every proposal's distribution equals the MTP block's own
training-time computation over the whole sequence (depth k at the next-to-last position, the
earlier drafts as its tokens), whatever number of drafts was accepted or asked for, also for a
request whose MTP history starts after a cached prefix. Through DynamicInferenceEngine (its
draft replaced by the proposer, the wiring the engine will take) greedy output equals plain
decoding and both caches are free at the end.
"""

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from teratron.inference.config import InferenceConfig
from teratron.inference.contexts.dynamic_context import DynamicInferenceContext, StepChunk
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.engines.mtp_proposer import MTPProposer
from teratron.inference.engines.speculative import DraftRequest
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.transformer.transformer_config import TransformerConfig

VOCAB, DEPTHS = 60, 2
CONFIG = InferenceConfig(buffer_size_gb=0.01, block_size=4, max_seq_length=64)


@pytest.fixture(scope="module")
def model():
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=48, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0,
                               attention_dropout=0.0, init_method_std=0.3, use_cpu_initialization=True,
                               mtp_num_layers=DEPTHS)
    torch.manual_seed(0)
    return build_gpt_model(GPTModelConfig(config, vocab_size=VOCAB, max_position_embeddings=64,
                                          position_embedding_type="rope")).eval()


def mtp_reference(model, tokens, start=0):
    """Per depth, the MTP block's training-time logits [n, V] over tokens[start:] (positions
    relative to `start`; h_0 from the whole sequence)."""
    with torch.no_grad():
        ids = torch.tensor([tokens])
        positions = torch.arange(len(tokens))[None]
        rotary = model.rotary_pos_emb(positions)
        h0 = model.decoder(model.embedding(ids, positions), rotary_pos_emb=rotary)
        relative = positions[:, :len(tokens) - start]
        depths = model.mtp(ids[:, start:], relative, h0[start:], model.embedding, None,
                           model.rotary_pos_emb(relative))
        return [model.output_logits(h)[:, 0, :VOCAB] for h in depths]


class Driver:
    """The engine's part, by hand: the target's paged steps, the proposer's calls."""

    def __init__(self, model):
        self.model = model
        self.context = DynamicInferenceContext.from_model(model, CONFIG)
        self.proposer = MTPProposer(model, CONFIG, VOCAB)
        self.tokens, self.computed = {}, {}

    def target_step(self, request_id, tokens, start, end):
        """Run tokens[start:end] through the target; the argmax after each of them."""
        self.context.reserve(request_id, end)
        ids, positions = self.context.initialize_attention_state([StepChunk(request_id, tokens, start, end)])
        with torch.no_grad():
            logits = self.model(ids, positions, None, inference_context=self.context, runtime_gather_output=True)
        return logits[0, :, :VOCAB].argmax(-1).tolist()

    def prefill(self, request_id, prompt, cached=0):
        """`cached` leading tokens as if found in a prefix cache: the proposer never sees them."""
        self.context.add_request(request_id)
        if cached:
            self.target_step(request_id, prompt, 0, cached)
            self.proposer.release(request_id)
        self.tokens[request_id] = prompt + [self.target_step(request_id, prompt, cached, len(prompt))[-1]]
        self.computed[request_id] = len(prompt)

    def verify(self, request_id, drafts, accept):
        """The target computes the last token and the drafts; the first `accept` drafts stay,
        then the target's own token (as the engine keeps the target's token at a rejection)."""
        tokens = self.tokens[request_id]
        chunk = tokens + drafts
        targets = self.target_step(request_id, chunk, len(tokens) - 1, len(chunk))
        kept = drafts[:accept] + [targets[accept]]
        self.computed[request_id] = len(tokens) + accept
        self.context.truncate(request_id, self.computed[request_id])
        self.proposer.rollback(request_id, self.computed[request_id])
        self.tokens[request_id] = tokens + kept


def test_proposals_equal_the_training_computation_whatever_is_accepted(model):
    driver = Driver(model)
    driver.prefill(0, [5, 17, 3, 59, 42, 7, 7])
    driver.prefill(1, [8, 2, 30, 31, 32, 33, 34, 35, 36], cached=4)
    starts = {0: 0, 1: 4}
    sampled = SamplingParams(temperature=1.0, num_tokens_to_generate=40)
    generators = {i: torch.Generator().manual_seed(i) for i in starts}
    # Accepted drafts and drafts asked for, cycling over every combination.
    schedule = list(itertools.product([0, 1, 2], [2, 1]))
    for step, (accept, count) in enumerate(schedule * 2):
        requests = [DraftRequest(i, list(driver.tokens[i]), count, sampled, generators[i]) for i in starts]
        proposals = driver.proposer.propose(requests)
        for i, start in starts.items():
            tokens, proposal = driver.tokens[i], proposals[i]
            assert len(proposal.token_ids) == count == len(proposal.probs), (step, i)
            for depth in range(1, count + 1):
                logits = mtp_reference(model, tokens + proposal.token_ids[:depth - 1], start)[depth - 1]
                expected = logits[len(tokens) - 2 - start].softmax(-1)
                torch.testing.assert_close(proposal.probs[depth - 1], expected, rtol=1e-4, atol=1e-6,
                                           msg=f"step {step}, request {i}, depth {depth}")
            driver.verify(i, proposal.token_ids, min(accept, count))
    assert driver.proposer.num_forwards == sum(count for _, count in schedule * 2)
    for i in starts:
        driver.proposer.release(i)
    assert driver.proposer.context.allocator.num_allocatable() == driver.proposer.context.num_blocks


def test_greedy_proposals_are_the_argmax_and_missing_history_gives_none(model):
    driver = Driver(model)
    driver.prefill(0, [1, 2, 3, 4, 5])
    greedy = SamplingParams(temperature=0)
    proposal = driver.proposer.propose([DraftRequest(0, list(driver.tokens[0]), 2, greedy, None)])[0]
    assert proposal.probs is None
    tokens = driver.tokens[0]
    first = mtp_reference(model, tokens)[0][len(tokens) - 2].argmax().item()
    second = mtp_reference(model, tokens + [first])[1][len(tokens) - 2].argmax().item()
    assert proposal.token_ids == [first, second]
    # A request the proposer has not seen (or whose hidden states stop short) gets no drafts.
    assert driver.proposer.propose([DraftRequest(7, [1, 2, 3], 2, greedy, None)]) == {}
    # More drafts than depths: one per depth.
    driver.verify(0, proposal.token_ids, 0)
    assert len(driver.proposer.propose([DraftRequest(0, list(driver.tokens[0]), 5, greedy, None)])[0].token_ids) == 2


def test_engine_with_mtp_drafts_equals_plain_decoding(model):
    prompts = [[5, 17, 3, 59, 42, 7, 7, 1, 44, 23, 11], [8, 2], [30, 31, 32, 33, 34, 35, 36]]
    greedy = SamplingParams(temperature=0, num_tokens_to_generate=12, ignore_eod=True)
    plain = DynamicInferenceEngine(model, NullTokenizer(VOCAB), CONFIG)
    reference = [o.token_ids for o in plain.generate(prompts, greedy)]
    for n in (1, 2, 3):
        config = dataclasses.replace(CONFIG, num_speculative_tokens=n)
        engine = DynamicInferenceEngine(model, NullTokenizer(VOCAB), config, draft_model=model)
        engine.draft = MTPProposer(model, engine.config, engine.vocab_size)
        assert [o.token_ids for o in engine.generate(prompts, greedy)] == reference, n
        assert engine.num_draft_tokens_proposed > 0
        assert engine.draft.histories == {}
        assert engine.draft.context.allocator.num_allocatable() == engine.draft.context.num_blocks
        engine.draft.close()


def test_a_model_without_mtp_layers_is_refused():
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    plain = build_gpt_model(GPTModelConfig(config, vocab_size=VOCAB, max_position_embeddings=16,
                                           position_embedding_type="rope"))
    with pytest.raises(ValueError, match="needs a model with multi-token-prediction layers"):
        MTPProposer(plain, CONFIG, VOCAB)
