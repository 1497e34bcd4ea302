"""A model with sliding-window layers, learned attention sinks, a NoPE layer and a clamped SwiGLU
trains through `teratron train` (in process, gloo ranks) to the single process's loss at every
iteration under TP 2 + sequence parallelism, PP 2, TP 2 x PP 2 and, with MoE layers, EP 2; a
TP 2 checkpoint resumes in one process (the learned sinks resharded) with the same next losses."""

import os
import shutil

import pytest
import torch.distributed.checkpoint as dcp

from dist import run_distributed
from teratron.dist_checkpointing import storage
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.training import pretrain

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--make-vocab-size-divisible-by",
        "64", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-2", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "100", "--eval-iters",
        "0", "--num-workers", "0", "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--seed", "7", "--deterministic", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--train-iters", "4", "--init-method-std", "0.3"]
# Windows of 4 keys back in layers 1 and 3 (sequence 16), full attention in 2 and 4; layer 2 NoPE;
# init std 0.3 makes every variant bite from the start (test_variants_change_the_model); fc1 outputs start
# at about 1.7 (hidden 32): the clamp at 1.5 cuts many of them.
VARIANT_FLAGS = [["--window-size", "3,0", "--window-attn-skip-freq", "2"], ["--softmax-type", "learnable"],
                 ["--no-rope-freq", "[0,1,0,0]"], ["--activation-func-clamp-value", "1.5"]]
VARIANTS = [arg for flags in VARIANT_FLAGS for arg in flags]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "24",
       "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall"]


def train(argv):
    """Loss per iteration of the run (on the logging rank; {} elsewhere)."""
    return dict(pretrain(build_run_config(parse_train_args(TINY + VARIANTS + argv))).loss_history)


def _assert_same_losses(reference, run, name):
    assert sorted(run) == sorted(reference), name
    for iteration, loss in reference.items():
        assert run[iteration] == pytest.approx(loss, rel=1e-5), (name, iteration, loss, run[iteration])


@pytest.fixture(scope="module")
def dense_reference():
    losses = train([])
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    return losses


def test_variants_change_the_model(dense_reference):
    """Each variant bites: dropping any one of them changes the last loss well beyond the
    tolerance of the layout comparisons."""
    for dropped in VARIANT_FLAGS:
        others = [arg for flags in VARIANT_FLAGS if flags is not dropped for arg in flags]
        losses = dict(pretrain(build_run_config(parse_train_args(TINY + others))).loss_history)
        assert losses[4] != pytest.approx(dense_reference[4], rel=1e-4), dropped


def test_tp2_sequence_parallel_and_a_resharded_checkpoint(dense_reference, tmp_path):
    save = str(tmp_path / "tp2")
    run = run_distributed(train, 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", save,
                                     "--save-interval", "2"])[-1]
    _assert_same_losses(dense_reference, run, "tp2-sp")
    metadata = dcp.FileSystemReader(os.path.join(save, "iter_0000002")).read_metadata()
    sinks = [key for key in metadata.state_dict_metadata
             if key.startswith("decoder.") and key.endswith("core_attention.softmax_offset")]
    assert len(sinks) == 4 and metadata.state_dict_metadata[sinks[0]].size == (4,)  # all heads, from 2 shards
    resumed_dir = tmp_path / "resume"
    shutil.copytree(save, resumed_dir)
    (resumed_dir / storage.TRACKER_FILENAME).write_text("2")
    resumed = train(["--load", str(resumed_dir)])
    assert sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(dense_reference[iteration], rel=1e-5)


def test_pp2(dense_reference):
    run = run_distributed(train, 2, ["--pipeline-model-parallel-size", "2"])[-1]
    _assert_same_losses(dense_reference, run, "pp2")


def test_tp2_pp2(dense_reference):
    run = run_distributed(train, 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--sequence-parallel"])[-1]
    _assert_same_losses(dense_reference, run, "tp2-pp2")


def test_moe_ep2():
    reference = train(MOE)
    run = run_distributed(train, 2, MOE + ["--expert-model-parallel-size", "2"])[-1]
    _assert_same_losses(reference, run, "ep2")
