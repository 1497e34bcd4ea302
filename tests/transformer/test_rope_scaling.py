"""Llama 3.x RoPE scaling (GPTModelConfig.rope_scaling, `--use-rope-scaling`): the frequencies
against the rule written out per pair here, the model's RoPE built with them, the flags, the
checkpoint record and the config's refusals."""

import math

import pytest
import torch

from teratron.dist_checkpointing.model_args import gpt_config_from_model_args, model_args_from_config
from teratron.models.gpt.builder import build_gpt_model
from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.training.arguments import parse_train_args
from teratron.training.config import run_config_from_args
from teratron.transformer.rope import RotaryEmbedding, llama3_inv_freq
from teratron.transformer.transformer_config import TransformerConfig


def test_frequencies_follow_the_llama3_rule():
    """Head 16, base 1000, factor 4, bounds 1 and 4 over 64 positions: wavelengths under 16 keep
    their frequency, over 64 are divided by 4, between them the blend; each regime occurs."""
    d, base, factor, low, high, original = 16, 1000.0, 4.0, 1.0, 4.0, 64
    freqs = RotaryEmbedding(d, rotary_base=base, rope_scaling=True, rope_scaling_factor=factor,
                            rope_scaling_low_freq_factor=low, rope_scaling_high_freq_factor=high,
                            rope_scaling_original_max_position_embeddings=original).inv_freq.double()
    regimes = set()
    for i in range(d // 2):
        theta = base ** (-2 * i / d)
        wavelength = 2 * math.pi / theta
        if wavelength < original / high:
            expected, regime = theta, "kept"
        elif wavelength > original / low:
            expected, regime = theta / factor, "divided"
        else:
            r = (original / wavelength - low) / (high - low)
            expected, regime = (1 - r) * theta / factor + r * theta, "blended"
        regimes.add(regime)
        assert freqs[i].item() == pytest.approx(expected, rel=1e-6), i
    assert regimes == {"kept", "divided", "blended"}
    # Megatron's defaults are Llama 3.1's: factor 8, bounds 1 and 4 over 8192 positions.
    plain = RotaryEmbedding(128, rotary_base=500000.0).inv_freq
    assert torch.equal(RotaryEmbedding(128, rotary_base=500000.0, rope_scaling=True).inv_freq,
                       llama3_inv_freq(plain, 8.0, 1.0, 4.0, 8192))
    with pytest.raises(ValueError, match="needs high_freq_factor > low_freq_factor > 0"):
        llama3_inv_freq(plain, 8.0, 4.0, 4.0, 8192)


def _model_config(**model):
    transformer = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                                    attention_dropout=0.0, add_bias_linear=False, use_cpu_initialization=True,
                                    init_method_std=0.3)
    return GPTModelConfig(transformer, vocab_size=64, max_position_embeddings=128, position_embedding_type="rope",
                          rotary_base=1000, make_vocab_size_divisible_by=1, **model)


SCALING = dict(rope_scaling=True, rope_scaling_factor=4.0, rope_scaling_low_freq_factor=1.0,
               rope_scaling_high_freq_factor=4.0, rope_scaling_original_max_position_embeddings=64)


def test_the_model_rotates_by_the_scaled_frequencies_and_records_them():
    torch.manual_seed(3)
    scaled = build_gpt_model(_model_config(**SCALING))
    plain = build_gpt_model(_model_config())
    plain.load_state_dict(scaled.state_dict())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (scaled(ids, None) - plain(ids, None)).abs().max() > 0.1
        plain.rotary_pos_emb.inv_freq.copy_(llama3_inv_freq(plain.rotary_pos_emb.inv_freq, 4.0, 1.0, 4.0, 64))
        torch.testing.assert_close(scaled(ids, None), plain(ids, None), rtol=0, atol=0)
    record = model_args_from_config(_model_config(**SCALING))
    assert record["use_rope_scaling"] and record["rope_scaling_original_max_position_embeddings"] == 64
    rebuilt = gpt_config_from_model_args(record)
    assert {name: getattr(rebuilt, name) for name in SCALING} == SCALING
    unscaled = model_args_from_config(_model_config())
    assert unscaled["use_rope_scaling"] is False and "rope_scaling_factor" not in unscaled


def test_refusals():
    with pytest.raises(ValueError, match=r"^rope_scaling \(Llama 3.x\) scales plain RoPE"):
        GPTModelConfig(_model_config().transformer, vocab_size=64, max_position_embeddings=32, rope_scaling=True)
    with pytest.raises(ValueError, match=r"^rope_scaling_high_freq_factor=1.0 must exceed "
                                         r"rope_scaling_low_freq_factor"):
        _model_config(rope_scaling=True, rope_scaling_high_freq_factor=1.0)


def test_flags():
    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
            "--position-embedding-type", "rope"]

    def run(*argv):
        return run_config_from_args(parse_train_args(base + list(argv)), 1, vocab_size=64, cuda=False).model

    model = run("--use-rope-scaling", "--rope-scaling-factor", "32", "--rope-scaling-low-freq-factor", "2",
                "--rope-scaling-high-freq-factor", "8", "--rope-scaling-original-max-position-embeddings", "4096")
    assert (model.rope_scaling, model.rope_scaling_factor, model.rope_scaling_low_freq_factor,
            model.rope_scaling_high_freq_factor, model.rope_scaling_original_max_position_embeddings) == (
        True, 32.0, 2.0, 8.0, 4096)
    assert (run().rope_scaling, run("--use-rope-scaling").rope_scaling_factor) == (False, 8.0)
    with pytest.raises(ValueError, match=r"^--use-rope-scaling \(Llama 3.x\) scales plain RoPE"):
        run("--use-rope-scaling", "--position-embedding-type", "learned_absolute")
