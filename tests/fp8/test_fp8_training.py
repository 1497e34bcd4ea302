"""FP8 from the config and the command line: which layers run FP8, bad settings as one-line
errors, and `teratron train --fp8-format hybrid` training like bf16."""

import json

import pytest
import torch
import torch.nn.functional as F

from teratron import cli
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.transformer.transformer_config import TransformerConfig

BF16 = dict(bf16=True, params_dtype=torch.bfloat16)


def config(**overrides):
    kwargs = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=64,
                  use_cpu_initialization=True, fp8="hybrid", **BF16)
    return TransformerConfig(**{**kwargs, **overrides})


def fp8_linears(model):
    return {name for name, module in model.named_modules() if getattr(module, "fp8", None) is not None}


def test_transformer_linears_run_fp8_not_the_embedding_or_output_layer():
    model = GPTModel(config(num_layers=2), get_gpt_layer_local_spec(), 128, 16)
    per_layer = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]
    assert fp8_linears(model) == {f"decoder.layers.{i}.{name}" for i in range(2) for name in per_layer}
    assert model.output_layer.fp8 is None
    assert not any(name.endswith("_scaler") for name in model.state_dict())  # no checkpoint keys


def test_first_last_layers_bf16():
    model = GPTModel(config(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2),
                     get_gpt_layer_local_spec(), 128, 16)
    assert {name.split(".")[2] for name in fp8_linears(model)} == {"1"}  # of layers 0..3
    bf16_only = GPTModel(config(num_layers=2, first_last_layers_bf16=True), get_gpt_layer_local_spec(), 128, 16)
    assert fp8_linears(bf16_only) == set()


VALUE_ERRORS = [
    (dict(bf16=False, params_dtype=torch.float32), r"fp8='hybrid' needs bf16 or fp16 parameters.*\(--bf16\)"),
    (dict(fp8="e5m2"), "fp8='e5m2' is not an FP8 format; use 'e4m3' or 'hybrid'"),
    (dict(fp8_recipe="mxfp8"), "fp8_recipe='mxfp8' is not supported; use 'tensorwise' or 'delayed'"),
    (dict(fp8_recipe="blockwise"), "fp8_recipe='blockwise' is not supported"),
    (dict(fp8_recipe="custom"), "fp8_recipe='custom' is not supported"),
    (dict(fp8_amax_compute_algo="mean"), "fp8_amax_compute_algo='mean' is not valid"),
    (dict(fp8_amax_history_len=0), "fp8_amax_history_len must be a positive integer"),
    (dict(fp8_margin=0.5), "fp8_margin must be an integer"),
    (dict(num_layers_at_start_in_bf16=-1), "num_layers_at_start_in_bf16 must be a non-negative integer"),
    (dict(fp8_recipe="delayed", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     "fp8_recipe='delayed' cannot recompute linear layers"),
    (dict(fp8_recipe="delayed", recompute_granularity="selective", recompute_modules=["mlp"]),
     "fp8_recipe='delayed' cannot recompute linear layers"),
]


@pytest.mark.parametrize("overrides, message", VALUE_ERRORS)
def test_bad_fp8_settings(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_accepted_settings():
    config(fp8="e4m3", fp16=True, bf16=False, params_dtype=torch.float16)
    config(fp8_recipe="tensorwise", recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    config(fp8_recipe="delayed", recompute_granularity="selective", recompute_modules=["core_attn", "layernorm"])
    config(tp_only_amax_red=True, fp8_wgrad=False, fp8_margin=1, fp8_amax_history_len=16, fp8_amax_compute_algo="max")
    with pytest.warns(UserWarning, match="fp8_interval is deprecated"):
        config(fp8_interval=4)
    with pytest.raises(NotImplementedError, match="fp8_param=True: FP8 parameters"):
        config(fp8_param=True)
    with pytest.raises(NotImplementedError, match="fp8_dot_product_attention=True: FP8 attention"):
        config(fp8_dot_product_attention=True)


def test_gemm_sizes_not_divisible_by_16_name_the_layer():
    with pytest.raises(ValueError, match=r"fp8: layer 1 mlp.linear_fc1 multiplies \[40 x 48\] per TP rank"):
        GPTModel(config(hidden_size=48, num_attention_heads=3, ffn_hidden_size=40), get_gpt_layer_local_spec(), 128, 16)


# ----- the command line ---------------------------------------------------------------------------

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2",
        "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--no-progress-bar",
        "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--bf16"]


def train_losses(tmp_path, name, flags, iters):
    metrics = tmp_path / f"{name}.jsonl"
    assert cli.main(["train"] + TINY + flags + ["--train-iters", str(iters), "--metrics-file", str(metrics)]) == 0
    with open(metrics) as f:
        return [r["lm_loss"] for r in map(json.loads, f) if "lr" in r]


def test_fp8_training_follows_bf16(tmp_path):
    """20 steps: every FP8 loss within 2**-5 (3 %) of bf16's. One e4m3 rounding moves a value by up
    to 2**-4; the loss averages many such values, so it moves far less."""
    bf16 = train_losses(tmp_path, "bf16", [], 20)
    assert bf16[-1] < bf16[0]
    runs = {"tensorwise": (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], 20),
            "delayed": (["--fp8-format", "e4m3", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max",
                         "--no-fp8-wgrad"], 5)}
    for name, (flags, iters) in runs.items():
        losses = train_losses(tmp_path, name, flags, iters)
        assert len(losses) == iters and losses != bf16[:iters], name  # FP8 ran, and changed the numbers
        assert losses == pytest.approx(bf16[:iters], rel=2**-5), name


def test_fp8_command_line_errors(capsys):
    for flags, phrase in [(["--fp8-format", "hybrid"], "needs bf16 or fp16 parameters"),
                          (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
                           "--fp8-recipe='mxfp8' is not supported")]:
        argv = [a for a in TINY if a != "--bf16"] + flags + ["--train-iters", "4"]
        assert cli.main(["train"] + argv) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("teratron: error: ") and phrase in err[0], err
