"""The end of `teratron train`: the last partial log window is logged, the validation set is
evaluated once more unless the last iteration just did, and the test split once, with
Megatron's "validation loss at the end of training for ... data" lines and metrics records.
Tiny mock-data runs in process, five iterations or fewer."""

import json
import math

import pytest

from teratron import cli
from test_cli import NO_DROPOUT, TINY, _write_short_documents


def _train(tmp_path, capsys, name, extra, data=("--mock-data",)):
    path = tmp_path / f"{name}.jsonl"
    argv = list(data) + TINY[TINY.index("--tokenizer-type"):] + NO_DROPOUT + ["--metrics-file", str(path)]
    assert cli.main(["train"] + argv + extra) == 0, name
    with open(path) as f:
        return [json.loads(line) for line in f], capsys.readouterr().out


def _kinds(records):
    """(iteration, kind) of each record: a training log record or an evaluated split."""
    def kind(r):
        if "lr" in r:
            return "train"
        return next(key for key in ("val_lm_loss", "test_lm_loss") if key in r).split("_")[0]
    return [(r["iteration"], kind(r)) for r in records]


def test_partial_windows_and_end_of_training_evaluation(tmp_path, capsys):
    five = ["--train-iters", "5", "--eval-interval", "4"]
    reference, _ = _train(tmp_path, capsys, "every-iteration", five)
    ref_loss = {r["iteration"]: r["lm_loss"] for r in reference if "lr" in r}
    assert sorted(ref_loss) == [1, 2, 3, 4, 5]

    # --train-iters 5 with --log-interval 2: iteration 5 is a window of its own; the last
    # evaluation was at 4, so the validation set is evaluated again at 5, then the test split.
    records, out = _train(tmp_path, capsys, "log-every-2", five + ["--log-interval", "2"])
    assert _kinds(records) == [(2, "train"), (4, "train"), (4, "val"), (5, "train"), (5, "val"),
                               (5, "test")]
    assert records[1]["lm_loss"] == pytest.approx((ref_loss[3] + ref_loss[4]) / 2, rel=1e-6)
    assert records[3]["lm_loss"] == pytest.approx(ref_loss[5], rel=1e-6)
    # The same model and validation batches as the reference run's evaluations.
    ref_evals = [r for r in reference if "val_lm_loss" in r]
    assert [r["val_lm_loss"] for r in (records[2], records[4])] == pytest.approx(
        [r["val_lm_loss"] for r in ref_evals], rel=1e-6)
    assert set(records[5]) == {"iteration", "test_lm_loss"} and math.isfinite(records[5]["test_lm_loss"])
    assert records[5]["test_lm_loss"] != pytest.approx(records[4]["val_lm_loss"], rel=1e-6)
    assert " validation loss at iteration 4 | lm loss value: " in out
    for split in ("val", "test"):
        assert out.count(f" validation loss at the end of training for {split} data | lm loss value: ") == 1

    # --exit-interval 3 stops between logging iterations: iteration 3 is logged after the
    # evaluation it just ran, which is not repeated; the test split still is evaluated.
    exit_at_3 = ["--log-interval", "2", "--eval-interval", "3", "--exit-interval", "3"]
    records, out = _train(tmp_path, capsys, "exit-at-3", five + exit_at_3)
    assert _kinds(records) == [(2, "train"), (3, "val"), (3, "train"), (3, "test")]
    assert records[2]["lm_loss"] == pytest.approx(ref_loss[3], rel=1e-6)
    assert "validation loss at the end of training for val data" not in out
    assert "validation loss at the end of training for test data" in out
    assert "exiting after iteration 3" in out


def test_no_test_split_and_no_evaluation(tmp_path, capsys):
    """A --split without a test share evaluates no test split (mock data always has one, as in
    Megatron); --eval-iters 0 evaluates nothing, at the end neither."""
    data = ["--data-path", _write_short_documents(tmp_path / "short"), "--split", "90,10,0",
            "--data-cache-path", str(tmp_path / "cache")]
    records, out = _train(tmp_path, capsys, "no-test", ["--train-iters", "3"], data)
    assert _kinds(records) == [(1, "train"), (2, "train"), (3, "train"), (3, "val")]
    assert "for test data" not in out
    records, out = _train(tmp_path, capsys, "no-eval", ["--train-iters", "3", "--eval-iters", "0"])
    assert _kinds(records) == [(1, "train"), (2, "train"), (3, "train")]
    assert "validation loss" not in out
