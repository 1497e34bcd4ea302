"""The hang watchdog (--watchdog-timeout, teratron.training.watchdog) through `teratron train`
under torchrun: a rank stopped with SIGSTOP ends the job within the limit, the other rank naming
it and printing its own stack; one process stuck in a step; the flag's checks."""

import os
import signal
import subprocess
import sys
import time

import pytest

from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.watchdog import EXIT_CODE, Watchdog
from train_runs import alive, env

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "1",
        "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--no-progress-bar", "--distributed-backend", "gloo"]
LIMIT_S = 3




def _rank_pids(launcher_pid: int) -> dict:
    """RANK -> pid of the launcher's children."""
    ranks = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            ranks[int(env[b"RANK"])] = int(entry)
        except (FileNotFoundError, KeyError):
            continue
    return ranks


def _wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds} s waiting for {what}"
        time.sleep(0.05)


def test_a_stopped_rank_ends_the_job_named_with_the_waiting_ranks_stack(tmp_path):
    metrics, log = tmp_path / "metrics.jsonl", tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "teratron", "train", *TINY, "--train-iters", "100000", "--metrics-file", str(metrics),
           "--watchdog-timeout", str(LIMIT_S)]
    with open(log, "w") as out:
        launcher = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    ranks = {}
    try:
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 90, "training")
        ranks = _rank_pids(launcher.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _wait_for(lambda: not alive(ranks[0]), LIMIT_S + 10, "rank 0's watchdog to end it")
        assert time.monotonic() - stopped < LIMIT_S + 6  # the limit, the silence check and a last interval
        os.kill(ranks[1], signal.SIGCONT)  # torchrun's SIGTERM (or rank 0's absence) ends it now
        launcher.wait(timeout=60)
        text = log.read_text()
        assert launcher.returncode != 0, text
        assert f"over --watchdog-timeout {LIMIT_S}; stuck: rank(s) 1 (last heartbeat in iteration " in text, text
        assert f"then it exits with status {EXIT_CODE}" in text
        assert "most recent call first" in text and "trainer.py" in text  # rank 0's stack: waiting in its step
        assert f"exitcode  : {EXIT_CODE}" in text  # torchrun's failure summary names rank 0's status
    finally:
        for pid in ranks.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)


def test_one_process_stuck_in_a_step(monkeypatch, capsys):
    fired = []
    monkeypatch.setattr(Watchdog, "_fire", lambda self, iteration, started: fired.append(
        self.report(iteration, started)))
    watchdog = Watchdog(0.2)
    try:
        watchdog.step_started(7)
        _wait_for(lambda: fired, 5, "the watchdog")
        watchdog.step_ended()
    finally:
        watchdog.close()
    assert fired[0].startswith("teratron: watchdog: iteration 7 has run ")
    assert "over --watchdog-timeout 0.2; this process is stuck inside the step" in fired[0]
    watchdog = Watchdog(0.2)  # steps within the limit: silence
    try:
        for iteration in range(5):
            watchdog.step_started(iteration)
            time.sleep(0.05)
            watchdog.step_ended()
        time.sleep(0.5)
    finally:
        watchdog.close()
    assert len(fired) == 1


def test_watchdog_timeout_must_be_positive():
    with pytest.raises(ValueError, match="--watchdog-timeout must be a positive number of seconds, got 0"):
        build_run_config(parse_train_args(TINY + ["--train-iters", "2", "--watchdog-timeout", "0"]))
