"""`teratron train` on 8 CPU ranks under torchrun: TP 2 x PP 2 x DP 2 with sequence parallelism
and the distributed optimizer, and a MoE model with EP 8 (x DP 8), each against a single-process
run of the same model and global batch; TP 2 x PP 2 on 4 ranks too. Every iteration's loss and
grad norm (and the MoE metrics) must equal the single process's, as must the final evaluation.
One torchrun launch per layout: 8 ranks of torch on 2 cores take most of the time starting."""

import json
import os
import subprocess
import sys

import pytest

# 4 layers, hidden 32, seq 16, no dropout, mock data. Vocab 100 pads to 128 alone and to 256 under
# TP 2: padding is not a token, so every layout computes the same loss.
TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--lr", "1e-2", "--lr-warmup-iters", "2", "--log-interval", "1",
        "--eval-interval", "100", "--eval-iters", "1", "--num-workers", "0", "--no-progress-bar",
        "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--seed", "7",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
# Global batch 8: 4 micro-batches per step alone and under TP 2 x PP 2, 2 per rank at DP 2.
DENSE = ["--global-batch-size", "8", "--train-iters", "5"]
# MoE in layers 1 and 3 of 4 (alternating), 8 experts, top-2, aux loss and z-loss. Global batch 16:
# one micro-batch per rank at DP 8, so each EP rank routes its own tokens to all 8 experts.
MOE = ["--global-batch-size", "16", "--train-iters", "4", "--num-experts", "8", "--moe-router-topk", "2",
       "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "24", "--moe-aux-loss-coeff", "0.1",
       "--moe-z-loss-coeff", "0.01", "--moe-per-layer-logging"]
MOE_FLOAT_KEYS = ["load_balancing_loss", "z_loss", "moe_load_imbalance"] + [
    f"{name}_layer_{n}" for n in (1, 3) for name in ("load_balancing_loss", "z_loss", "moe_load_imbalance")]


def _train(args, tmp_path, name, nproc=None):
    """Runs `teratron train` (under torchrun when nproc is given); returns (training records,
    evaluation records, stdout)."""
    launcher = [sys.executable, "-m", "teratron"]
    if nproc:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                    "--standalone", "-m", "teratron"]
    path = tmp_path / f"{name}.jsonl"
    cmd = launcher + ["train"] + TINY + args + ["--metrics-file", str(path)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if "lr" in r], [r for r in records if "lr" not in r], proc.stdout


def _assert_equal_runs(reference, run, keys, name):
    (ref_train, ref_eval, _), (train, evals, _) = reference, run
    assert [r["iteration"] for r in train] == [r["iteration"] for r in ref_train], name
    for a, b in zip(ref_train, train):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5), (name, a["iteration"], key, a[key], b[key])
    assert len(evals) == len(ref_eval) == 2, name
    for a, b in zip(ref_eval, evals):
        assert b.keys() == a.keys(), name
        for key in a.keys() - {"iteration"}:
            assert b[key] == pytest.approx(a[key], rel=1e-5), (name, key, a[key], b[key])


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("dense")
    run = _train(DENSE, tmp_path, "single")
    assert [r["iteration"] for r in run[0]] == [1, 2, 3, 4, 5]
    assert run[0][-1]["lm_loss"] < run[0][0]["lm_loss"]
    return run


def test_tp2_pp2_dp2_sequence_parallel_distributed_optimizer_on_8_ranks(dense_reference, tmp_path):
    run = _train(DENSE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--sequence-parallel", "--use-distributed-optimizer"],
                 tmp_path, "tp2-pp2-dp2", nproc=8)
    assert "(TP 2 x PP 2 x DP 2, 8 process(es))" in run[2]
    _assert_equal_runs(dense_reference, run, ["lm_loss", "grad_norm"], "tp2-pp2-dp2")


def test_tp2_pp2_on_4_ranks(dense_reference, tmp_path):
    run = _train(DENSE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                 tmp_path, "tp2-pp2", nproc=4)
    assert "(TP 2 x PP 2 x DP 1, 4 process(es))" in run[2]
    _assert_equal_runs(dense_reference, run, ["lm_loss", "grad_norm"], "tp2-pp2")


def test_moe_ep8_dp8_on_8_ranks(tmp_path):
    """One expert per rank, tokens exchanged by the alltoall dispatcher (grouped GEMM): losses,
    grad norms, aux/z losses, load imbalance and tokens per expert equal the single process's."""
    reference = _train(MOE, tmp_path, "single")
    assert all(sum(r["tokens_per_expert_layer_1"]) == 16 * 16 * 2 for r in reference[0])  # tokens x top-2
    run = _train(MOE + ["--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "alltoall",
                        "--moe-grouped-gemm"], tmp_path, "ep8", nproc=8)
    assert "(TP 1 x PP 1 x DP 8, EP 8, 8 process(es))" in run[2]
    _assert_equal_runs(reference, run, ["lm_loss", "grad_norm"] + MOE_FLOAT_KEYS, "ep8")
    for a, b in zip(reference[0], run[0]):
        for n in (1, 3):
            assert b[f"tokens_per_expert_layer_{n}"] == a[f"tokens_per_expert_layer_{n}"], (a["iteration"], n)
