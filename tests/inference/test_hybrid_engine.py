"""DynamicInferenceEngine serving hybrid models (fp32, CPU): each request's Mamba-2, Gated DeltaNet and
Gated Delta Product layers carry their convolution and scan states from one step to the next (prefill chunks
and decode tokens), so greedy output equals the model's own greedy decoding by full recompute (the
whole sequence through the model at each step), for requests alone, batched with chunked prefill,
decoding together as one batch, and in a buffer tight enough to preempt (a preempted request recomputes its states); with attention
layers or multi-latent attention layers (per-head or latent cache); with speculative decoding
from a hybrid draft model (states rolled back to the last accepted token); with prefix caching
(requests start their recurrent layers from states cached at block boundaries, within a budget)."""

import copy

import pytest
import torch

from ssm.mamba_core_cases import EPS, reference
from teratron import cli
from teratron.inference.config import InferenceConfig
from teratron.inference.contexts.dynamic_context import DynamicInferenceContext
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.ssm import mamba_core
from teratron.ssm.mamba_mixer import MambaMixer
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.transformer.transformer_config import MLATransformerConfig, TransformerConfig

VOCAB = 101
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 1, 64, 23, 11, 80, 2], [8, 2], [30, 31, 32, 33, 34, 35, 36], [60] * 5]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eod=True)


HYBRID = dict(num_layers=5, hidden_size=32, num_attention_heads=4, ffn_hidden_size=40, mamba_state_dim=8,
              mamba_head_dim=8, mamba_num_groups=2, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, add_bias_linear=False, normalization="RMSNorm",
              hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3)
MLA = dict(kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, q_lora_rank=16, qk_layernorm=True,
           rotary_scaling_factor=4.0, original_max_position_embeddings=16, mscale=0.8, mscale_all_dim=1.0)


@pytest.fixture(scope="module", params=["attention", "mla", "mla-latents", "recurrent", "gdp"])
def model(request):
    """MG*-M, MG+-M with multi-latent attention (per-head keys and values cached, or the latents),
    MG-GM without attention (a context of no keys: its blocks only count tokens), or MG*-M with Gated
    Delta Product mixers in the M places (2 substeps a token)."""
    if request.param == "attention":
        config = TransformerConfig(hybrid_layer_pattern="MG*-M", **HYBRID)
    elif request.param == "gdp":
        config = TransformerConfig(hybrid_layer_pattern="MG*-M", gdp_layers=True, gdp_num_householder=2, **HYBRID)
    elif request.param == "recurrent":
        config = TransformerConfig(hybrid_layer_pattern="MG-GM", **HYBRID)
    else:
        config = MLATransformerConfig(hybrid_layer_pattern="MG+-M", cache_mla_latents=request.param == "mla-latents",
                                      **HYBRID, **MLA)
    torch.manual_seed(0)
    model = build_gpt_model(GPTModelConfig(config, vocab_size=VOCAB, max_position_embeddings=64,
                                           position_embedding_type="rope"))
    for module in model.modules():  # scan chunks of 4 tokens: prompts and chunked prefill cross their edges
        if getattr(module, "recurrent", False):
            module.chunk_size = 4
    with torch.no_grad():
        model.embedding.word_embeddings.weight.normal_()
    return model.eval()


def recompute_greedy(model, prompt):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids]), None)[0, -1].argmax()))
    return ids[len(prompt):]


def generate_all(engine, prompts):
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.token_ids
    return [outputs[i] for i in ids]


def engine_for(model, **config):
    return DynamicInferenceEngine(model, NullTokenizer(VOCAB), InferenceConfig(**{"block_size": 4, **config}))


TIGHT = 9  # blocks of 4 tokens for the 4 requests: too few, requests are preempted


@pytest.mark.parametrize("config", [dict(buffer_size_gb=0.01, max_requests=1),
                                    dict(buffer_size_gb=0.01, max_tokens_per_step=6, paged_query_limit=2),
                                    dict(buffer_size_gb=TIGHT)],
                         ids=["alone", "chunked-prefill", "preempting"])
