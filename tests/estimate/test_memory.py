"""Model-state bytes (hand-computed and against the real optimizer), micro-batches the
pipeline schedules hold, the benchmark shape and the `teratron estimate` command."""

import json
from types import SimpleNamespace

import pytest
import torch

from dist import run_distributed
from teratron.distributed import DistributedDataParallelConfig
from teratron.estimate import cli
from teratron.estimate.activations import ChunkActivations
from teratron.estimate.memory import Parallelism, activation_peak, state_bytes
from teratron.estimate.params import ChunkParams
from teratron.estimate.report import estimate_from_args
from teratron.optimizer import OptimizerConfig
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.build import build_model, build_optimizer


def _config(dtype=torch.bfloat16, ep=1):
    return SimpleNamespace(params_dtype=dtype, tensor_model_parallel_size=1, context_parallel_size=1,
                           expert_model_parallel_size=ep, expert_tensor_parallel_size=1)


def _params():
    params = ChunkParams()
    params.add("mlp", 1000)
    params.add("embedding", 200)
    params.add("moe experts", 400, is_expert=True)
    return params


def test_state_bytes_mixed_precision_without_distributed_optimizer():
    states = state_bytes(_config(), OptimizerConfig(bf16=True), DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                         Parallelism(data_parallel_size=4, num_microbatches=1), _params())
    # 1600 params: bf16 weights, fp32 grads, fp32 masters, Adam's two fp32 moments, all replicated.
    assert (states.weights, states.grads, states.master_weights, states.optimizer_states) == (3200, 6400, 6400, 12800)
    # fp32 grad buffer: the masters' grads are views of it; foreach Adam's sqrt(v) temporary,
    # for the larger of the dense and the expert optimizer (they step one after the other).
    assert states.step_transient == 4 * 1200


def test_state_bytes_distributed_optimizer_shards_masters_and_states():
    par = Parallelism(data_parallel_size=4, num_microbatches=1)  # expert DP = 4 / ep 2 = 2
    states = state_bytes(_config(ep=2), OptimizerConfig(bf16=True),
                         DistributedDataParallelConfig(use_distributed_optimizer=True), par, _params())
    masters = 1200 / 4 + 400 / 2
    assert states.grads == 3200  # bf16 grad buffer, full size on every rank
    assert states.master_weights == 4 * masters and states.optimizer_states == 8 * masters
    assert states.step_transient == 4 * masters + 4 * 300  # fp32 copies of bf16 grad shards + Adam


def test_state_bytes_fp32_sgd_and_offload():
    fp32 = state_bytes(_config(torch.float32), OptimizerConfig(optimizer="sgd", sgd_momentum=0.0),
                       DistributedDataParallelConfig(), Parallelism(1, 1), _params())
    assert (fp32.weights, fp32.grads, fp32.master_weights, fp32.optimizer_states) == (6400, 6400, 0, 0)
    assert fp32.step_transient == 0
    offload = state_bytes(_config(), OptimizerConfig(bf16=True, optimizer_cpu_offload=True,
                                                     optimizer_offload_fraction=0.5),
                          DistributedDataParallelConfig(grad_reduce_in_fp32=True), Parallelism(1, 1), _params())
    assert offload.master_weights == 3200 and offload.optimizer_states == 6400
    assert offload.host == 3200 + 6400


def _optimizer_bytes(flags, world_size):
    """(masters + states bytes the real optimizer holds after a step, the estimate's)."""
    from teratron import parallel_state
    from teratron.training.initialize import initialize_model_parallel

    args = parse_train_args(flags)
    estimate = estimate_from_args(args, world_size, "cpu").stages[0].memory.states
    run = build_run_config(args, world_size)
    initialize_model_parallel(run.transformer, run.distributed)
    try:
        model = build_model(run, torch.device("cpu"))
        optimizer = build_optimizer(run, model)
        optimizer.step()
        parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        model_storages = {p.untyped_storage().data_ptr() for chunk in model for p in chunk.parameters()}
        masters = sum(p.nbytes for opt in parts for g in opt.optimizer.param_groups for p in g["params"]
                      if p.untyped_storage().data_ptr() not in model_storages)
        states = sum(t.nbytes for opt in parts for s in opt.optimizer.state.values() for t in s.values()
                     if torch.is_tensor(t) and t.dim() > 0)
    finally:
        parallel_state.destroy_model_parallel()
    return masters + states, estimate.master_weights + estimate.optimizer_states


OPTIMIZER_BASE = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 250 --num-layers 2 --hidden-size 64 "
                  "--num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --train-iters 1 --lr 1e-3 "
                  "--bf16").split()


def test_optimizer_bytes_match_the_real_optimizer():
    real, estimated = _optimizer_bytes(OPTIMIZER_BASE, 1)
    assert real == estimated


