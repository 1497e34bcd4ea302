"""DynamicInferenceEngine serving multi-latent-attention models (fp32, CPU): greedy output equals
the model's own greedy decoding by full recompute (the whole sequence through the model at each
step), with per-head keys and values in the cache and with the latent cache (cache_mla_latents,
absorbed up projections), for requests alone, batched with chunked prefill (paged kernel or SDPA
batches for prefill) and in a tight buffer; the latent cache holds one d_c + d_r vector per token
and layer (keys only: the values are the keys). A checkpoint serves through `load_for_inference(...,
cache_mla_latents=True)` and `teratron generate` (TP 1 and 2); its Hugging Face export is refused."""

import pytest
import torch

from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.transformer.transformer_config import MLATransformerConfig

VOCAB = 101
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 1, 64, 23, 11], [8, 2], [30, 31, 32, 33, 34, 35, 36], [60] * 5]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eod=True)
SHAPES = {
    "yarn, compressed queries": dict(q_lora_rank=16, v_head_dim=6, num_moe_experts=4, moe_router_topk=2),
    "rope, uncompressed queries": dict(q_lora_rank=None, rope_type="rope", v_head_dim=14),
}


def mla_model(shape, cache_mla_latents=False):
    config = MLATransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4,
        rotary_scaling_factor=4.0, original_max_position_embeddings=16, mscale=0.8, mscale_all_dim=1.0,
        qk_layernorm=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, ffn_hidden_size=40,
        init_method_std=0.3, cache_mla_latents=cache_mla_latents, **SHAPES[shape])
    torch.manual_seed(0)
    model = build_gpt_model(GPTModelConfig(config, vocab_size=VOCAB, max_position_embeddings=64,
                                           position_embedding_type="rope", share_embeddings_and_output_weights=False))
    with torch.no_grad():
        model.embedding.word_embeddings.weight.normal_()  # tokens carry through the residual stream
    return model.eval()


def recompute_greedy(model, prompt, new_tokens=NEW_TOKENS):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids]), None)
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def engine_for(model, **config):
    config = {"buffer_size_gb": 0.01, "block_size": 4, **config}
    return DynamicInferenceEngine(model, NullTokenizer(VOCAB), InferenceConfig(**config))


def generate_all(engine, prompts):
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.token_ids
    return [outputs[i] for i in ids]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape_and_reference(request):
    model = mla_model(request.param)
    reference = [recompute_greedy(model, p) for p in PROMPTS]
    assert len({t for tokens in reference for t in tokens}) > 12  # the output depends on the input
    return request.param, model, reference


@pytest.mark.parametrize("latents", [False, True])
def test_greedy_equals_full_recompute(shape_and_reference, latents):
    shape, plain_model, reference = shape_and_reference
    model = mla_model(shape, cache_mla_latents=latents)
    for a, b in zip(model.state_dict().values(), plain_model.state_dict().values()):
        assert torch.equal(a, b)  # the same weights: only what the cache holds differs
    alone = engine_for(model)
    assert [alone.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == reference
    for paged_query_limit in (16, 1):  # prefill chunks with the paged kernel, or as SDPA batches
        chunked = engine_for(model, max_tokens_per_step=3)
        chunked.context.paged_query_limit = paged_query_limit
        assert generate_all(chunked, PROMPTS) == reference
    tight = engine_for(model, buffer_size_gb=7 * alone.context.bytes_per_block / 1024**3)
    assert generate_all(tight, PROMPTS) == reference
    config = model.config
    cached = config.kv_lora_rank + config.qk_pos_emb_head_dim if latents else \
        max(config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim)
    heads = 1 if latents else config.num_attention_heads
    kinds = 1 if latents else 2  # the latent is both key and value: stored once
    assert alone.context.memory_buffer.shape[0] == kinds and alone.context.memory_buffer.shape[-2:] == (heads, cached)
    assert alone.context.bytes_per_block == kinds * config.num_layers * 4 * heads * cached * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A `teratron train` checkpoint of an MLA model (one iteration)."""
    from teratron import cli

    path = tmp_path_factory.mktemp("mla") / "ckpt"
    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
             "--lr", "1e-3", "--train-iters", "1", "--num-workers", "0", "--no-progress-bar", "--eval-iters", "0",
             "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--init-method-std", "0.3",
             "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8",
             "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rotary-scaling-factor", "4", "--qk-layernorm",
             "--save", str(path), "--save-interval", "1"]
    assert cli.main(["train"] + flags) == 0
    return str(path)


def test_a_checkpoint_serves_with_the_latent_cache(checkpoint):
    from teratron.inference.loading import load_for_inference

    plain, tokenizer = load_for_inference(checkpoint, device="cpu")
    latent, _ = load_for_inference(checkpoint, device="cpu", cache_mla_latents=True)
    assert latent.config.cache_mla_latents and not plain.config.cache_mla_latents
    prompt = [5, 17, 3, 99, 42]
    expected = recompute_greedy(plain, prompt, 6)
    engine = DynamicInferenceEngine(latent, tokenizer, InferenceConfig(buffer_size_gb=0.01, block_size=4))
    assert engine.generate([prompt], SamplingParams(temperature=0, num_tokens_to_generate=6,
                                                    ignore_eod=True))[0].token_ids == expected


def test_latent_cache_of_a_model_without_mla_is_refused(tmp_path):
    from teratron import cli
    from teratron.inference.loading import load_for_inference

    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "1",
             "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
             "--lr", "1e-3", "--train-iters", "1", "--num-workers", "0", "--no-progress-bar", "--eval-iters", "0",
             "--save", str(tmp_path / "dense"), "--save-interval", "1"]
    assert cli.main(["train"] + flags) == 0
    with pytest.raises(ValueError, match="--cache-mla-latents: the model of --load .* has no multi-latent attention"):
        load_for_inference(str(tmp_path / "dense"), device="cpu", cache_mla_latents=True)


def _generate_on_ranks(argv):
    import contextlib
    import io

    from teratron import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return out.getvalue()


def test_generate_under_tensor_parallelism_equals_tp1(checkpoint, capsys):
    """`teratron generate` at TP 2 (heads split, down projections whole on both ranks) prints what
    TP 1 prints, with either cache."""
    from dist import run_distributed
    from teratron import cli

    argv = ["generate", "--load", checkpoint, "--prompt", "5 17 3 99 42", "--max-tokens", "8", "--temperature", "0",
            "--inference-dynamic-batching-buffer-size-gb", "0.001", "--inference-dynamic-batching-block-size", "4"]
    assert cli.main(argv) == 0
    reference = capsys.readouterr().out
    assert len(reference.split()) == 8
    for extra in ([], ["--cache-mla-latents"]):
        rank0, rank1 = run_distributed(_generate_on_ranks, 2, argv + extra + ["--tensor-model-parallel-size", "2"])
        assert (rank0, rank1) == (reference, ""), extra


def test_hugging_face_export_refuses_what_deepseek_v3_lacks(checkpoint, tmp_path):
    """MLA exports as DeepSeek-V3 (tests/convert/test_hf_families.py); this model's linear biases
    have no place there."""
    from teratron.convert.hf import export_hf

    with pytest.raises(ValueError, match="^the checkpoint's MLA model has add_bias_linear=True; DeepSeek-V3 needs"):
        export_hf(checkpoint, str(tmp_path / "hf"))
