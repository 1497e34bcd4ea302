"""The activation model against what autograd really keeps.

A real GPTModel (built by the training code path from `teratron train` flags) runs one
micro-batch forward under `saved_tensors_hooks` (`teratron.estimate.measure`); the bytes of the distinct storages it saves
(parameters excluded) must equal the estimate's bytes for that micro-batch, counted with the
CPU's kernel profile (probed, not assumed). Under TP the same holds per rank, with and without
sequence parallelism.
"""

import pytest
import torch

from dist import run_distributed
from teratron.estimate.activations import norm_bytes
from teratron.estimate.kernels import CUDA_KERNELS, KernelProfile, probe_kernels
from teratron.estimate.report import estimate_from_args
from teratron.estimate.measure import main as measure_main
from teratron.estimate.measure import saved_activation_bytes
from teratron.training.arguments import parse_train_args, validate_args

VOCAB, SEQ, MBS = 250, 32, 2
BASE = (f"--mock-data --tokenizer-type NullTokenizer --vocab-size {VOCAB} --num-layers 2 --hidden-size 64 "
        f"--num-attention-heads 4 --seq-length {SEQ} --micro-batch-size {MBS} --hidden-dropout 0 "
        "--attention-dropout 0 --train-iters 1 --lr 1e-3").split()


def parse(flags: str, **attributes):
    args = parse_train_args(BASE + flags.split())
    vars(args).update(use_cpu_initialization=True, seed=0, **attributes)  # CPU whatever the machine
    return args


def measured_saved_bytes(args, world_size: int = 1) -> int:
    return saved_activation_bytes(args, world_size, torch.device("cpu"))


def estimated_bytes(args, world_size: int = 1) -> int:
    stage = estimate_from_args(args, world_size, "cpu").stages[0]
    assert len(stage.chunk_activations) == 1
    return stage.chunk_activations[0]


CASES = [
    "",                                                            # fp32, LayerNorm, GELU, biases
    "--bf16",
    "--bf16 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear",
    "--normalization RMSNorm --position-embedding-type rope --swiglu",  # fp32 composite RMSNorm
    "--bf16 --group-query-attention --num-query-groups 2",
    "--bf16 --group-query-attention --num-query-groups 2 --position-embedding-type rope --rotary-percent 0.5",
    "--bf16 --qk-layernorm --group-query-attention --num-query-groups 2 --normalization RMSNorm",
    "--qk-layernorm --position-embedding-type rope --normalization RMSNorm",
    "--bf16 --hidden-dropout 0.1 --untie-embeddings-and-output-weights",
    "--bf16 --recompute-granularity selective",
    "--bf16 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "--bf16 --num-layers 3 --recompute-granularity full --recompute-method uniform --recompute-num-layers 2 "
    "--position-embedding-type rope",
    "--bf16 --num-layers 3 --recompute-granularity full --recompute-method block --recompute-num-layers 1",
    "--bf16 --num-experts 4 --moe-router-topk 2",
    "--bf16 --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --swiglu",
    "--bf16 --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --disable-bias-linear "
    "--moe-shared-expert-intermediate-size 32 --moe-aux-loss-coeff 0.01",
]


@pytest.mark.parametrize("flags", CASES)
def test_saved_activations_match_autograd(flags):
    args = parse(flags)
    assert estimated_bytes(args) == measured_saved_bytes(args)


@pytest.mark.parametrize("modules", [["mlp"], ["layernorm"], ["core_attn", "mlp", "layernorm"]])
def test_selective_recompute_modules(modules):
    flags = "--bf16 --recompute-granularity selective --normalization RMSNorm --swiglu"
    args = parse(flags, recompute_modules=modules)
    assert estimated_bytes(args) == measured_saved_bytes(args)


def _tensor_parallel_ranks(flag_sets):
    from teratron.training.initialize import initialize_model_parallel
    from teratron import parallel_state

    results = []
    for flags in flag_sets:
        args = parse(flags)
        validate_args(args, 2)
        initialize_model_parallel(args)
        try:
            results.append((measured_saved_bytes(parse(flags), 2), estimated_bytes(parse(flags), 2)))
        finally:
            parallel_state.destroy_model_parallel()
    return results


def test_saved_activations_per_tensor_parallel_rank():
    flag_sets = [
        "--tensor-model-parallel-size 2 --bf16",
        "--tensor-model-parallel-size 2 --bf16 --sequence-parallel --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --hidden-dropout 0.1",
        "--tensor-model-parallel-size 2 --sequence-parallel --group-query-attention --num-query-groups 2 "
        "--qk-layernorm",
        "--tensor-model-parallel-size 2 --bf16 --sequence-parallel --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1",
        "--tensor-model-parallel-size 2 --bf16 --num-experts 4 --moe-router-topk 2 --swiglu --disable-bias-linear",
        "--tensor-model-parallel-size 2 --bf16 --sequence-parallel --num-experts 4 --moe-router-topk 2 "
        "--moe-shared-expert-intermediate-size 32 --disable-bias-linear --expert-tensor-parallel-size 1",
    ]
    for rank_results in run_distributed(_tensor_parallel_ranks, 2, flag_sets):
        for flags, (measured, estimated) in zip(flag_sets, rank_results):
            assert estimated == measured, flags


def test_probe_reads_the_cpu_kernels():
    cpu = probe_kernels(torch.device("cpu"), torch.bfloat16)
    assert cpu == KernelProfile(fused_rms_norm=False, fused_dropout=False, layer_norm_stat_bytes=2)
    assert probe_kernels(torch.device("cpu"), torch.float32).layer_norm_stat_bytes == 4


def test_norm_bytes_by_kernel():
    class Config:
        normalization = "RMSNorm"

    # fused (CUDA): bf16 input + fp32 1/rms per row; composite: fp32 upcast + fp32 pre-weight value
    assert norm_bytes(Config, CUDA_KERNELS, elements=1000, rows=10, input_bytes=2, input_is_new=True) == 2040
    assert norm_bytes(Config, CUDA_KERNELS, elements=1000, rows=10, input_bytes=2, input_is_new=False) == 40
    composite = KernelProfile(fused_rms_norm=False, fused_dropout=False, layer_norm_stat_bytes=2)
    assert norm_bytes(Config, composite, elements=1000, rows=10, input_bytes=2, input_is_new=False) == 8040
    assert norm_bytes(Config, composite, elements=1000, rows=10, input_bytes=4, input_is_new=False) == 4040
    Config.normalization = "LayerNorm"
    assert norm_bytes(Config, CUDA_KERNELS, elements=1000, rows=10, input_bytes=2, input_is_new=True) == 2080


def test_measure_command(capsys):
    assert measure_main(BASE + ["--bf16", "--swiglu", "--normalization", "RMSNorm"]) == 0
    assert "measured" in capsys.readouterr().out
