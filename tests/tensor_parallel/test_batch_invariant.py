"""batch_invariant_mode (tensor_parallel/batch_invariant.py): a sample's logits are bit-identical
alone and inside batches of other sizes (dense and MoE GPT, sequence length 2, so the GEMMs have
few rows: where oneDNN/MKL sum a row differently with the row count); the inference engine's
log-probabilities of a request are bit-identical alone and next to other requests; the tiled GEMM
equals F.linear up to rounding and has its gradients."""

import pytest
import torch
import torch.nn.functional as F

from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.tensor_parallel.batch_invariant import TILE_ROWS, batch_invariant_linear
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.transformer.transformer_config import TransformerConfig

VOCAB, SEQ = 64, 2
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]  # CUDA: cuBLAS picks its kernel by row count too


def make_model(moe: bool, batch_invariant: bool = True, device: str = "cpu"):
    moe_fields = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True) if moe else {}
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                               batch_invariant_mode=batch_invariant, **moe_fields)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True) if moe else get_gpt_layer_local_spec()
    return GPTModel(config, spec, VOCAB, 32, position_embedding_type="rope").to(device).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_samples_logits_do_not_depend_on_its_batch(moe, device):
    model = make_model(moe, device=device)
    ids = torch.randint(0, VOCAB, (9, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    positions = torch.arange(SEQ, device=device).expand(9, SEQ)
    with torch.no_grad():
        full = model(ids, positions, None)  # [9, SEQ, V]
        for sample in (0, 4, 8):
            alone = model(ids[sample:sample + 1], positions[:1], None)[0]
            assert torch.equal(alone, full[sample]), sample
        for size in (2, 3, 5):
            assert torch.equal(model(ids[:size], positions[:size], None), full[:size]), size


@pytest.mark.parametrize("device", DEVICES)
def test_the_engines_log_probs_do_not_depend_on_the_other_requests(device):
    model = make_model(moe=False, device=device)
    prompts = [[5, 17, 3, 9, 42, 7], [8, 2], [30, 31, 32], [60] * 5]
    params = SamplingParams(temperature=0, num_tokens_to_generate=6, ignore_eod=True, return_log_probs=True)

    def engine():
        return DynamicInferenceEngine(model, NullTokenizer(VOCAB),
                                      InferenceConfig(buffer_size_gb=0.01, block_size=4))
    together = engine().generate(prompts, params)
    for prompt, output in zip(prompts, together):
        alone = engine().generate([prompt], params)[0]
        assert alone.token_ids == output.token_ids and alone.log_probs == output.log_probs  # floats, exactly


def test_tiles_equal_f_linear_and_carry_gradients():
    torch.manual_seed(0)
    x = torch.randn(3, TILE_ROWS + 5, 24, requires_grad=True)  # 2 tiles, the last padded
    weight, bias = torch.randn(40, 24, requires_grad=True), torch.randn(40, requires_grad=True)
    out = batch_invariant_linear(F.linear, x, weight, bias)
    reference = F.linear(x, weight, bias)
    assert out.shape == (3, TILE_ROWS + 5, 40)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (x, weight, bias))
    expected = torch.autograd.grad(reference.square().sum(), (x, weight, bias))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    rows = x.detach().reshape(-1, 24)
    for count in (1, 2, 3, 7, TILE_ROWS + 1):  # any row count: the same bits per row
        assert torch.equal(batch_invariant_linear(F.linear, rows[:count], weight, bias),
                           batch_invariant_linear(F.linear, rows, weight, bias)[:count])


def test_batch_invariance_refuses_fp8():
    with pytest.raises(NotImplementedError, match="^batch_invariant_mode with fp8"):
        TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, batch_invariant_mode=True,
                          fp8="e4m3", bf16=True, params_dtype=torch.bfloat16)
