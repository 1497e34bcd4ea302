"""DynamicInferenceEngine on tiny random Hugging Face models imported with `from_hf` (fp32, CPU).

Greedy output equals transformers' greedy `generate` (dense, MoE, gpt-oss's windows, sinks and
YaRN, DeepSeek-V3's MLA and routing); so does every request when
several run at once with chunked prefill, when a tight KV buffer makes them wait (and preempts),
and with prefix caching, which computes fewer tokens (counted exactly). Every block is free at the
end. Stop tokens, end of document, log-probabilities, seeds, abort and refusals."""

import copy

import pytest
import torch
import transformers
from torch.testing import assert_close

from convert.hf_testing import convert
from dist import run_distributed
from teratron import parallel_state as ps
from teratron.convert.hf import from_hf
from teratron.dist_checkpointing import load_checkpoint, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.tokenizers.null_tokenizer import NullTokenizer

VOCAB = 101

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-5)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=40, attention_bias=True, mlp_bias=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=40, head_dim=16)),  # qk-norm
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    # sinks, a window of 4 on layer 0, YaRN, biased clamped quick-GEGLU experts
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=24, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=16, truncate=False, rope_theta=1000.0))),
    # MLA with YaRN, a dense layer then group-limited sigmoid routing with a shared expert
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, n_shared_experts=1, n_group=4,
        topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, num_nextn_predict_layers=0,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                             mscale_all_dim=0.8, rope_theta=1000.0))),
}
MOE_FAMILIES = ("mixtral", "gpt_oss", "deepseek_v3")
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 1, 64, 23, 11], [8, 2], [30, 31, 32, 33, 34, 35, 36], [60] * 5]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eod=True)


def save_hf_model(family, path, seed=0):
    """A tiny random HF model whose greedy continuations vary with the context: embeddings N(0, 1)
    carry the token through the residual stream, norms near 1, every other weight N(0, 0.3^2)
    (all weights N(0, 0.3^2), as in the conversion tests, make some models repeat one token)."""
    config_cls, model_cls, extra = MODELS[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **extra}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * (
                1.0 if "embed" in name else 0.3))
    model.save_pretrained(path)


@pytest.fixture(scope="module", params=sorted(MODELS))
def hf_model(request, tmp_path_factory):
    """(family, HF folder, teratron GPTModel imported from it)."""
    path = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, path)
    model, _ = from_hf(str(path))
    return request.param, path, model


def hf_greedy(path, prompts, new_tokens=NEW_TOKENS):
    """transformers' greedy continuation of each prompt (one at a time, no end-of-sequence stop)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def engine_for(model, **config):
    config = {"buffer_size_gb": 0.01, "block_size": 4, **config}
    return DynamicInferenceEngine(model, NullTokenizer(VOCAB), InferenceConfig(**config))


def assert_all_blocks_free(engine):
    allocator = engine.context.allocator
    assert not engine.has_unfinished_requests() and engine.context.block_tables == {}
    assert allocator.ref_counts == [0] * engine.context.num_blocks
    assert allocator.num_allocatable() == engine.context.num_blocks


def test_greedy_equals_transformers_alone_batched_chunked_and_waiting(hf_model):
    family, path, model = hf_model
    reference = hf_greedy(path, PROMPTS)
    assert len({t for tokens in reference for t in tokens}) > 15  # the model's output depends on its input
    # One request at a time, then all at once with prefill chunks of up to 3 tokens mixed with
    # decode tokens, then all at once in a buffer of 6 blocks (24 tokens; a request needs up to 5).
    alone = engine_for(model)
    assert [alone.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == reference
    for paged_query_limit in (16, 1):  # prefill chunks with the paged kernel, or as SDPA batches
        chunked = engine_for(model, max_tokens_per_step=3)
        chunked.context.paged_query_limit = paged_query_limit
        outputs, steps = run_steps(chunked, PROMPTS)
        assert [o.token_ids for o in outputs] == reference
        assert all(o.finished and o.finish_reason == "length" for o in outputs)
        assert any(kinds == 2 for kinds, _, _ in steps)  # a step with decode and prefill tokens
    tight = engine_for(model, buffer_size_gb=tight_buffer_gb(alone, 6))
    assert tight.context.num_blocks == 6
    outputs, steps = run_steps(tight, PROMPTS)
    assert [o.token_ids for o in outputs] == reference
    assert max(running for _, running, _ in steps) < len(PROMPTS)  # some waited
    assert any(preempted for _, _, preempted in steps)  # and some gave their blocks back for a while
    for engine in (alone, chunked, tight):
        assert_all_blocks_free(engine)


def run_steps(engine, prompts):
    """Run `prompts` step by step: their final outputs, and per step the number of kinds of chunks
    (decode, prefill), of running requests, and whether a running request went back to waiting
    (preempted)."""
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    final, steps = {}, []
    while engine.has_unfinished_requests():
        running = {r.request_id for r in engine.running}
        final.update({o.request_id: o for o in engine.step() if o.finished})
        preempted = bool(running & {r.request_id for r in engine.waiting})
        kinds = {c.end - c.start > 1 for c in engine.context.chunks}
        steps.append((len(kinds), max(len(running), len(engine.running)), preempted))
    return [final[i] for i in ids], steps


def tight_buffer_gb(engine, num_blocks):
    """A KV budget of `num_blocks` blocks of `engine`'s model (and the scratch block)."""
    return (num_blocks + 1) * engine.context.bytes_per_block / 1024**3


