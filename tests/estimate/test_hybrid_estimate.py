"""`teratron estimate` of hybrid models (--hybrid-layer-pattern): parameters per rank against real
models' numel (one process, TP 2, PP 2 by the pattern's '|', MTP depths of hybrid layers);
activations against what autograd keeps with the Mamba, Gated Delta Product and Gated DeltaNet layers
on their Triton kernels, as a GPU runs them, in one process and under TP 2 and CP 2
(hybrid_estimate_cases.py, in Triton's interpreter); what the estimate does not model refused in one
line."""

import dataclasses
import json

import pytest

from estimate.hybrid_estimate_cases import GDP, MLA, PARTS, SIZES
from estimate.test_params import BASE, assert_params_per_rank, real_numel
from kernel_tests import run_in_the_interpreter
from teratron.estimate import cli
from teratron.estimate.activations import NotModelled
from teratron.estimate.report import estimate_from_args
from teratron.training.arguments import parse_train_args

MOE = " --num-experts 4 --moe-router-topk 2"
SHAPES = [
    "--hybrid-layer-pattern MG*-",
    "--hybrid-layer-pattern MG*-E --normalization RMSNorm" + MOE,
    "--hybrid-layer-pattern M*-/G-/G- --untie-embeddings-and-output-weights --position-embedding-type rope",
    "--hybrid-layer-pattern GEGE/M- --bf16 --position-embedding-type none --mamba-num-heads 4" + MOE,
    "--hybrid-layer-pattern M+-G+E/+- --normalization RMSNorm" + MLA + MOE,
    "--hybrid-layer-pattern MG*-" + GDP,
    "--hybrid-layer-pattern M*-/M- --bf16 --mamba-num-heads 4 --gdp-num-householder 2 --position-embedding-type rope"
    + GDP,
]


def _args(flags: str):
    return parse_train_args(BASE + (SIZES + flags).split())


@pytest.mark.parametrize("flags", SHAPES)
def test_params_equal_the_real_model(flags):
    args = _args(flags)
    estimate = estimate_from_args(args, 1, "cuda")  # the CUDA kernels' activations (the CPU's: not modelled)
    numel = real_numel(args, 1)
    assert sum(estimate.stages[0].params.values()) == numel
    assert estimate.model_parameters == numel


DISTRIBUTED = [
    "--tensor-model-parallel-size 2 --sequence-parallel --hybrid-layer-pattern MGE*- --disable-bias-linear" + MOE,
    "--pipeline-model-parallel-size 2 --hybrid-layer-pattern MG*|-M/G- --position-embedding-type rope "
    "--tensor-model-parallel-size 2",
    "--pipeline-model-parallel-size 2 --hybrid-layer-pattern M+|-G+ --tensor-model-parallel-size 2" + MLA,
    "--pipeline-model-parallel-size 2 --hybrid-layer-pattern MG*|-M/M- --tensor-model-parallel-size 2 "
    "--gdp-num-householder 2 --position-embedding-type rope" + GDP,
]


def test_params_per_rank_equal_the_real_model():
    assert_params_per_rank([SIZES + flags for flags in DISTRIBUTED], "cuda")


@pytest.mark.parametrize("part", PARTS)
def test_activations_equal_what_autograd_keeps_on_the_triton_kernels(part):
    """One process, TP 2 and CP 2 (gloo), each in a subprocess of its own."""
    assert run_in_the_interpreter(__file__, "hybrid_estimate_cases.py", part) == f"checked {len(PARTS[part])} cases"


@pytest.mark.parametrize("flags, device, phrase", [
    ("--hybrid-layer-pattern M*", "cpu", "Mamba and Gated DeltaNet layers off the GPU run PyTorch reference scans"),
    ("--hybrid-layer-pattern M*- --fine-grained-activation-offloading --offload-modules mlp", "cuda",
     "--fine-grained-activation-offloading with --hybrid-layer-pattern"),
])
def test_what_is_not_modelled_is_one_line(flags, device, phrase):
    with pytest.raises(NotModelled, match=phrase) as error:
        estimate_from_args(_args(flags), 2, device)
    assert "\n" not in str(error.value)


