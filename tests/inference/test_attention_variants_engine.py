"""The engine serves sliding-window layers, learned attention sinks, NoPE layers and a clamped
SwiGLU: greedy output equals the model's own greedy decoding with the whole context recomputed
each token (no cache), for prefill chunks through the paged kernel and through SDPA batches."""

import pytest
import torch

from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.training.arguments import parse_train_args
from teratron.training.config import run_config_from_args

VOCAB = 101
FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size",
         str(VOCAB), "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
         # Windows of 3 keys back on layers 1 and 3, learned sinks, layer 2 without RoPE, a clamp.
         "--window-size", "3,0", "--window-attn-skip-freq", "2", "--softmax-type", "learnable",
         "--no-rope-freq", "[0,1,0,0]", "--activation-func-clamp-value", "1.5"]
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 1, 64, 23, 11], [8, 2], [30, 31, 32, 33, 34, 35, 36]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    args = parse_train_args(FLAGS)
    config = run_config_from_args(args, 1, VOCAB, cuda=False).model
    model = build_gpt_model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # varied weights, sinks of either sign
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * (
                1.0 if "embedding" in name or "softmax_offset" in name else 0.3))
    assert {n for n, _ in model.named_parameters() if "softmax_offset" in n}  # the sinks are parameters
    return model


def recomputed_greedy(model, prompt):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([tokens]), None)[0, -1, :VOCAB]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("paged_query_limit", [16, 1])
def test_greedy_equals_recomputed_decoding(model, paged_query_limit):
    reference = [recomputed_greedy(model, p) for p in PROMPTS]
    assert len({t for tokens in reference for t in tokens}) >= 6  # the output depends on the input
    engine = DynamicInferenceEngine(model, NullTokenizer(VOCAB),
                                    InferenceConfig(buffer_size_gb=0.01, block_size=4, max_tokens_per_step=5))
    engine.context.paged_query_limit = paged_query_limit
    assert sorted(engine.context.layer_windows) == [1, 3] and sorted(engine.context.layer_sinks) == [1, 2, 3, 4]
    params = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eod=True)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == reference


def test_windows_on_every_layer_bound_the_kv_cache(model):
    """Window 3 on every layer: blocks wholly before a request's window are freed as it goes, so a
    request holds at most the blocks of its window and next chunk; greedy output is unchanged."""
    torch.manual_seed(1)
    skip = FLAGS.index("--window-attn-skip-freq")
    args = parse_train_args(FLAGS[:skip] + FLAGS[skip + 2:])
    windowed = build_gpt_model(run_config_from_args(args, 1, VOCAB, cuda=False).model).eval()
    windowed.load_state_dict(model.state_dict())
    reference = [recomputed_greedy(windowed, p) for p in PROMPTS]
    engine = DynamicInferenceEngine(windowed, NullTokenizer(VOCAB),
                                    InferenceConfig(buffer_size_gb=0.01, block_size=2, max_tokens_per_step=5))
    assert engine.context.kv_window == 3
    params = SamplingParams(temperature=0, num_tokens_to_generate=NEW_TOKENS, ignore_eod=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    final, most_held, freed = {}, 0, False
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        for request in engine.running:
            held = [b for b in engine.context.block_tables[request.request_id] if b != engine.context.scratch_block]
            freed |= len(held) < len(engine.context.block_tables[request.request_id])
            most_held = max(most_held, len(held))
    assert [final[i].token_ids for i in ids] == reference
    # Keys 3 back, the next chunk of up to 5 tokens, a block boundary on each side: 10 tokens, 5 blocks.
    assert freed and most_held <= 5
    assert engine.context.allocator.num_allocatable() == engine.context.num_blocks