def test_prefix_caching_computes_fewer_tokens_with_the_same_output(hf_model):
    _, path, model = hf_model
    prefix = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12]  # 3 blocks of 4
    # The last prompt is 2 cached blocks: its second block is computed again (for its last logits).
    prompts = [prefix + [40, 41, 42], prefix + [50, 51, 52], prefix + [60, 61], prefix[:8]]
    reference = hf_greedy(path, prompts)
    counts = {}
    for caching in (False, True):
        engine = engine_for(model, prefix_caching=caching)
        first = engine.generate(prompts[:1], GREEDY)
        rest = engine.generate(prompts[1:], GREEDY)  # after the first finished: its blocks are cached
        assert [o.token_ids for o in first + rest] == reference
        assert_all_blocks_free(engine)
        counts[caching] = engine.num_tokens_computed
    decode = NEW_TOKENS - 1  # the last token is never fed back
    assert counts[False] == sum(len(p) + decode for p in prompts)
    # The later prompts share the first's cached blocks (3 of 4 tokens), less one for the last prompt.
    shared = [0, 12, 12, 4]
    assert counts[True] == sum(len(p) - cached + decode for p, cached in zip(prompts, shared))


def test_prefix_caching_in_a_tight_buffer_evicts_and_gives_the_same_output(hf_model):
    _, path, model = hf_model
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 20], [70, 71, 72, 73, 74, 75]] * 2
    engine = engine_for(model, prefix_caching=True, max_tokens_per_step=5,
                        buffer_size_gb=tight_buffer_gb(engine_for(model), 7))
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == hf_greedy(path, prompts)
    assert_all_blocks_free(engine)


def test_log_probs_are_those_of_the_whole_sequence_recomputed(hf_model):
    _, _, model = hf_model
    params = SamplingParams(temperature=0, num_tokens_to_generate=4, ignore_eod=True, return_log_probs=True,
                            top_n_logprobs=2)
    output = engine_for(model, max_tokens_per_step=4).generate([PROMPTS[0], PROMPTS[2]], params)[0]
    sequence = PROMPTS[0] + output.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([sequence[:-1]]), None)[0, len(PROMPTS[0]) - 1:]  # [4, V]
    log_softmax = torch.log_softmax(logits[:, :VOCAB], -1)
    expected = log_softmax.gather(1, torch.tensor(output.token_ids)[:, None])[:, 0]
    assert_close(torch.tensor(output.log_probs), expected, rtol=0, atol=1e-5)
    for step, top in enumerate(output.top_n_logprobs):
        values, ids = log_softmax[step].topk(2)
        assert list(top) == ids.tolist() and output.token_ids[step] == ids[0]
        assert_close(torch.tensor(list(top.values())), values, rtol=0, atol=1e-5)


class _EodTokenizer(NullTokenizer):
    def __init__(self, eod):
        super().__init__(VOCAB)
        self._eod = eod

    @property
    def eod(self):
        return self._eod


def continuation(prompt, generated):
    """The text `generated` adds to the prompt's."""
    detokenize = NullTokenizer(VOCAB).detokenize
    return detokenize(prompt + generated)[len(detokenize(prompt)):]


