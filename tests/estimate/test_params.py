"""Parameter counts per GPU against the numel of real models built by the training code path:
single process for many shapes, then per rank under TP, PP (+ virtual stages) and EP."""


import pytest
import torch

from dist import run_distributed
from teratron.estimate.report import estimate_from_args
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.build import build_model

VOCAB = 250
BASE = (f"--mock-data --tokenizer-type NullTokenizer --vocab-size {VOCAB} --num-layers 4 --hidden-size 64 "
        "--num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --train-iters 1 --lr 1e-3").split()


def real_numel(args, world_size: int) -> int:
    """Parameters this rank's model chunks hold, as `teratron train` builds them."""
    model = build_model(build_run_config(args, world_size), torch.device("cpu"))
    return sum(p.numel() for chunk in model for p in chunk.parameters())


SHAPES = [
    "",
    "--untie-embeddings-and-output-weights",
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear",
    "--group-query-attention --num-query-groups 2 --add-qkv-bias --disable-bias-linear",
    "--group-query-attention --num-query-groups 1 --qk-layernorm --ffn-hidden-size 96",
    "--group-query-attention --num-query-groups 2 --attention-output-gate --apply-layernorm-1p --qk-layernorm",
    "--num-experts 4 --moe-router-topk 2",
    "--num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --swiglu --moe-ffn-hidden-size 48 "
    "--moe-shared-expert-intermediate-size 32",
    "--num-experts 4 --moe-router-topk 2 --moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate",
    "--num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --untie-embeddings-and-output-weights",
    "--mtp-num-layers 2 --position-embedding-type rope",
    "--mtp-num-layers 1 --position-embedding-type none --untie-embeddings-and-output-weights --num-experts 4 "
    "--moe-layer-freq [0,0,0,1] --normalization RMSNorm",
]


@pytest.mark.parametrize("flags", SHAPES)
def test_params_equal_the_real_model(flags):
    args = parse_train_args(BASE + flags.split())
    estimate = estimate_from_args(args, 1, "cpu")
    numel = real_numel(args, 1)
    assert sum(estimate.stages[0].params.values()) == numel
    assert estimate.model_parameters == numel


def _per_rank(flag_sets, world_size):
    from teratron import parallel_state
    from teratron.training.initialize import initialize_model_parallel

    out = []
    for flags in flag_sets:
        args = parse_train_args(BASE + flags.split())
        run = build_run_config(args, world_size)
        initialize_model_parallel(run.transformer, run.distributed)
        try:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            out.append((pp_rank, real_numel(args, world_size)))
        finally:
            parallel_state.destroy_model_parallel()
    return out


DISTRIBUTED = [
    "--tensor-model-parallel-size 2 --swiglu --group-query-attention --num-query-groups 2",
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --position-embedding-type rope",
    "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --num-layers 4",
    "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 --num-layers 6 "
    "--decoder-last-pipeline-num-layers 3",
    "--expert-model-parallel-size 2 --num-experts 4 --moe-router-topk 2 --tensor-model-parallel-size 2 "
    "--sequence-parallel --disable-bias-linear",
    "--expert-model-parallel-size 4 --num-experts 4 --moe-router-topk 2 "
    "--moe-grouped-gemm --swiglu --untie-embeddings-and-output-weights",
    # MTP on the last stage: the stage's embedding copy (tied: the output layer's weight) and the depths.
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --position-embedding-type rope "
    "--mtp-num-layers 2",
    "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --position-embedding-type rope "
    "--mtp-num-layers 1 --untie-embeddings-and-output-weights",
]


def assert_params_per_rank(flag_sets: list, device_type: str = "cpu", world_size: int = 4) -> None:
    """Each rank's real numel equals the estimate's for its pipeline stage, for every flag set."""
    results = run_distributed(_per_rank, world_size, flag_sets, world_size)
    for i, flags in enumerate(flag_sets):
        estimate = estimate_from_args(parse_train_args(BASE + flags.split()), world_size, device_type)
        expected = [sum(stage.params.values()) for stage in estimate.stages]
        for rank_results in results:
            pp_rank, numel = rank_results[i]
            assert numel == expected[pp_rank], (flags, pp_rank)


def test_params_per_rank_equal_the_real_model():
    assert_params_per_rank(DISTRIBUTED)
