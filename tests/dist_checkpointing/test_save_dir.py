"""One run per --save folder (teratron.dist_checkpointing.save_dir): no run replaces another's
checkpoints by mistake.

- `--save` of a folder holding another run's checkpoints, without `--load` or with a mistyped one,
  and `--finetune` into the folder it loads, are refused before anything is written (one line);
  `--overwrite` lets the run replace them; `--load X --save X` resumes.
- Checkpoints beside a missing, unreadable or non-file tracker are an error, not a fresh start.
- A second run is refused while the first holds the folder (a real `teratron train` process);
  once that process is killed, its stale lock is taken over with a note.
- Every rank raises the same error (rank 0 decides); the lock and folders a refused or finished
  run created are removed.
"""

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from dist import run_distributed
from teratron import cli
from teratron.dist_checkpointing import SaveDirError, claim_save_dir, release_save_dir, storage
from teratron.dist_checkpointing.save_dir import LOCK_FILENAME

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "30", "--make-vocab-size-divisible-by",
        "8", "--num-layers", "1", "--hidden-size", "16", "--ffn-hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-2",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
        "--no-progress-bar", "--seed", "7", "--deterministic"]


def train(*argv) -> int:
    return cli.main(["train", *TINY, *argv])


def snapshot(folder) -> dict:
    """relative path -> sha256 of every file under `folder`."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def other_run(tmp_path_factory):
    """A save folder holding iterations 1 and 2 of a finished run."""
    save = str(tmp_path_factory.mktemp("other") / "ckpt")
    assert train("--train-iters", "2", "--save", save, "--save-interval", "1") == 0
    return save


def _error(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("teratron: error: "), err
    assert "Traceback" not in out + err
    return lines[0]


def test_another_runs_checkpoints_are_not_replaced(other_run, tmp_path, capsys):
    save = str(shutil.copytree(other_run, tmp_path / "ckpt"))
    before = snapshot(save)
    cases = {  # flags -> phrase of the one-line refusal
        "no --load": ([], "holds checkpoints (iter_0000001 to iter_0000002) of a run this one does not resume; "
                          f"resume it with --load {save}"),
        "mistyped --load": (["--load", save + "t"], "of a run this one does not resume"),
        "--finetune into the folder it loads": (["--load", save, "--finetune"],
                                                "--finetune starts a new run at iteration 0"),
    }
    for name, (flags, phrase) in cases.items():
        capsys.readouterr()
        assert train("--train-iters", "4", "--save", save, "--save-interval", "1", *flags) == 2, name
        assert phrase in _error(capsys), name
        assert snapshot(save) == before, name

    # Resuming is fine (two more iterations: the longer schedule wins over the checkpoint's).
    assert train("--train-iters", "4", "--save", save, "--load", save, "--override-opt_param-scheduler") == 0
    assert storage.read_tracker(save) == 4 and LOCK_FILENAME not in os.listdir(save)


@pytest.mark.parametrize("tracker", ["missing", "garbage", "directory"])
def test_checkpoints_without_a_readable_tracker_are_an_error(other_run, tmp_path, capsys, tracker):
    """Resuming used to start from scratch (a warning) and overwrite iter_*, or fail only after
    replacing iter_0000002."""
    save = str(shutil.copytree(other_run, tmp_path / "ckpt"))
    path = os.path.join(save, storage.TRACKER_FILENAME)
    os.remove(path)
    if tracker == "garbage":
        open(path, "wb").write(b"\xff\xfe\x00")
    elif tracker == "directory":
        os.mkdir(path)
    before = snapshot(save)
    assert train("--train-iters", "4", "--save", save, "--load", save, "--save-interval", "1") == 2
    line = _error(capsys)
    assert path in line, line
    assert ("but no latest_checkpointed_iteration.txt" if tracker == "missing" else
            "not an iteration number" if tracker == "garbage" else "not a file") in line, line
    assert snapshot(save) == before and sorted(os.listdir(save))[:2] == ["iter_0000001", "iter_0000002"]
    if tracker == "directory":  # --overwrite does not help: no checkpoint could be published
        assert train("--train-iters", "4", "--save", save, "--overwrite") == 2
        assert "not a file" in _error(capsys) and snapshot(save) == before


def test_overwrite_replaces_another_runs_checkpoints(other_run, tmp_path, capsys):
    save = str(shutil.copytree(other_run, tmp_path / "ckpt"))
    before = snapshot(save)
    assert train("--train-iters", "2", "--save", save, "--save-interval", "2", "--overwrite", "--seed", "8") == 0
    assert "NOTE: --overwrite: --save" in capsys.readouterr().out
    after = snapshot(save)
    assert after["iter_0000001/metadata.json"] == before["iter_0000001/metadata.json"]  # not saved by this run
    assert after["iter_0000002/__0_0.distcp"] != before["iter_0000002/__0_0.distcp"]
    assert storage.read_tracker(save) == 2 and LOCK_FILENAME not in os.listdir(save)


def _wait_for(condition, what, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_second_writer_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    first = subprocess.Popen([sys.executable, "-m", "teratron", "train", *TINY, "--train-iters", "100000",
                              "--save", save, "--save-interval", "1"], cwd=tmp_path,
                             env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: storage.read_tracker(save) is not None, "the first run's first checkpoint")
        capsys.readouterr()
        assert train("--train-iters", "4", "--save", save, "--load", save) == 2  # even resuming
        assert f"another run (host {socket.gethostname()}, PID {first.pid}" in _error(capsys)
        assert train("--train-iters", "4", "--save", save, "--overwrite") == 2
        assert "is writing checkpoints there" in _error(capsys)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert LOCK_FILENAME in os.listdir(save)  # killed: its lock stays behind
    resumed_from = storage.read_tracker(save)
    assert train("--train-iters", str(resumed_from + 1), "--save", save, "--load", save,
                 "--override-opt_param-scheduler") == 0
    assert f"(host {socket.gethostname()}, PID {first.pid}" in capsys.readouterr().out
    assert storage.read_tracker(save) == resumed_from + 1 and LOCK_FILENAME not in os.listdir(save)


def test_a_lock_from_another_host_or_unreadable_is_respected(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / LOCK_FILENAME).write_text('{"host": "elsewhere", "pid": 1, "since": "yesterday"}')
    with pytest.raises(SaveDirError, match="another run \\(host elsewhere, PID 1, since yesterday\\)"):
        claim_save_dir(str(save))
    (save / LOCK_FILENAME).write_text("{half")
    with pytest.raises(SaveDirError, match="cannot be read\\); if no run writes there, delete that file"):
        claim_save_dir(str(save))
    assert os.listdir(save) == [LOCK_FILENAME]


def _claim_on_two_ranks(good, taken):
    claim_save_dir(good)
    held = sorted(os.listdir(good))
    dist.barrier()  # every rank looked before rank 0 releases
    release_save_dir()
    dist.barrier()
    try:
        claim_save_dir(taken)
    except SaveDirError as e:
        return held, str(e)
    return held, None


def test_every_rank_raises_the_same_refusal_and_created_folders_go(tmp_path, other_run):
    good = str(tmp_path / "new" / "ckpt")
    results = run_distributed(_claim_on_two_ranks, 2, good, other_run)
    assert results[0][0] == results[1][0] == [LOCK_FILENAME]  # rank 0 locked the folder it created
    assert results[0][1] == results[1][1] and "holds checkpoints" in results[0][1]
    assert os.listdir(tmp_path) == []  # released: the folders the claim created are gone
    assert LOCK_FILENAME not in os.listdir(other_run)
