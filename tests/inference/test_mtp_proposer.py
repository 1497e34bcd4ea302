"""MTPProposer: drafts from the target model's own multi-token-prediction layers (fp32, CPU; one
test on a GPU).

Driven step by step as the engine drives a draft (the target's steps through its paged cache,
proposals, verification, rollback), every proposal's distribution equals the MTP block's own
training-time computation over the whole sequence (depth k at the next-to-last position, the
earlier drafts as its tokens), whatever number of drafts was accepted or asked for, also for a
request whose MTP history starts after a cached prefix; for a GQA model and for multi-latent
attention (its MTP layers MLA too; per-head and latent caches) and for hybrid models whose
depths have Mamba and Gated DeltaNet layers (states continued from the last accepted token), with
attention or without (the proposer's cache then holds no keys). DynamicInferenceEngine with
num_speculative_tokens and no draft model drafts with the MTP layers (at most one draft per
depth): greedy output equals plain decoding, the target's cache holds the decoder's layers only,
both caches are free at the end; on a GPU, decode steps replayed from CUDA graphs feed the
proposer as eager ones do. `teratron generate --num-speculative-tokens` on an MTP checkpoint
(no --draft-load) prints plain decoding's text, at TP 1 and TP 2.
"""

import contextlib
import dataclasses
import io
import itertools

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from teratron import cli
from teratron.inference import cli as inference_cli
from teratron.inference.config import InferenceConfig
from teratron.inference.contexts.dynamic_context import DynamicInferenceContext, StepChunk, attention_modules
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.engines.mtp_proposer import MTPProposer
from teratron.inference.engines.speculative import DraftRequest
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.training.arguments import ArgumentParser
from teratron.transformer.transformer_config import MLATransformerConfig, TransformerConfig

VOCAB, DEPTHS = 60, 2
# num_speculative_tokens: recurrent layers keep the states a rollback returns to (the engine's tests set their own)
CONFIG = InferenceConfig(buffer_size_gb=0.01, block_size=4, max_seq_length=64, num_speculative_tokens=DEPTHS)
COMMON = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, gated_linear_unit=True,
              activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0,
              attention_dropout=0.0, init_method_std=0.3, use_cpu_initialization=True, mtp_num_layers=DEPTHS)
MLA = dict(q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
           rotary_scaling_factor=4.0, original_max_position_embeddings=16, qk_layernorm=True)