def test_the_command_on_a_hybrid_model(capsys):
    """The table and JSON of a Nemotron-H-like pattern over PP 2 on 4 GPUs (the CUDA kernels); the
    NOTE that the pattern overrides --num-layers goes to stderr under --json."""
    flags = BASE + (SIZES + "--hybrid-layer-pattern M-M*-|M-M*- --pipeline-model-parallel-size 2 --bf16 "
                            "--normalization RMSNorm --swiglu --disable-bias-linear").split()
    assert cli.main(flags + ["--world-size", "4"]) == 0
    table = capsys.readouterr().out
    assert "stage 1" in table and "mamba" in table and "PEAK ALLOCATED" in table
    assert cli.main(flags + ["--world-size", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["dp"] == 2 and all(stage["chunk_activations"][0] > 0 for stage in out["stages"])


def test_the_command_on_a_gated_delta_product_model(capsys):
    """`teratron estimate` takes Megatron's --spec of GDP layers and --gdp-num-householder: each of the two
    M layers (h 64: 8 heads of 16, 2 groups of state 16, M = 2) holds in_proj 3 x (128 + 32 + 8) x 64,
    the convolution's weight (2 x 128 + 3 x 32) x 4 taps, dt_bias and A_log 8 each, the norm's 128 and
    out_proj 64 x 128 = 42,000 parameters, listed as "gated delta product"."""
    flags = BASE + (SIZES + "--hybrid-layer-pattern M*-M --gdp-num-householder 2" + GDP).split()
    assert cli.main(flags + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stages"][0]["params"]["gated delta product"] == 2 * 42000
    assert "mamba" not in out["stages"][0]["params"]
    assert cli.main(flags) == 0
    assert "gated delta product" in capsys.readouterr().out


def test_context_parallel_transients_of_the_mixers():
    """A recurrent mixer's exchange under CP 4, counted by hand: T = 16 x 2 tokens per rank, bf16; it sends
    (and receives) every share's channels of its tokens. Mamba: 8 heads of 4 in 2 groups of state 8, so a
    share is 2 heads reading one group: x 2 x 4, B and C 8 each, dt 2 = 26 channels. Gated DeltaNet: 8
    value heads of 4 reading 4 key heads of 8, so a share is 2 value heads and one key head: q, k 8 each,
    v 2 x 4, b and a 2 each = 28 channels. Gated Delta Product (the M layers, M = 2 substeps): V_0, V_1
    2 x 4 each, K_0, K_1 and Q 8 each, b_0, b_1 and a 2 each = 46 channels. An MLP layer exchanges nothing."""
    from teratron.estimate.activations import Dims, context_parallel_transients
    from teratron.transformer.transformer_config import TransformerConfig

    d = Dims(s=16, b=2, tp=1, sp=False, a=2, r=2)
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                               context_parallel_size=4, hybrid_layer_pattern="MG-", mamba_num_heads=8,
                               mamba_head_dim=4, mamba_num_groups=2, mamba_state_dim=8, linear_num_value_heads=8,
                               linear_num_key_heads=4, linear_key_head_dim=8, linear_value_head_dim=4)
    assert context_parallel_transients(config, d, 1, "M") == (2 * 2 * 32 * 4 * 26,) * 2
    assert context_parallel_transients(config, d, 2, "G") == (2 * 2 * 32 * 4 * 28,) * 2
    assert context_parallel_transients(config, d, 3, "-") == (0, 0)
    gdp = dataclasses.replace(config, gdp_layers=True, gdp_num_householder=2)
    assert context_parallel_transients(gdp, d, 1, "M") == (2 * 2 * 32 * 4 * 46,) * 2