def test_stop_token_end_of_document_and_text(hf_model):
    _, _, model = hf_model
    tokens = engine_for(model).generate([PROMPTS[0]], GREEDY)[0].token_ids
    stop_at = next(i for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])  # its first occurrence
    params = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, stop_token_ids=(tokens[stop_at],),
                            ignore_eod=True)
    output = engine_for(model).generate([PROMPTS[0]], params)[0]
    assert (output.token_ids, output.finish_reason) == (tokens[:stop_at + 1], "stop")
    assert output.text == continuation(PROMPTS[0], tokens[:stop_at])  # the stop token is no text
    eod_engine = DynamicInferenceEngine(model, _EodTokenizer(tokens[stop_at]),
                                        InferenceConfig(buffer_size_gb=0.01, block_size=4))
    eod = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS)
    assert eod_engine.generate([PROMPTS[0]], eod)[0].token_ids == tokens[:stop_at + 1]
    ignored = eod_engine.generate([PROMPTS[0]], GREEDY)[0]
    assert ignored.token_ids == tokens and ignored.text == continuation(PROMPTS[0], tokens)


def test_a_stop_string_ends_its_request_at_its_token_among_others(hf_model):
    """Text (and stop strings) come one step after the tokens (async scheduling): the request has a
    token in flight when its stop string is found, which is dropped; the others run on unchanged."""
    _, path, model = hf_model
    reference = hf_greedy(path, PROMPTS)
    tokens = reference[0]
    stop_at = next(i for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    stop = continuation(PROMPTS[0], tokens[:stop_at + 1])[len(continuation(PROMPTS[0], tokens[:stop_at])):]
    # Independently: the first token whose text completes the stop string, and the text before it.
    end = next(j for j in range(len(tokens)) if stop in continuation(PROMPTS[0], tokens[:j + 1]))
    full = continuation(PROMPTS[0], tokens[:end + 1])
    stopped = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, stop=(stop,), ignore_eod=True)
    engine = engine_for(model, max_tokens_per_step=6)
    outputs = engine.generate(PROMPTS, [stopped] + [GREEDY] * (len(PROMPTS) - 1))
    assert (outputs[0].token_ids, outputs[0].finish_reason) == (tokens[:end + 1], "stop")
    assert outputs[0].text == full[:full.index(stop)]
    assert [o.token_ids for o in outputs[1:]] == reference[1:]
    assert_all_blocks_free(engine)


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch(hf_model):
    _, _, model = hf_model
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=7, num_tokens_to_generate=NEW_TOKENS, ignore_eod=True)
    other = SamplingParams(temperature=0.8, num_tokens_to_generate=6, ignore_eod=True)
    alone = engine_for(model).generate([PROMPTS[0]], seeded)[0].token_ids
    batched = engine_for(model, max_tokens_per_step=4).generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                                                                 [other, seeded, other])
    assert batched[1].token_ids == alone
    assert len(set(alone)) > 1  # sampled, not a constant


def test_abort_frees_blocks_and_reports_once(hf_model):
    _, _, model = hf_model
    engine = engine_for(model, max_requests=1)
    running, waiting = engine.add_request(PROMPTS[0], GREEDY), engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    assert [r.request_id for r in engine.running] == [running] and len(engine.waiting) == 1
    engine.abort(running)
    engine.abort(waiting)
    engine.abort(12345)  # unknown: nothing to do
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outputs] == [(running, "abort", True),
                                                                             (waiting, "abort", True)]
    assert len(outputs[0].token_ids) == 1 and outputs[1].token_ids == []
    assert engine.step() == []
    assert_all_blocks_free(engine)


def test_requests_that_can_never_run_are_refused_in_one_line(hf_model):
    _, _, model = hf_model
    engine = engine_for(model, buffer_size_gb=tight_buffer_gb(engine_for(model), 3))  # 12 tokens
    refusals = [
        ([1] * 10, SamplingParams(num_tokens_to_generate=4), "needs 4 KV blocks, the buffer holds 3"),
        ([1] * 60, SamplingParams(num_tokens_to_generate=5), "exceeds max_seq_length 64"),
        ([], None, "the prompt has no tokens"),
        ([3, VOCAB], None, f"prompt token id {VOCAB} is outside the vocabulary"),
    ]
    for prompt, params, message in refusals:
        with pytest.raises(ValueError, match=message) as error:
            engine.add_request(prompt, params)
        assert "\n" not in str(error.value)
    engine.add_request([1] * 9, SamplingParams(num_tokens_to_generate=4))  # 12 tokens of keys: fits
    assert not engine.running and len(engine.waiting) == 1


