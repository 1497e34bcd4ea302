"""Squared ReLU (Megatron's --squared-relu, Nemotron-H's "relu2") against relu(x)^2 written out
here: the function, the MLP (plain and bias_activation_fusion-compiled), grouped MoE experts; the
flag, its refusals and the record a checkpoint keeps."""

import pytest
import torch
import torch.nn.functional as F

from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from teratron.transformer.mlp import MLP, MLPSubmodules, squared_relu
from teratron.transformer.moe.experts import GroupedMLP
from teratron.transformer.transformer_config import TransformerConfig


def relu_squared(x):
    """max(x, 0)^2, in float64."""
    x = x.double()
    return torch.where(x > 0, x * x, torch.zeros_like(x))


def make_config(**overrides):
    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=16, add_bias_linear=True,
                  activation_func=squared_relu, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.5,
                  use_cpu_initialization=True)
    return TransformerConfig(**{**kwargs, **overrides})


def test_squared_relu_is_the_formula():
    x = torch.linspace(-6, 6, 1201)
    torch.testing.assert_close(squared_relu(x).double(), relu_squared(x), rtol=1e-6, atol=1e-6)
    assert squared_relu(torch.tensor([-2.0, 3.0])).tolist() == [0.0, 9.0]


@pytest.mark.parametrize("fused", [False, True])
def test_mlp_computes_the_formula(fused):
    """fc2(relu(fc1 x + b1)^2) + b2, plain and compiled (bias_activation_fusion)."""
    torch.manual_seed(3)
    mlp = MLP(make_config(bias_activation_fusion=fused),
              MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    with torch.no_grad():
        mlp.linear_fc1.bias.normal_()
    x = torch.randn(5, 2, 32)
    out, bias = mlp(x)
    fc1 = mlp.linear_fc1
    expected = relu_squared(x @ fc1.weight.t() + fc1.bias) @ mlp.linear_fc2.weight.double().t()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert bias is mlp.linear_fc2.bias


def test_grouped_experts_compute_the_formula():
    config = make_config(add_bias_linear=False, num_moe_experts=2, moe_ffn_hidden_size=16)
    torch.manual_seed(4)
    experts = GroupedMLP(2, config)
    tokens, probs = torch.randn(7, 32), torch.rand(7)
    out = experts(tokens, [3, 4], probs)
    expected = torch.cat([relu_squared(chunk @ experts.weight1[e]) @ experts.weight2[e].double()
                          for e, chunk in enumerate(tokens.split([3, 4]))]) * probs[:, None]
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_flag_and_the_checkpoint_record():
    """--squared-relu: relu^2 in the config, recorded as squared_relu and rebuilt from the record;
    with --swiglu, --quick-geglu or --openai-gelu it is refused."""
    from teratron.dist_checkpointing.model_args import gpt_config_from_model_args, model_args_from_config
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import run_config_from_args

    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]

    def run(*argv):
        return run_config_from_args(parse_train_args(base + list(argv)), 1, vocab_size=64, cuda=False)

    t = run("--squared-relu").transformer
    assert (t.gated_linear_unit, t.activation_func, t.ffn_hidden_size) == (False, squared_relu, 128)
    record = model_args_from_config(run("--squared-relu").model)
    assert (record["squared_relu"], record["openai_gelu"], record["swiglu"]) == (True, False, False)
    rebuilt = gpt_config_from_model_args(record).transformer
    assert (rebuilt.gated_linear_unit, rebuilt.activation_func) == (False, squared_relu)
    plain = model_args_from_config(run().model)
    assert plain["squared_relu"] is False
    older = {k: v for k, v in plain.items() if k != "squared_relu"}  # a record from before the flag
    assert gpt_config_from_model_args(older).transformer.activation_func is F.gelu
    for other in ("--swiglu", "--quick-geglu", "--openai-gelu"):
        with pytest.raises(ValueError, match=f"^--squared-relu and {other} each choose the MLP's activation; "
                                             "pass one$"):
            run("--squared-relu", other)