def test_greedy_equals_full_recompute(model, config):
    reference = [recompute_greedy(model, p) for p in PROMPTS]
    config = dict(config)  # the parameter's dict serves every model
    if config["buffer_size_gb"] == TIGHT:  # TIGHT blocks and the scratch block, of this model's cache
        context = engine_for(model, buffer_size_gb=0.01).context  # (after the running requests' states)
        block, states = context.bytes_per_block, context.recurrent_state_bytes
        # without attention blocks hold nothing, so nothing is preempted: two requests at a time instead
        config = (dict(buffer_size_gb=((TIGHT + 1) * block + states) / 1024**3) if block
                  else dict(buffer_size_gb=0.01, max_requests=2))
    limit = config.pop("paged_query_limit", None)
    engine = engine_for(model, **config)
    if limit is not None:
        engine.context.paged_query_limit = limit
    assert generate_all(engine, PROMPTS) == reference
    assert not engine.context.recurrent_states  # every finished request's states are gone
    if limit is None and config["buffer_size_gb"] < 0.01:  # requests were preempted: tokens ran more than once
        assert engine.num_tokens_computed > sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)


def test_decode_tokens_run_as_one_batch(model, monkeypatch):
    """Once every request decodes, a step runs each recurrent layer once for all of them (their states
    stacked), not once per request; the output stays full recompute's."""
    mixer = next(m for m in model.modules() if getattr(m, "recurrent", False))
    calls = []
    original = mixer._mix

    def counting(x, state, *args):
        calls.append(x.shape[0])
        return original(x, state, *args)

    monkeypatch.setattr(mixer, "_mix", counting)
    reference = [recompute_greedy(model, p) for p in PROMPTS]
    calls.clear()
    assert generate_all(engine_for(model, buffer_size_gb=0.01), PROMPTS) == reference
    assert len(PROMPTS) in calls  # a decode step of every request: one call of 4 rows
    assert len(calls) < len(PROMPTS) * NEW_TOKENS  # fewer calls than one per request and token


def test_prefill_keeps_the_states_where_training_takes_the_mamba_core(model, monkeypatch):
    """Where Mamba-2's mixer core op runs (the Triton kernels; here its definition stands in for it),
    full recompute takes it and the engine does not: the op keeps no state after the tokens, and
    decoding continues from the state its request's prefill left."""
    calls = []

    def core_by_its_definition(*args):
        *inputs, eps, seq_idx = args
        calls.append(eps)
        return reference(*inputs, seq_idx=seq_idx)

    monkeypatch.setattr(mamba_core, "runs_here", lambda *args: True)
    monkeypatch.setattr(mamba_core, "mamba_core", core_by_its_definition)
    want = [recompute_greedy(model, p) for p in PROMPTS]
    assert set(calls) == ({EPS} if any(isinstance(m, MambaMixer) for m in model.modules()) else set())
    calls.clear()
    assert generate_all(engine_for(model, buffer_size_gb=0.01), PROMPTS) == want
    assert not calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_buffer_holds_the_running_requests_states_first(model, dtype):
    """Each recurrent layer's inference_state_bytes bounds what a request keeps (exactly, in fp32); the
    states of max_requests requests come out of the buffer before the KV blocks; speculative decoding
    keeps num_speculative_tokens + 1 of them."""
    model = copy.deepcopy(model).to(dtype)
    engine = engine_for(model, buffer_size_gb=0.01, max_requests=3)
    engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    kept = {layer: sum(part.nbytes for state in states.values() for part in state)
            for (layer, _), states in engine.context.recurrent_states.items()}
    bound = {m.layer_number: m.inference_state_bytes() for m in model.decoder.modules() if getattr(m, "recurrent", False)}
    assert kept.keys() == bound.keys()
    assert all(kept[n] == bound[n] if dtype == torch.float32 else 0 < kept[n] <= bound[n] for n in kept)
    context = engine.context
    assert context.recurrent_state_bytes == 3 * sum(bound.values())
    if context.bytes_per_block:
        assert context.num_blocks == (int(0.01 * 1024**3) - context.recurrent_state_bytes) // context.bytes_per_block - 1
    speculative = DynamicInferenceContext.from_model(model, InferenceConfig(buffer_size_gb=0.01, block_size=4,
                                                                            max_requests=3, num_speculative_tokens=2))
    assert speculative.recurrent_state_bytes == 3 * context.recurrent_state_bytes


def test_mamba_memory_ratio_caps_the_running_requests(model):
    """A share of the buffer holding two requests' states: at most two run at once, the rest wait; the
    output stays full recompute's. Budgets that hold no request are refused in one line."""
    ratio = 2.5 * state_bytes(model) / (0.01 * 1024**3)
    engine = engine_for(model, buffer_size_gb=0.01, mamba_memory_ratio=ratio)
    assert engine.context.max_requests == 2
    running = []
    step = engine.step
    engine.step = lambda: running.append(len(engine.running)) or step()
    assert generate_all(engine, PROMPTS) == [recompute_greedy(model, p) for p in PROMPTS]
    assert max(running) == 2
    for config, phrase in [(dict(mamba_memory_ratio=ratio / 4), "holds no request's Mamba / Gated DeltaNet states"),
                           (dict(max_requests=10**6), "states of max_requests=1000000 requests")]:
        with pytest.raises(ValueError, match=phrase) as error:
            engine_for(model, buffer_size_gb=0.01, **config)
        assert "\n" not in str(error.value)


