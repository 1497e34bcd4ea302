"""GELU's tanh approximation (Megatron's --openai-gelu, GPT-2's "gelu_new") against its formula
written out here: the function, the MLP (plain and bias_activation_fusion-compiled), grouped MoE
experts; the flag, its refusals and the record a checkpoint keeps."""

import math

import pytest
import torch
import torch.nn.functional as F

from teratron.transformer.mlp import MLP, MLPSubmodules, openai_gelu
from teratron.transformer.moe.experts import GroupedMLP
from teratron.transformer.transformer_config import TransformerConfig
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def tanh_gelu(x):
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in float64."""
    x = x.double()
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def make_config(**overrides):
    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=16, add_bias_linear=True,
                  activation_func=openai_gelu, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.5,
                  use_cpu_initialization=True)
    return TransformerConfig(**{**kwargs, **overrides})


def test_openai_gelu_is_the_tanh_formula():
    x = torch.linspace(-6, 6, 1201)
    torch.testing.assert_close(openai_gelu(x).double(), tanh_gelu(x), rtol=1e-6, atol=1e-6)
    assert (openai_gelu(x) - F.gelu(x)).abs().max() > 1e-4  # not the exact GeLU


@pytest.mark.parametrize("fused", [False, True])
def test_mlp_computes_the_formula(fused):
    """fc2(tanh_gelu(fc1 x + b1)) + b2, plain and compiled (bias_activation_fusion)."""
    torch.manual_seed(3)
    mlp = MLP(make_config(bias_activation_fusion=fused),
              MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    with torch.no_grad():
        mlp.linear_fc1.bias.normal_()
    x = torch.randn(5, 2, 32)
    out, bias = mlp(x)
    fc1 = mlp.linear_fc1
    expected = tanh_gelu(x @ fc1.weight.t() + fc1.bias) @ mlp.linear_fc2.weight.double().t()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert bias is mlp.linear_fc2.bias


def test_grouped_experts_compute_the_formula():
    config = make_config(add_bias_linear=False, num_moe_experts=2, moe_ffn_hidden_size=16)
    torch.manual_seed(4)
    experts = GroupedMLP(2, config)
    tokens, probs = torch.randn(7, 32), torch.rand(7)
    out = experts(tokens, [3, 4], probs)
    expected = torch.cat([tanh_gelu(chunk @ experts.weight1[e]) @ experts.weight2[e].double()
                          for e, chunk in enumerate(tokens.split([3, 4]))]) * probs[:, None]
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_flag_and_the_checkpoint_record():
    """--openai-gelu: the tanh GeLU in the config, recorded as openai_gelu and rebuilt from the
    record; --swiglu or --quick-geglu with it is refused."""
    from teratron.dist_checkpointing.model_args import gpt_config_from_model_args, model_args_from_config
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import run_config_from_args

    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]

    def run(*argv):
        return run_config_from_args(parse_train_args(base + list(argv)), 1, vocab_size=64, cuda=False)

    t = run("--openai-gelu").transformer
    assert (t.gated_linear_unit, t.activation_func, t.ffn_hidden_size) == (False, openai_gelu, 128)
    record = model_args_from_config(run("--openai-gelu").model)
    assert (record["openai_gelu"], record["swiglu"], record["quick_geglu"]) == (True, False, False)
    rebuilt = gpt_config_from_model_args(record).transformer
    assert (rebuilt.gated_linear_unit, rebuilt.activation_func) == (False, openai_gelu)
    plain = model_args_from_config(run().model)
    assert plain["openai_gelu"] is False and run().transformer.activation_func is F.gelu
    older = {k: v for k, v in plain.items() if k != "openai_gelu"}  # a record from before the flag
    assert gpt_config_from_model_args(older).transformer.activation_func is F.gelu
    for other in ("--swiglu", "--quick-geglu"):
        with pytest.raises(ValueError, match=f"^--openai-gelu and {other} each choose the MLP's activation; "
                                             "pass one$"):
            run("--openai-gelu", other)
