"""`teratron train` with FSDP (--use-torch-fsdp2, --use-megatron-fsdp) under torchrun (gloo, CPU)
against the single process: every iteration's loss and grad norm must equal it.

Each sharding strategy (no_shard: DDP, optim: the distributed optimizer, optim_grads and
optim_grads_params: FSDP2) at DP 2 and DP 4, through both flags; FSDP x TP 2 with sequence parallelism,
saving a checkpoint that TP 2 without FSDP continues; FSDP x PP 2; FSDP x CP 2 with full recompute;
selective recompute with activation offloading; FP8 linears; FSDP with MoE at EP 2 (experts
sharded over expert DP); hybrid sharding (2 instances at DP 4) whose checkpoint FSDP at DP 2
continues; Muon and Lion; MTP; meta-device initialisation (bit-identical to building with values). In bf16 (fp32 grads), FSDP's fp32 shards are the master weights: a
checkpoint saved under FSDP continues under the distributed optimizer with the uninterrupted
run's losses, and back.
"""

import pytest

from teratron.distributed import DistributedDataParallelConfig
from train_runs import assert_same_losses, train, training_records

TINY = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "1e-2", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
        "--num-workers", "0", "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--seed", "7", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--train-iters", "3", "--mock-data"]
BF16 = ["--bf16", "--accumulate-allreduce-grads-in-fp32"]
FSDP2 = ["--use-torch-fsdp2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "24",
       "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01"]


def _train(args, tmp_path, name, nproc=None):
    return training_records(train(TINY + args, tmp_path, name, nproc)[0])


_assert_equal = assert_same_losses