def test_update_weights_drops_cached_prefixes(hf_model):
    """New weights from another model: the engine's output is that model's, also for a prompt whose
    prefix was cached under the old weights."""
    family, _, model = hf_model
    other_path = hf_model[1].parent / f"{family}_other"
    save_hf_model(family, other_path, seed=1)
    other, _ = from_hf(str(other_path))
    engine = engine_for(copy.deepcopy(model), prefix_caching=True)
    prompt = PROMPTS[0] + [1, 2, 3, 4, 5]
    old = engine.generate([prompt], GREEDY)[0].token_ids
    assert engine.context.allocator.num_cached == (len(prompt) + NEW_TOKENS - 1) // 4  # full blocks
    waiting = engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match="update_weights with 1 requests unfinished"):
        engine.update_weights(other)
    engine.abort(waiting)
    assert engine.step()[0].finish_reason == "abort"
    engine.update_weights(other)
    assert engine.context.allocator.num_cached == 0
    new = engine.generate([prompt], GREEDY)[0].token_ids
    assert new == engine_for(other).generate([prompt], GREEDY)[0].token_ids != old
    assert engine.num_tokens_computed == 2 * (len(prompt) + NEW_TOKENS - 1)  # nothing reused
    assert_all_blocks_free(engine)
    # A live training run's chunks (a list; here one process, one chunk) go through refit_weights.
    engine.update_weights([model])
    assert engine.generate([prompt], GREEDY)[0].token_ids == old


def _generate_in_layouts(checkpoint, layouts):
    """On each rank: the greedy outputs of PROMPTS run together (chunked) by an engine over the
    checkpoint loaded at each (tp, ep, dispatcher) layout."""
    checkpoint_dir = storage.resolve_checkpoint_dir(checkpoint)
    model_args = storage.read_metadata(checkpoint_dir)["model_args"]
    # MLA caches every head's key; experts with biases (gpt-oss) run whole on each TP rank.
    groups = model_args["num_attention_heads" if model_args.get("multi_latent_attention") else "num_query_groups"]
    outputs = []
    for tp, ep, dispatcher in layouts:
        etp = 1 if model_args["num_experts"] and model_args["add_bias_linear"] else tp
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp)
        model = build_gpt_model(gpt_config_from_model_args(
            model_args, padded_vocab_size=128 * tp, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp, **({"moe_token_dispatcher_type": dispatcher} if dispatcher else {})))
        load_checkpoint(checkpoint_dir, [model], load_optimizer=False)
        engine = engine_for(model, max_tokens_per_step=4)
        assert engine.context.memory_buffer.shape[-2] == groups // tp  # this rank's query groups
        outputs.append([o.token_ids for o in engine.generate(PROMPTS, GREEDY)])
        ps.destroy_model_parallel()
    return outputs


def test_tensor_and_expert_parallel_engines_give_the_same_output(hf_model, tmp_path):
    """Every rank of a TP = 2 engine (and, for MoE, of an EP = 2 one with the alltoall dispatcher
    and a TP = expert-TP = 2 one, expert-TP 1 for biased experts) runs the same requests and gets
    transformers' tokens."""
    family, path, _ = hf_model
    convert("import-hf", "--hf-path", str(path), "--save", str(tmp_path / "ckpt"))
    layouts = [(2, 1, None)] if family not in MOE_FAMILIES else [(2, 1, "allgather"), (1, 2, "alltoall")]
    reference = hf_greedy(path, PROMPTS)
    for per_rank in run_distributed(_generate_in_layouts, 2, str(tmp_path / "ckpt"), layouts):
        assert per_rank == [reference] * len(layouts)


class _EagerDecodeGraphs:
    """Stands in for DecodeCudaGraphs on the CPU: the same decode steps (padded rows in the
    context's fixed decode buffers), run eagerly instead of replayed."""

    def __init__(self, engine, batch_sizes):
        self.engine, self.batch_sizes, self.num_replays = engine, batch_sizes, 0

    def rows_for(self, num_requests):
        return min((rows for rows in self.batch_sizes if rows >= num_requests), default=None)

    def replay(self, rows):
        self.num_replays += 1
        ids = self.engine.context.decode_ids
        with torch.no_grad():
            return self.engine.model(ids[0, :rows][None], ids[1, :rows][None], None,
                                     inference_context=self.engine.context, runtime_gather_output=True)[0]


def test_decode_steps_in_padded_graph_rows_give_the_same_output(hf_model):
    """The engine's CUDA-graph path (decode steps padded to a graph's row count, the paged kernel
    over the fixed buffers), run eagerly: transformers' greedy output, prefill steps mixed in."""
    family, path, model = hf_model
    if family in MOE_FAMILIES:
        return  # MoE models decode without graphs (see DynamicInferenceEngine._capture_cuda_graphs)
    reference = hf_greedy(path, PROMPTS)
    engine = engine_for(model, max_tokens_per_step=6)
    engine.cuda_graphs = _EagerDecodeGraphs(engine, [1, 3, 64])
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.cuda_graphs.num_replays >= NEW_TOKENS - 1
    assert_all_blocks_free(engine)