def noisy_copy(model, scale):
    """The model with noise on its weights: a draft model that agrees with it on some tokens."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return draft


@pytest.mark.parametrize("n", [1, 3])
def test_speculative_decoding_equals_full_recompute(model, n):
    """A hybrid draft model proposes n tokens a step; the target verifies them one position at a time
    in its recurrent layers, keeping the state after each, so the next step continues from the last
    accepted token (the draft likewise after its rollback): greedy output stays full recompute's,
    with drafts both accepted and rejected."""
    reference = [recompute_greedy(model, p) for p in PROMPTS]
    config = InferenceConfig(buffer_size_gb=0.01, block_size=4, num_speculative_tokens=n)
    engine = DynamicInferenceEngine(model, NullTokenizer(VOCAB), config, draft_model=noisy_copy(model, 0.1))
    assert generate_all(engine, PROMPTS) == reference
    assert 0 < engine.num_draft_tokens_accepted < engine.num_draft_tokens_proposed
    assert not engine.context.recurrent_states and not engine.draft.context.recurrent_states


def state_bytes(model) -> int:
    """What one request's recurrent layers keep in inference, at most."""
    return sum(m.inference_state_bytes() for m in model.decoder.modules() if getattr(m, "recurrent", False))


def test_a_draft_holds_no_more_requests_than_its_state_budget(model):
    """A draft model whose states take more than the target's (12 recurrent layers): under one
    mamba_memory_ratio its context runs fewer requests at once than the target's. It drafts for as many
    as its budget holds, the others decode without drafts meanwhile (and without blocks reserved for
    drafts); greedy output stays full recompute's."""
    torch.manual_seed(1)
    config = TransformerConfig(hybrid_layer_pattern="MG" * 6, **{**HYBRID, "num_layers": 12})
    draft = build_gpt_model(GPTModelConfig(config, vocab_size=VOCAB, max_position_embeddings=64,
                                           position_embedding_type="rope")).eval()
    kept = 2  # states a request keeps with one speculative token
    ratio = 1.5 * kept * state_bytes(draft) / (0.01 * 1024**3)
    engine = DynamicInferenceEngine(model, NullTokenizer(VOCAB), InferenceConfig(
        buffer_size_gb=0.01, block_size=4, num_speculative_tokens=1, mamba_memory_ratio=ratio), draft_model=draft)
    assert engine.draft.context.max_requests == 1 < engine.context.max_requests
    held, running = [], []
    propose = engine.draft.propose

    def counting(requests):
        running.append(len(requests))
        proposals = propose(requests)
        held.append(len(engine.draft.context.block_tables))
        return proposals

    decoding = []  # requests in decode a step
    schedule = engine._schedule

    def recording():
        scheduled = schedule()
        decoding.append(sum(chunk.end - chunk.start <= 1 + engine.num_speculative_tokens and chunk.start > 0
                            for _, chunk in scheduled))
        return scheduled

    engine.draft.propose, engine._schedule = counting, recording
    assert generate_all(engine, PROMPTS) == [recompute_greedy(model, p) for p in PROMPTS]
    assert max(decoding) > 1 and max(running) == max(held) == 1 and engine.num_draft_tokens_proposed > 0


SYSTEM = [7, 3, 9, 12, 40, 41, 42, 43, 44, 45]  # a shared prefix: two full blocks of 4, then two tokens
A = SYSTEM + [1, 2, 3, 4, 5, 6]
B = SYSTEM[:8] + [50, 51, 52, 53, 54]
C = SYSTEM[:8] + [60, 61, 62]
D = A + [70, 71]


