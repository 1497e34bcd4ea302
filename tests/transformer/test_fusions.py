"""The fused paths (Megatron's fusion flags, and whole layers compiled) compute what the plain
ones compute: a tiny GPT's loss and every gradient equal the unfused model's, on CPU (Inductor
writes C++ kernels here, Triton ones on GPU)."""

import pytest
import torch
import torch.nn.functional as F

from teratron import fusions
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.models.gpt.builder import build_gpt_model
from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.transformer.torch_compile import compile_transformer_layers
from teratron.transformer.transformer_config import TransformerConfig
from teratron.transformer.transformer_layer import bias_dropout_add

VOCAB, SEQ, BATCH = 64, 16, 2


def make_model(**config_kwargs):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                               **config_kwargs)
    torch.manual_seed(0)
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")


def loss_and_grads(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    loss = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), labels=labels).mean()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_same_training_math(model, reference):
    loss, grads = loss_and_grads(model)
    ref_loss, ref_grads = loss_and_grads(reference)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("flag", ["apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion"])
def test_each_fusion_flag_equals_the_plain_model(flag):
    assert_same_training_math(make_model(**{flag: True}), make_model())


def test_compiled_layers_equal_eager_layers():
    model = make_model()
    assert compile_transformer_layers(model) == 2
    # Compiling in place keeps parameter names: checkpoints and DDP buckets see the same model.
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in make_model().named_parameters()]
    assert_same_training_math(model, make_model())


def make_hybrid_model():
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=40, hybrid_layer_pattern="MG*-",
        mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, add_bias_linear=False, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = build_gpt_model(GPTModelConfig(config, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                           position_embedding_type="rope"))
    for module in model.modules():  # scan chunks of 8 tokens: the sequence crosses a chunk edge
        if getattr(module, "recurrent", False):
            module.chunk_size = 8
    return model


def test_compiled_hybrid_layers_equal_eager_layers():
    """Mamba layers are compiled too (norm, convolution, gates; the scan stays outside). Against the
    float64 model: the scans' long sums round differently when fused, so each gradient of the
    compiled model and of the eager one must be within 1e-4 of that gradient's largest value."""
    model = make_hybrid_model()
    assert compile_transformer_layers(model) == 4  # M, G, *, -
    exact_loss, exact_grads = loss_and_grads(make_hybrid_model().double())
    for candidate in (model, make_hybrid_model()):
        loss, grads = loss_and_grads(candidate)
        torch.testing.assert_close(loss.double(), exact_loss.double(), rtol=1e-6, atol=0)
        assert grads.keys() == exact_grads.keys()
        for name, exact in exact_grads.items():
            error = (grads[name].double() - exact).abs().max()
            assert error <= 1e-4 * exact.abs().max(), (name, error.item(), exact.abs().max().item())


def test_fused_bias_dropout_add_drops_and_rescales():
    x, bias, residual = torch.ones(4000), torch.full((4000,), 1.0), torch.full((4000,), 5.0)
    out = fusions.fused(bias_dropout_add)((x, bias), residual, 0.25, True)
    kept = out != residual
    # Kept elements are residual + (x + bias) / (1 - p); dropped ones are the residual alone.
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 5.0 + 2.0 / 0.75))
    assert 0.2 < 1 - kept.float().mean().item() < 0.3
    eval_out = fusions.fused(bias_dropout_add)((x, bias), residual, 0.25, False)
    torch.testing.assert_close(eval_out, residual + 2.0)