def _distributed_optimizer_bytes():
    return _optimizer_bytes(OPTIMIZER_BASE + ["--use-distributed-optimizer", "--num-experts", "4",
                                              "--expert-model-parallel-size", "2"], 4)


def test_distributed_optimizer_bytes_match_the_real_optimizer():
    # Bucket padding makes the ranks' slices of real params differ a little, but every element
    # is owned by exactly one rank of its (expert-)data-parallel group: the totals agree.
    results = run_distributed(_distributed_optimizer_bytes, 4)
    assert sum(real for real, _ in results) == sum(estimated for _, estimated in results)


def _chunks(*stored):
    return [ChunkActivations(extra={"x": n}) for n in stored]


def test_one_f_one_b_holds_pp_minus_rank_microbatches():
    for rank in range(4):
        peak, in_flight, _ = activation_peak(_chunks(1), rank, 4, 8, 4)
        assert (peak, in_flight) == (4 - rank, 4 - rank)
    assert activation_peak(_chunks(1), 0, 4, 2, 4)[:2] == (2, 2)  # fewer micro-batches than stages
    assert activation_peak(_chunks(5), 0, 1, 8, 1)[:2] == (5, 1)  # no pipelining: one at a time


def test_interleaved_schedule_holds_more():
    # pp 2, 2 chunks, 4 micro-batches in groups of 2: rank 0 warms up (2-0-1)*2 + (2-1)*2 = 4
    # forwards, then alternates F/B: 5 in flight at most; rank 1 warms up 2, so 3.
    assert activation_peak(_chunks(1, 1), 0, 2, 4, 2)[:2] == (5, 5)
    assert activation_peak(_chunks(1, 1), 1, 2, 4, 2)[:2] == (3, 3)
    # Chunk sizes count where they are held. Rank 0: F(c0 m0) F(c0 m1) F(c1 m0) F(c1 m1)
    # F(c0 m2) B(c1 m0) F(c0 m3) -> chunk 0 of m0..m3 and chunk 1 of m1.
    assert activation_peak(_chunks(10, 1), 0, 2, 4, 2)[0] == 4 * 10 + 1


BENCHMARK = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 50304 --num-layers 24 --hidden-size 2048 "
             "--ffn-hidden-size 5632 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
             "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
             "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
             "--micro-batch-size 4 --global-batch-size 32 --bf16 --accumulate-allreduce-grads-in-fp32").split()


def test_benchmark_shape(capsys):
    assert cli.main(BENCHMARK + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    params = out["model_parameters"]
    assert round(params / 1e9, 2) == 1.44  # ARCHITECTURE.md: 1.44 B params
    assert out["flops_per_token"] == pytest.approx(8.62e9, rel=1e-3)  # the HF baseline's constant
    states = out["stages"][0]["memory"]["states"]
    assert states["weights"] == 2 * params and states["grads"] == 4 * params
    assert states["master_weights"] == 4 * params and states["optimizer_states"] == 8 * params
    assert out["kernels"] == {"fused_rms_norm": True, "fused_dropout": True, "layer_norm_stat_bytes": 4,
                              "compiled_loss": True, "fused_adam": True, "triton_scans": True}
    assert out["peak_allocated"] > sum(states.values()) - states["step_transient"] - states["host"]


def test_cli_table_and_errors(capsys):
    assert cli.main(BENCHMARK + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                 "--world-size", "8", "--sequence-parallel"]) == 0
    table = capsys.readouterr().out
    assert "DP 2" in table and "stage 1" in table and "PEAK ALLOCATED" in table
    with pytest.raises(ValueError, match="world size"):
        cli.main(BENCHMARK + ["--tensor-model-parallel-size", "2", "--world-size", "3"])
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "--world-size" in capsys.readouterr().out


def test_activation_offloading_moves_layer_activations_to_the_host(capsys):
    offload = ["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj", "mlp"]
    outs = []
    for flags in ([], offload):  # eager layers: the count below is theirs (compiled ones keep Inductor's choice)
        assert cli.main(BENCHMARK + ["--no-torch-compile"] + flags + ["--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    (base,), (off,) = (o["stages"] for o in outs)
    T, h, f = 4 * 2048, 2048, 5632
    # Per layer, bf16: the MLP's fc1 input, fc1 output [T, 2f], act(gate), up, product; attention's
    # QKV output, q and k after RoPE, SDPA's output. The logsumexp [b, np, s] is under the default
    # min_offloaded_tensor_size and stays.
    per_layer = 2 * T * (h + 2 * f + 3 * f) + 2 * T * (3 * h + 2 * h + h)
    assert off["memory"]["host_activations"] == 24 * per_layer  # one micro-batch in flight (PP = 1)
    assert off["chunk_activations"][0] == base["chunk_activations"][0] - 24 * per_layer
    assert off["memory"]["peak_allocated"] < base["memory"]["peak_allocated"] - 20 * per_layer