def recompute_log_probs(model, prompt, tokens):
    """Full recompute's log-probabilities of `tokens` after `prompt` (the whole sequence at once)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]), None)[0, len(prompt) - 1:-1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def prefill_starts(engine, prompts):
    """Each prompt generated alone, in turn (so the cache holds what the earlier ones left): where its
    prefill started (its cached prefix), checked against full recompute's greedy output and the
    log-probabilities of its tokens."""
    starts = []
    params = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eod=True, return_log_probs=True)
    for prompt in prompts:
        before = engine.num_tokens_computed
        output = engine.generate([prompt], params)[0]
        assert output.token_ids == recompute_greedy(engine.model, prompt)
        torch.testing.assert_close(output.log_probs, recompute_log_probs(engine.model, prompt, output.token_ids),
                                   rtol=0, atol=1e-5)
        starts.append(len(prompt) + NEW_TOKENS - 1 - (engine.num_tokens_computed - before))
    return starts


def caching_engine(model, **config):
    return engine_for(model, buffer_size_gb=0.01, prefix_caching=True, **config)


def test_prefix_caching_starts_recurrent_layers_from_cached_states(model):
    """The recurrent layers' states are cached after a request's prompt's last full block before its
    last token and after the last block its keys and values matched (Megatron's rule): A caches after
    12 tokens; B shares A's first 8 tokens but no state there, so it starts at 0 and caches after 8; C
    then starts at 8 and D (A and more) at 12. Greedy output stays full recompute's."""
    engine = caching_engine(model, prefix_caching_mamba_gb=0.01)
    assert prefill_starts(engine, [A, B, C, D]) == [0, 0, 8, 12]
    cache = engine.context.recurrent_prefixes
    assert len(cache) == 4  # A after 12; B after 8 and 12; D after 16
    assert not engine.context.recurrent_states and not engine.context.recurrent_boundaries
    # A cached prefix whose keys and values are evicted takes its states with it.
    allocator = engine.context.allocator
    allocator.release(allocator.allocate(allocator.num_allocatable()))
    assert len(cache) == 0 and cache.nbytes == 0


def test_prefix_cache_of_states_stays_within_its_budget(model):
    """A budget of one entry: B's state after 12 tokens evicts its state after 8 (least recently used),
    so C finds no state and starts at 0; the output stays full recompute's."""
    probe = caching_engine(model, prefix_caching_mamba_gb=0.01)
    prefill_starts(probe, [A])
    entry = probe.context.recurrent_prefixes.nbytes
    engine = caching_engine(model, prefix_caching_mamba_gb=1.5 * entry / 1024**3)
    assert prefill_starts(engine, [A, B, C]) == [0, 0, 0]
    assert len(engine.context.recurrent_prefixes) == 1


def test_prefix_caching_without_a_state_budget_reuses_no_prefix(model):
    with pytest.warns(UserWarning, match="without prefix_caching_mamba_gb"):
        engine = caching_engine(model)
    assert prefill_starts(engine, [A, B, C, D]) == [0, 0, 0, 0]


@pytest.fixture(scope="module")
def hybrid_mtp_checkpoint(tmp_path_factory):
    """A `teratron train` checkpoint of a hybrid model with an MTP depth of Mamba and attention layers."""
    path = tmp_path_factory.mktemp("hybrid") / "ckpt"
    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--hybrid-layer-pattern",
             "MG*-/*M", "--mtp-num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
             "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--linear-key-head-dim", "8",
             "--linear-value-head-dim", "8", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--num-workers", "0",
             "--no-progress-bar", "--eval-iters", "0", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--init-method-std", "0.3", "--save", str(path), "--save-interval", "2"]
    assert cli.main(["train"] + flags) == 0
    return str(path)


def test_generate_with_drafts_and_cached_prefixes_prints_plain_text(hybrid_mtp_checkpoint, capsys):
    """`teratron generate` on a hybrid checkpoint: with its MTP depth drafting and prefix caching of the
    recurrent states, the text is plain decoding's."""
    argv = ["generate", "--load", hybrid_mtp_checkpoint, "--prompt", "5 17 3 99 42 8 8 1 2", "--max-tokens", "8",
            "--temperature", "0", "--inference-dynamic-batching-buffer-size-gb", "0.001",
            "--inference-dynamic-batching-block-size", "4"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert len(plain.split()) == 8
    assert cli.main(argv + ["--num-speculative-tokens", "1", "--inference-dynamic-batching-prefix-caching",
                            "--inference-dynamic-batching-prefix-caching-mamba-gb", "0.001"]) == 0
    assert capsys.readouterr().out == plain


def test_a_model_without_attention_or_recurrent_layers_is_refused():
    config = TransformerConfig(hybrid_layer_pattern="--", **{**HYBRID, "num_layers": 2})
    mlps = build_gpt_model(GPTModelConfig(config, vocab_size=VOCAB, max_position_embeddings=64,
                                          position_embedding_type="rope"))
    with pytest.raises(ValueError, match="neither attention nor Mamba / Gated DeltaNet layers") as error:
        engine_for(mlps, buffer_size_gb=0.01)
    assert "\n" not in str(error.value)
