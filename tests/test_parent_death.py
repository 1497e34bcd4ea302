"""No rank outlives its launcher (teratron.parent_death): SIGKILL of torchrun's process group
ends both ranks of a `teratron train` within seconds and no checkpoint appears after it; a
process whose parent died before it asked stops at once; elsewhere than Linux one note."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from teratron import parent_death
from train_runs import alive, env

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "1",
        "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--no-progress-bar", "--distributed-backend", "gloo"]




def _children(pid: int) -> list:
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry))
        except FileNotFoundError:  # ended meanwhile
            continue
    return children


def _wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds} s waiting for {what}"
        time.sleep(0.05)


def _checkpoints(save) -> tuple:
    tracker = save / "latest_checkpointed_iteration.txt"
    return sorted(os.listdir(save)), tracker.read_text() if tracker.exists() else None


def test_killing_torchrun_process_group_stops_every_rank_and_their_checkpoints(tmp_path):
    save = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "teratron", "train", *TINY, "--train-iters", "100000", "--save", str(save), "--save-interval", "1"]
    # The launcher leads a process group of its own (as a shell job would); torchrun puts each
    # rank in a session of its own, out of that group.
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    ranks = []
    try:
        _wait_for(lambda: _checkpoints(save)[1] is not None if save.exists() else False, 90,
                  "the ranks' first checkpoint")
        ranks = _children(launcher.pid)
        assert len(ranks) == 2 and all(os.getsid(r) == r for r in ranks)  # each leads its own session
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        _wait_for(lambda: not any(alive(r) for r in ranks), 5, f"ranks {ranks} to die with their launcher")
        after = _checkpoints(save)
        time.sleep(1.0)  # nothing left to write: the folder stays as the kill left it
        assert _checkpoints(save) == after
    finally:
        for pid in [launcher.pid] + ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=10)


_ORPHAN = textwrap.dedent("""
    import os, sys, time
    from teratron import parent_death
    if os.fork():  # the parent leaves before its child asks to die with it
        os._exit(0)
    while os.getppid() == parent_death._parent_pid:
        time.sleep(0.01)
    parent_death.exit_with_parent()
    print("outlived its parent", flush=True)
""")

_CHILD_OF_LIVE_PARENT = textwrap.dedent("""
    from teratron import parent_death
    print(parent_death.exit_with_parent(), flush=True)
""")


def test_a_rank_whose_parent_is_already_gone_stops_at_once():
    orphan = subprocess.run([sys.executable, "-c", _ORPHAN], env=env(), capture_output=True, text=True,
                            timeout=60)
    # The child holds the pipes until it dies: the output is complete once they close.
    assert "outlived" not in orphan.stdout
    assert "is gone; this rank" in orphan.stderr
    child = subprocess.run([sys.executable, "-c", _CHILD_OF_LIVE_PARENT], env=env(), capture_output=True,
                           text=True, timeout=60)
    assert (child.returncode, child.stdout) == (0, "True\n")


def test_elsewhere_than_linux_one_note(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(parent_death, "_noted", False)
    assert parent_death.exit_with_parent() is False
    assert parent_death.exit_with_parent() is False
    assert capsys.readouterr().out.count("NOTE: on darwin a rank is not stopped when its launcher dies") == 1
