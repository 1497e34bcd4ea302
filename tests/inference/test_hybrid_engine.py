"""DynamicInferenceEngine serving hybrid models (fp32, CPU): each request's Mamba-2 and Gated
DeltaNet layers carry their convolution and scan states from one step to the next (prefill chunks
and decode tokens), so greedy output equals the model's own greedy decoding by full recompute (the
whole sequence through the model at each step), for requests alone, batched with chunked prefill,
decoding together as one batch, and in a buffer tight enough to preempt (a preempted request recomputes its states); with attention
layers or multi-latent attention layers (per-head or latent cache). Speculative
decoding and prefix caching, which would need states rolled back or shared, are refused."""

import pytest
import torch

from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.models.gpt.gpt_config import GPTModelConfig
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


@pytest.fixture(scope="module", params=["attention", "mla", "mla-latents"])
def model(request):
    """MG*-M, or MG+-M with multi-latent attention (per-head keys and values cached, or the latents)."""
    if request.param == "attention":
        config = TransformerConfig(hybrid_layer_pattern="MG*-M", **HYBRID)
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
        block = engine_for(model, buffer_size_gb=0.01).context.bytes_per_block
        config = dict(buffer_size_gb=(TIGHT + 1) * block / 1024**3)
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


@pytest.mark.parametrize("config, phrase", [(dict(prefix_caching=True), "prefix caching with Mamba"),
                                            (dict(num_speculative_tokens=1), "speculative decoding")])
def test_what_needs_states_rolled_back_is_refused(model, config, phrase):
    with pytest.raises(ValueError, match=phrase):
        engine_for(model, buffer_size_gb=0.01, **config)
