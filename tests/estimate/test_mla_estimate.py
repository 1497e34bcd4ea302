"""`teratron estimate` of multi-latent-attention models against the real models: parameters per
rank (TP splits the up projections and linear_proj, the down projections are whole on every
rank) and the activation bytes autograd keeps for one micro-batch (single process and per TP
rank with sequence parallelism), with and without query compression, latent norms, both
recompute modules and the flash backend's padded heads; with multi-token-prediction depths (MLA
layers like the last one) too.

On CPU, SDPA takes its fused kernel only for one head size: the activation cases use
qk_head_dim + qk_pos_emb_head_dim == v_head_dim, except the padded (flash backend) case."""

import pytest

from dist import run_distributed
from estimate.test_activations import _tensor_parallel_ranks, estimated_bytes, measured_saved_bytes, parse
from estimate.test_params import BASE as PARAMS_BASE
from estimate.test_params import _per_rank, real_numel
from teratron.estimate.report import estimate_from_args
from teratron.training.arguments import parse_train_args

MLA = ("--multi-latent-attention --kv-lora-rank 12 --qk-head-dim 10 --qk-pos-emb-head-dim 6 --v-head-dim 16 "
       "--rotary-scaling-factor 4 --mscale-all-dim 1 --normalization RMSNorm --swiglu --disable-bias-linear "
       "--position-embedding-type rope")

PARAM_SHAPES = [
    f"{MLA} --q-lora-rank 20 --qk-layernorm",
    f"{MLA} --v-head-dim 8",
    f"{MLA.replace('RMSNorm', 'LayerNorm')} --q-lora-rank 20 --qk-layernorm --num-experts 4 --moe-router-topk 2",
    f"{MLA} --q-lora-rank 20 --qk-layernorm --mtp-num-layers 2",
]


@pytest.mark.parametrize("flags", PARAM_SHAPES)
def test_params_equal_the_real_model(flags):
    args = parse_train_args(PARAMS_BASE + flags.split())
    estimate = estimate_from_args(args, 1, "cpu")
    assert sum(estimate.stages[0].params.values()) == estimate.model_parameters == real_numel(args, 1)


def test_params_per_rank_equal_the_real_model():
    flag_sets = [f"{PARAM_SHAPES[0]} --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
                 f"{PARAM_SHAPES[1]} --tensor-model-parallel-size 4 --sequence-parallel"]
    results = run_distributed(_per_rank, 4, flag_sets, 4)
    for i, flags in enumerate(flag_sets):
        estimate = estimate_from_args(parse_train_args(PARAMS_BASE + flags.split()), 4, "cpu")
        expected = [sum(stage.params.values()) for stage in estimate.stages]
        for rank_results in results:
            pp_rank, numel = rank_results[i]
            assert numel == expected[pp_rank], (flags, pp_rank)


ACTIVATION_CASES = [
    f"--bf16 {MLA} --q-lora-rank 20 --qk-layernorm",
    f"--bf16 {MLA}",                                                  # no compression, no norms
    f"{MLA} --q-lora-rank 20 --qk-layernorm",                         # fp32: the norms keep their input
    f"{MLA.replace('RMSNorm', 'LayerNorm')} --q-lora-rank 20 --qk-layernorm",
    f"--bf16 {MLA} --q-lora-rank 20 --recompute-granularity selective",
    f"--bf16 {MLA} --q-lora-rank 20 --qk-layernorm --num-experts 4 --moe-router-topk 2",
    f"--bf16 {MLA} --num-layers 3 --recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    f"--bf16 {MLA} --q-lora-rank 20 --v-head-dim 8 --attention-backend flash",  # padded heads
    f"--bf16 {MLA} --q-lora-rank 20 --qk-layernorm --mtp-num-layers 2",
    f"{MLA} --mtp-num-layers 1",
    f"--bf16 {MLA} --mtp-num-layers 1 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
]
RECOMPUTE = [["mla_up_proj"], ["mla_up_proj", "core_attn"], ["mla_up_proj", "layernorm"]]


@pytest.mark.parametrize("flags", ACTIVATION_CASES)
def test_saved_activations_match_autograd(flags):
    args = parse(flags)
    assert estimated_bytes(args) == measured_saved_bytes(args)


@pytest.mark.parametrize("modules", RECOMPUTE)
@pytest.mark.parametrize("latents", ["--q-lora-rank 20 --qk-layernorm", ""])
def test_recomputed_up_projections(modules, latents):
    args = parse(f"--bf16 {MLA} {latents} --recompute-granularity selective", recompute_modules=modules)
    assert estimated_bytes(args) == measured_saved_bytes(args)
    assert estimated_bytes(args) < estimated_bytes(parse(f"--bf16 {MLA} {latents}"))
    with_mtp = parse(f"--bf16 {MLA} {latents} --mtp-num-layers 1 --recompute-granularity selective",
                     recompute_modules=modules)
    assert estimated_bytes(with_mtp) == measured_saved_bytes(with_mtp)


def test_saved_activations_per_tensor_parallel_rank():
    flag_sets = [f"--tensor-model-parallel-size 2 --bf16 {MLA} --q-lora-rank 20 --qk-layernorm",
                 f"--tensor-model-parallel-size 2 --sequence-parallel --bf16 {MLA} --q-lora-rank 20 --qk-layernorm",
                 f"--tensor-model-parallel-size 2 --sequence-parallel {MLA}",
                 f"--tensor-model-parallel-size 2 --sequence-parallel --bf16 {MLA} --recompute-granularity selective "
                 "--recompute-modules mla_up_proj"]
    for rank_results in run_distributed(_tensor_parallel_ranks, 2, flag_sets):
        for flags, (measured, estimated) in zip(flag_sets, rank_results):
            assert estimated == measured, flags


def test_compiled_layers_keep_what_the_estimate_counts():
    """--torch-compile (the CUDA default): norms decomposed, RoPE's cos/sin recomputed from the
    shared angles, with the up projections recomputed."""
    for mtp in ("", "--mtp-num-layers 1"):
        args = parse(f"--bf16 {MLA} --q-lora-rank 20 --qk-layernorm --recompute-granularity selective --torch-compile "
                     f"{mtp}", recompute_modules=["mla_up_proj"])
        assert estimated_bytes(args) == measured_saved_bytes(args), mtp