# A hybrid model whose MTP depths have Mamba and Gated DeltaNet layers (their states rolled back too).
HYBRID = dict(hybrid_layer_pattern="MG*-/M*G/M*G", mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
KINDS = ["gqa", "mla", "mla-latents", "hybrid", "hybrid-recurrent-mtp"]


def build(kind):
    if kind == "gqa":
        config = TransformerConfig(num_query_groups=2, **COMMON)
    elif kind.startswith("hybrid"):  # depths with attention, or of recurrent layers only (a KV-less MTP cache)
        pattern = "MG*-/M*G/M*G" if kind == "hybrid" else "MG*-/MG/MG"
        config = TransformerConfig(**{**COMMON, "num_layers": 4}, **{**HYBRID, "hybrid_layer_pattern": pattern})
    else:
        config = MLATransformerConfig(cache_mla_latents=kind == "mla-latents", **MLA, **COMMON)
    torch.manual_seed(0)
    model = build_gpt_model(GPTModelConfig(config, vocab_size=VOCAB, max_position_embeddings=64,
                                           position_embedding_type="rope")).eval()
    for module in model.modules():  # scan chunks of 4 tokens: prompts and verified chunks cross their edges
        if getattr(module, "recurrent", False):
            module.chunk_size = 4
    return model


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    return build(request.param)


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
        self.context.keep_hidden_states = True
        self.proposer = MTPProposer(model, CONFIG, VOCAB)
        self.tokens, self.computed = {}, {}

    def target_step(self, request_id, tokens, start, end, drafts=0):
        """Run tokens[start:end] through the target (the proposer observes it); the argmax after
        each of them. The last `drafts` of them are drafts, which may be rolled back."""
        self.context.reserve(request_id, end)
        chunks = [StepChunk(request_id, tokens, start, end, drafts)]
        ids, positions = self.context.initialize_attention_state(chunks)
        with torch.no_grad():
            logits = self.model(ids, positions, None, inference_context=self.context, runtime_gather_output=True)
        self.proposer.observe(chunks, self.context.hidden_states)
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
        targets = self.target_step(request_id, chunk, len(tokens) - 1, len(chunk), len(drafts))
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


PROMPTS = [[5, 17, 3, 59, 42, 7, 7, 1, 44, 23, 11], [8, 2], [30, 31, 32, 33, 34, 35, 36]]
GREEDY = SamplingParams(temperature=0, num_tokens_to_generate=12, ignore_eod=True)


def test_engine_with_mtp_drafts_equals_plain_decoding(model):
    plain = DynamicInferenceEngine(model, NullTokenizer(VOCAB), dataclasses.replace(CONFIG, num_speculative_tokens=0))
    reference = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert plain.draft is None and not plain.context.keep_hidden_states
    for n in (1, 2, 3):
        config = dataclasses.replace(CONFIG, num_speculative_tokens=n)
        engine = DynamicInferenceEngine(model, NullTokenizer(VOCAB), config)
        assert isinstance(engine.draft, MTPProposer) and engine.num_speculative_tokens == min(n, DEPTHS)
        # The target's cache holds the decoder's attention layers, the proposer's the MTP layers'.
        decoder = [m.layer_number for m in attention_modules(model.decoder)]
        assert list(engine.context.layer_slot) == decoder and engine.context.memory_buffer.shape[1] == len(decoder)
        assert list(engine.draft.context.layer_slot) == [m.layer_number for m in attention_modules(model.mtp)]
        assert engine.context.memory_buffer.shape[0] == engine.draft.context.memory_buffer.shape[0]
        proposed = []
        propose = engine.draft.propose
        engine.draft.propose = lambda requests: proposed.append([r.count for r in requests]) or propose(requests)
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference, n
        assert max(max(counts) for counts in proposed) == min(n, DEPTHS)
        assert engine.num_draft_tokens_accepted <= engine.num_draft_tokens_proposed > 0
        assert engine.draft.histories == {}
        assert engine.draft.context.allocator.num_allocatable() == engine.draft.context.num_blocks
        assert engine.context.allocator.num_allocatable() == engine.context.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replayed_decode_steps_feed_the_proposer():
    """Steps without drafts are decode steps that replay CUDA graphs; the proposer reads their
    hidden states from the graphs' outputs, so the drafts after them are the eager engine's."""
    model = build("gqa").cuda()

    def run(num_cuda_graphs):
        config = dataclasses.replace(CONFIG, num_speculative_tokens=2, max_requests=4, num_cuda_graphs=num_cuda_graphs)
        engine = DynamicInferenceEngine(model, NullTokenizer(VOCAB), config)
        propose, calls, drafts = engine.draft.propose, [0], []

        def every_third_step_without_drafts(requests):
            calls[0] += 1
            proposals = {} if calls[0] % 3 == 0 else propose(requests)
            drafts.append({i: p.token_ids for i, p in proposals.items()})
            return proposals

        engine.draft.propose = every_third_step_without_drafts
        outputs = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        return engine, outputs, drafts

    eager, expected, eager_drafts = run(0)
    graphed, outputs, drafts = run(-1)
    assert eager.cuda_graphs is None and graphed.cuda_graphs.num_replays > 0
    assert outputs == expected
    assert drafts == eager_drafts
    assert graphed.num_draft_tokens_accepted == eager.num_draft_tokens_accepted > 0


def test_a_model_without_mtp_layers_is_refused():
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    plain = build_gpt_model(GPTModelConfig(config, vocab_size=VOCAB, max_position_embeddings=16,
                                           position_embedding_type="rope"))
    with pytest.raises(ValueError, match="needs a model with multi-token-prediction layers"):
        MTPProposer(plain, CONFIG, VOCAB)


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A `teratron train` checkpoint of a model with two MTP depths (two iterations)."""
    path = tmp_path_factory.mktemp("mtp") / "ckpt"
    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
             "--lr", "1e-3", "--train-iters", "2", "--num-workers", "0", "--no-progress-bar", "--eval-iters", "0",
             "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--init-method-std", "0.3",
             "--mtp-num-layers", "2", "--save", str(path), "--save-interval", "2"]
    assert cli.main(["train"] + flags) == 0
    return str(path)


def test_generate_with_the_mtp_layers_gives_plain_decoding_text(mtp_checkpoint, capsys):
    argv = ["generate", "--load", mtp_checkpoint, "--prompt", "5 17 3 99 42", "--max-tokens", "10", "--temperature",
            "0", "--inference-dynamic-batching-buffer-size-gb", "0.001", "--inference-dynamic-batching-block-size", "4"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert len(plain.split()) == 10
    speculative = argv + ["--num-speculative-tokens", "3"]  # more than the depths: two drafts a step
    assert cli.main(speculative) == 0
    assert capsys.readouterr().out == plain
    args = inference_cli.add_generate_arguments(ArgumentParser()).parse_args(speculative[1:])
    engine, tokenizer = inference_cli._engine(args)
    assert isinstance(engine.draft, MTPProposer) and engine.num_speculative_tokens == 2
    output = engine.generate([tokenizer.tokenize("5 17 3 99 42")], SamplingParams(temperature=0,
                                                                                 num_tokens_to_generate=10))[0]
    assert output.text + "\n" == plain and engine.num_draft_tokens_proposed > 0
    # Under tensor parallelism (the MTP layers split like the decoder's) rank 0 prints the same.
    rank0, rank1 = run_distributed(_generate_on_ranks, 2, speculative + ["--tensor-model-parallel-size", "2"])
    assert (rank0, rank1) == (plain, "")


def _generate_on_ranks(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return out.getvalue()