def _resume_at(checkpoint, iteration: int):
    (checkpoint / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return ["--load", str(checkpoint)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = _train([], tmp_path_factory.mktemp("single"), "single")
    assert run[-1]["lm_loss"] < run[0]["lm_loss"]
    return run


def _megatron_fsdp(strategy):
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]


@pytest.mark.parametrize("flags, nproc", [
    (FSDP2, 2), (_megatron_fsdp("optim_grads_params"), 4),
    (FSDP2 + ["--torch-fsdp2-no-reshard-after-forward"], 4), (_megatron_fsdp("optim_grads"), 2),
    (_megatron_fsdp("optim"), 2), (_megatron_fsdp("optim"), 4),
    (_megatron_fsdp("no_shard"), 2), (_megatron_fsdp("no_shard"), 4),
], ids=["torch-fsdp2-dp2", "optim-grads-params-dp4", "torch-fsdp2-no-reshard-dp4", "optim-grads-dp2",
        "optim-dp2", "optim-dp4", "no-shard-dp2", "no-shard-dp4"])
def test_each_strategy_equals_the_single_process(reference, tmp_path, flags, nproc):
    _assert_equal(reference, _train(flags, tmp_path, "run", nproc), flags[-1])


def test_tensor_and_sequence_parallel_and_a_checkpoint_continued_without_fsdp(reference, tmp_path):
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    run = _train(FSDP2 + tp + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"], tmp_path, "tp2-fsdp", 4)
    _assert_equal(reference, run, "tp2-fsdp")
    resumed = _train(tp + _resume_at(tmp_path / "ckpt", 2), tmp_path, "tp2-from-fsdp", 2)
    assert [r["iteration"] for r in resumed] == [3]
    _assert_equal(reference, resumed, "tp2-from-fsdp")


def test_hybrid_sharding_and_its_checkpoint_continued_at_dp2(reference, tmp_path):
    """--num-distributed-optimizer-instances 2 at DP 4: shards over 2 ranks, replicated over the
    2 instances (the grad norm counts each shard once)."""
    hybrid = FSDP2 + ["--num-distributed-optimizer-instances", "2"]
    run = _train(hybrid + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"], tmp_path, "hsdp", 4)
    _assert_equal(reference, run, "hsdp")
    resumed = _train(FSDP2 + _resume_at(tmp_path / "ckpt", 2), tmp_path, "fsdp-from-hsdp", 2)
    assert [r["iteration"] for r in resumed] == [3]
    _assert_equal(reference, resumed, "fsdp-from-hsdp")


@pytest.mark.parametrize("optimizer", ["muon", "lion"])
def test_muon_and_lion(tmp_path, optimizer):
    """Muon orthogonalises whole matrices: it gathers each FSDP shard's matrix over the shard group.
    Its Newton-Schulz iterations run in fp32 here, as in the other Muon equivalence tests: in bf16
    (the default) the runs' fp32-rounding differences in the gradients flip bf16 roundings."""
    flags = ["--optimizer", optimizer] + (["--muon-fp32-matmul-prec", "highest"] if optimizer == "muon" else [])
    _assert_equal(_train(flags, tmp_path, "single"), _train(flags + FSDP2, tmp_path, "fsdp", 2), optimizer)


def test_multi_token_prediction(tmp_path):
    """An MTP layer holds a transformer layer: both are FSDP units, the inner one sharded first."""
    mtp = ["--mtp-num-layers", "1"]
    _assert_equal(_train(mtp, tmp_path, "mtp-single"), _train(mtp + FSDP2, tmp_path, "mtp-fsdp", 2), "mtp")


def test_meta_device_initialisation_gives_the_same_shards(tmp_path):
    """--init-model-with-meta-device: the model is built without values, then each rank's shards
    are filled one component at a time: the run equals the one built with values, bit for bit
    (TP + SP, MoE with EP, an MTP layer, bf16)."""
    flags = BF16 + FSDP2 + MOE + ["--mtp-num-layers", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                                  "--moe-token-dispatcher-type", "alltoall"]
    built = _train(flags, tmp_path, "built", 4)
    meta = _train(flags + ["--init-model-with-meta-device"], tmp_path, "meta", 4)
    assert [(r["lm_loss"], r["grad_norm"]) for r in meta] == [(r["lm_loss"], r["grad_norm"]) for r in built]


def test_pipeline_parallel(reference, tmp_path):
    _assert_equal(reference, _train(FSDP2 + ["--pipeline-model-parallel-size", "2"], tmp_path, "pp2-fsdp", 4),
                  "pp2-fsdp")


@pytest.mark.parametrize("flags, nproc", [
    (["--context-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], 4),
    (["--recompute-granularity", "selective", "--fine-grained-activation-offloading", "--offload-modules",
      "qkv_linear", "attn_proj"], 2),
], ids=["cp2-full-recompute", "selective-recompute-offloading"])
def test_context_parallel_recompute_and_offloading(reference, tmp_path, flags, nproc):
    _assert_equal(reference, _train(FSDP2 + flags, tmp_path, "run", nproc), flags[0])


def test_fp8_linears(tmp_path):
    fp8 = BF16 + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    _assert_equal(_train(fp8, tmp_path, "fp8-single"), _train(fp8 + FSDP2, tmp_path, "fp8-fsdp", 2), "fp8-fsdp")


def test_moe_experts_sharded_over_expert_data_parallel(tmp_path):
    single = _train(MOE, tmp_path, "moe-single")
    run = _train(MOE + FSDP2 + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
                 tmp_path, "moe-ep2-fsdp", 4)
    _assert_equal(single, run, "moe-ep2-fsdp")


def test_bf16_master_weights_move_between_fsdp_and_the_distributed_optimizer(tmp_path):
    """bf16 compute, fp32 grads: FSDP's sharded fp32 params hold what the distributed optimizer's
    fp32 masters hold, and checkpoints carry them both ways (a bf16-rounded master would change
    iteration 3)."""
    single = _train(BF16, tmp_path, "bf16-single")
    save = ["--save-interval", "2", "--save"]
    _assert_equal(single, _train(BF16 + FSDP2 + save + [str(tmp_path / "fsdp")], tmp_path, "bf16-fsdp", 2),
                  "bf16-fsdp")
    dist_opt = ["--use-distributed-optimizer"]
    _assert_equal(single, _train(BF16 + dist_opt + save + [str(tmp_path / "dist")], tmp_path, "bf16-dist", 2),
                  "bf16-dist")
    from_fsdp = _train(BF16 + dist_opt + _resume_at(tmp_path / "fsdp", 2), tmp_path, "dist-from-fsdp", 2)
    from_dist = _train(BF16 + FSDP2 + _resume_at(tmp_path / "dist", 2), tmp_path, "fsdp-from-dist", 2)
    for name, run in (("dist-from-fsdp", from_fsdp), ("fsdp-from-dist", from_dist)):
        assert [r["iteration"] for r in run] == [3], name
        _assert_equal(single, run, name)


def test_settings_that_do_not_go_together():
    with pytest.raises(ValueError, match="pass one"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, use_torch_fsdp2=True)
    with pytest.raises(ValueError, match="overlap_param_gather is a setting of DDP's buffers"):
        DistributedDataParallelConfig(use_torch_fsdp2=True, use_distributed_optimizer=True,
                                      overlap_param_gather=True)
    with pytest.raises(ValueError, match="num_distributed_optimizer_instances must be 1 without FSDP"):
        DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    with pytest.raises(ValueError, match="data_parallel_sharding_strategy='zero3'"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="zero3")
    optim = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim")
    assert optim.use_distributed_optimizer and not optim.shards_with_fsdp2()
    assert DistributedDataParallelConfig(use_torch_fsdp2=True, torch_fsdp2_reshard_after_forward=False
                                         ).fsdp_strategy() == "optim_grads"


def test_command_line_errors(tmp_path, capsys, monkeypatch):
    from teratron import cli

    monkeypatch.chdir(tmp_path)
    for flags, phrase in [(FSDP2 + ["--use-megatron-fsdp"], "pass one (--use-megatron-fsdp or --use-torch-fsdp2)"),
                          (FSDP2, "--use-torch-fsdp2 shards over data-parallel ranks with torch.distributed, which one "
                                  "process without torchrun does not start")]:
        assert cli.main(["train"] + TINY + flags) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("teratron: error: ") and phrase in err[0], err
    assert not list(tmp_path.iterdir())
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import build_run_config

    # `teratron bench` checks the flags of a run it will launch under torchrun: no refusal there
    assert build_run_config(parse_train_args(TINY + FSDP2), world_size=1).ddp.use_torch_fsdp2
    from teratron.training.config import run_config_from_args

    with pytest.raises(ValueError, match="^--optimizer-cpu-offload with FSDP"):
        run_config_from_args(parse_train_args(TINY + FSDP2 + ["--optimizer-cpu-offload"]), 2, 100, cuda=False)
    with pytest.raises(ValueError, match="^--init-model-with-meta-device builds the model without values"):
        run_config_from_args(parse_train_args(TINY + ["--init-model-with-meta-device"]), 2, 100, cuda=False)
