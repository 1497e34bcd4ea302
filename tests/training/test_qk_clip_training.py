"""QK-clip through `teratron train` (in process, gloo ranks): with Muon, a run with --qk-clip (which
bites: the losses differ from a run without it) has the single process's losses and logged max
attention logits at every iteration under TP 2 + sequence parallelism, PP 2 and DP 2 with the
distributed optimizer, and with Adam under TP 2 x PP 2 x DP 2 with the distributed optimizer; a
multi-latent-attention model with an MTP layer (MLA too) clips and equals the single process under
TP 2 + sequence parallelism and PP 2; --log-max-attention-logit logs the max logit and trains
exactly as without it; bad values are one-line errors naming the flag."""

import json

import pytest

from dist import run_distributed
from teratron import cli
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
# Full matrices under TP and the distributed optimizer, so every layout computes the TP 1 update.
MUON = ["--optimizer", "muon", "--muon-tp-mode", "duplicated", "--muon-fp32-matmul-prec", "highest"]
# The largest logits start near 14: a threshold of 6 clips many heads at every step.
QK_CLIP = ["--qk-clip", "--qk-clip-threshold", "6", "--qk-clip-alpha", "0.4"]
# Multi-latent attention (compressed queries, YaRN with mscale_all_dim, latent norms) and one MTP
# depth, an MLA layer like the last; its logits start near 9.6, a threshold of 3 clips at every step.
_GQA = TINY.index("--group-query-attention")
MLA = TINY[:_GQA] + TINY[_GQA + 3:] + [  # less --group-query-attention --num-query-groups 2
    "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rotary-scaling-factor", "4", "--mscale", "0.8",
    "--mscale-all-dim", "1", "--yarn-original-max-position-embeddings", "8", "--qk-layernorm",
    "--disable-bias-linear", "--mtp-num-layers", "1"]
MLA_QK_CLIP = ["--qk-clip", "--qk-clip-threshold", "3", "--qk-clip-alpha", "0.4"]


def train(argv, metrics_file, model=TINY):
    """({iteration: loss}, [logged max attention logit per iteration]) on the logging rank."""
    losses = dict(pretrain(build_run_config(parse_train_args(model + argv + ["--metrics-file", metrics_file])))
                  .loss_history)
    try:
        with open(metrics_file) as f:
            return losses, [json.loads(line).get("max_attention_logit") for line in f]
    except FileNotFoundError:  # not the logging rank
        return losses, None


def _assert_same_run(reference, run, name):
    (ref_losses, ref_logits), (losses, logits) = reference, run
    assert sorted(losses) == sorted(ref_losses), name
    for iteration, loss in ref_losses.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-5), (name, iteration, loss, losses[iteration])
    assert logits == pytest.approx(ref_logits, rel=1e-5), (name, ref_logits, logits)


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory):
    return train(MUON + QK_CLIP, str(tmp_path_factory.mktemp("ref") / "metrics.jsonl"))


def test_qk_clip_bites_and_logging_alone_changes_nothing(muon_reference, tmp_path):
    losses, logits = muon_reference
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    plain, none_logged = train(MUON, str(tmp_path / "plain.jsonl"))
    assert none_logged == [None] * 4
    logged_losses, logged = train(MUON + ["--log-max-attention-logit"], str(tmp_path / "logged.jsonl"))
    assert logged_losses == plain  # recording the logits changes nothing
    # The first forward precedes any clip; afterwards the clipped heads start each step near 6 (the
    # update after the clip moves them a little).
    assert logged[0] == pytest.approx(logits[0], rel=1e-6) and logged[0] > 12
    assert all(value < 8 for value in logits[1:]) and all(value > 12 for value in logged[1:])
    assert losses[4] != pytest.approx(plain[4], rel=1e-3)


def test_tp2_sequence_parallel(muon_reference, tmp_path):
    run = run_distributed(train, 2, MUON + QK_CLIP + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                          str(tmp_path / "m.jsonl"))[-1]
    _assert_same_run(muon_reference, run, "tp2-sp")


def test_pp2(muon_reference, tmp_path):
    run = run_distributed(train, 2, MUON + QK_CLIP + ["--pipeline-model-parallel-size", "2"],
                          str(tmp_path / "m.jsonl"))[-1]
    _assert_same_run(muon_reference, run, "pp2")


def test_dp2_distributed_optimizer(muon_reference, tmp_path):
    run = run_distributed(train, 2, MUON + QK_CLIP + ["--use-distributed-optimizer"], str(tmp_path / "m.jsonl"))[-1]
    _assert_same_run(muon_reference, run, "dp2-distopt")


def test_adam_tp2_pp2_dp2_distributed_optimizer(tmp_path):
    reference = train(QK_CLIP, str(tmp_path / "ref.jsonl"))
    run = run_distributed(train, 8, QK_CLIP + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                               "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
                          str(tmp_path / "m.jsonl"))[-1]
    _assert_same_run(reference, run, "adam-tp2-pp2-dp2-distopt")


@pytest.fixture(scope="module")
def mla_reference(tmp_path_factory):
    return train(MLA_QK_CLIP, str(tmp_path_factory.mktemp("mla") / "metrics.jsonl"), MLA)


def test_mla_and_mtp_clip(mla_reference, tmp_path):
    losses, logits = mla_reference
    logged_losses, logged = train(["--log-max-attention-logit"], str(tmp_path / "logged.jsonl"), MLA)
    assert logged[0] == pytest.approx(logits[0], rel=1e-6) and logged[0] > 9
    assert all(value < 5 for value in logits[1:]) and all(value > 8 for value in logged[1:])
    assert losses[4] != pytest.approx(logged_losses[4], rel=1e-3)


def test_mla_and_mtp_tp2_sequence_parallel(mla_reference, tmp_path):
    run = run_distributed(train, 2, MLA_QK_CLIP + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                          str(tmp_path / "m.jsonl"), MLA)[-1]
    _assert_same_run(mla_reference, run, "mla-tp2-sp")


def test_mla_and_mtp_pp2(mla_reference, tmp_path):
    run = run_distributed(train, 2, MLA_QK_CLIP + ["--pipeline-model-parallel-size", "2"],
                          str(tmp_path / "m.jsonl"), MLA)[-1]
    _assert_same_run(mla_reference, run, "mla-pp2")


def test_bad_values_are_one_line_errors(capsys):
    cases = [(["--qk-clip", "--qk-clip-alpha", "1.5"], "--qk-clip-alpha=1.5 must be in (0, 1)"),
             (["--qk-clip", "--qk-clip-alpha", "0"], "--qk-clip-alpha=0.0 must be in (0, 1)"),
             (["--qk-clip", "--qk-clip-threshold", "0"], "--qk-clip-threshold=0.0 must be a finite number > 0"),
             (["--qk-clip-threshold", "50"], "--qk-clip-threshold is set but --qk-clip is off"),
             (["--qk-clip", "--qk-layernorm"], "--qk-clip with --qk-layernorm"),
             (["--qk-clip-alpha", "x"], "--qk-clip-alpha")]
    for argv, phrase in cases:
        assert cli.main(["train"] + TINY + argv) == 2, argv
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("teratron: error: ") and phrase in lines[0], (argv, err)
