"""Interrupting `teratron train`, as a user would: Ctrl+C names the checkpoint to resume from (or
says none was saved); a resume says where it starts and leaves the metrics file with one record
per iteration, other runs' records in the same file kept. (SIGTERM under --exit-signal-handler:
tests/dist_checkpointing/test_training_checkpointing.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from teratron.dist_checkpointing import storage
from teratron.training.checkpointing import resume_hint
from teratron.training.metrics import drop_records_after

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "1",
        "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--no-progress-bar", "--seed", "3", "--deterministic", "--hidden-dropout", "0",
        "--attention-dropout", "0"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _train(cwd, *flags):
    proc = subprocess.run([sys.executable, "-m", "teratron", "train", *TINY, *flags], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ctrl_c_names_the_checkpoint_to_resume_from(tmp_path):
    save = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "teratron", "train", *TINY, "--train-iters", "100000",
                             "--save", str(save), "--save-interval", "1"], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # wait for the second save: the first one's log line is then out (a Ctrl+C can land between a save's
        # publishing and its line, which the hint still names)
        while not (save / storage.TRACKER_FILENAME).exists() or storage.read_tracker(str(save)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no second checkpoint was written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    saved = storage.read_tracker(str(save))
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == f"teratron: interrupted; resume from iteration {saved} with --load {save}"
    assert f"saved checkpoint at iteration {saved - 1} to {save}" in out


def test_resume_hint_without_a_checkpoint(tmp_path):
    assert resume_hint(None) == "no checkpoint was saved (no --save)"
    assert resume_hint(str(tmp_path)) == f"no checkpoint was saved in --save {tmp_path}"
    (tmp_path / "iter_0000004").mkdir()
    assert resume_hint(str(tmp_path)).startswith("the checkpoint to resume from is unclear: ")


def test_resume_logs_where_it_starts_and_the_metrics_file_has_one_record_per_iteration(tmp_path):
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    other_run = {"iteration": 40, "lm_loss": 1.0}  # another run's record, earlier in the shared file
    metrics.write_text(json.dumps(other_run) + "\n")
    out = _train(tmp_path, "--train-iters", "7", "--exit-interval", "5", "--save", str(save), "--save-interval", "3",
                 "--metrics-file", str(metrics))
    assert "saved checkpoint at iteration 3" in out and "saved checkpoint at iteration 5" in out
    uninterrupted = _records(metrics)[1:]
    assert [r["iteration"] for r in uninterrupted] == [1, 2, 3, 4, 5]
    # As if the run had died in iteration 6 writing its record, before publishing checkpoint 5.
    (save / storage.TRACKER_FILENAME).write_text("3")
    os.rename(save / "iter_0000005", save / ".iter_0000005.tmp-killed")
    with open(metrics, "a") as f:
        f.write('{"iteration": 6, "lm_lo')

    out = _train(tmp_path, "--train-iters", "7", "--save", str(save), "--load", str(save),
                 "--metrics-file", str(metrics))
    assert "resumed from iteration 3 of --load" in out
    assert f"--metrics-file {metrics}: removed 3 record(s) past iteration 3" in out
    records = _records(metrics)
    assert records[0] == other_run
    assert [r["iteration"] for r in records[1:]] == [1, 2, 3, 4, 5, 6, 7]
    # The resumed iterations are the same computation (--deterministic): the records are the redone ones.
    for before, after in zip(uninterrupted[3:], records[4:6]):
        assert after["lm_loss"] == before["lm_loss"] and after["grad_norm"] == before["grad_norm"]


def test_drop_records_after_keeps_what_is_not_the_interrupted_runs_tail(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = ['{"iteration": 9}\n', "a note someone wrote\n", '{"iteration": 1}\n', '{"iteration": 2}\n',
             '{"iteration": 2, "val_lm_loss": 3.0}\n', '{"iteration": 3}\n', '{"iteration": 3, "test_lm_loss": 3.0}\n']
    path.write_text("".join(lines))
    assert drop_records_after(str(path), 2) == 2
    assert path.read_text() == "".join(lines[:5])
    assert drop_records_after(str(path), 2) == 0 and path.read_text() == "".join(lines[:5])
    assert drop_records_after(str(path), 0) == 3  # stops at the line that is no record
    assert path.read_text() == "".join(lines[:2])
    assert drop_records_after(str(tmp_path / "missing.jsonl"), 3) == 0
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl"]  # the replacement was renamed into place


@pytest.mark.parametrize("torn", ['{"iteration": 2}', '{"iteration": 2, "lm_'])
def test_a_torn_last_line_is_dropped(tmp_path, torn):
    path = tmp_path / "m.jsonl"
    path.write_text('{"iteration": 1}\n' + torn)
    assert drop_records_after(str(path), 5) == 1
    assert path.read_text() == '{"iteration": 1}\n'
