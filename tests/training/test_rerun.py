"""The rerun state machine through `teratron train` (training/rerun.py): injected faults, the
determinism report, and the flags' errors.

An injected transient fault makes the first try's gradients NaN; the re-run must replay the same
micro-batches with the same random state (dropout is on) and the optimizer must never see the bad
try, so the run's per-iteration losses and grad norms equal the clean run's exactly (and at DP 2
under torchrun those of the clean run at DP 2). An injected persistent fault
ends the run with Megatron's exit code 16, one line, and a checkpoint of the iteration before.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.training.test_context_parallel_training import MOCK, MOE, MOE_KEYS, TINY

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "4"]
TRANSIENT = ["--error-injection-rate", "1", "--error-injection-type", "transient_error"]


def _train(tmp_path, name, args, nproc=None):
    """(returncode, training records, stdout, stderr)."""
    launcher = [sys.executable, "-m", "teratron"]
    if nproc:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
                    "-m", "teratron"]
    path = tmp_path / f"{name}.jsonl"
    cmd = launcher + ["train"] + TINY + MOCK + DROPOUT + args + ["--metrics-file", str(path)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return proc.returncode, [r for r in records if "lr" in r], proc.stdout, proc.stderr


def _curve(records):
    return [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in records]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    rc, records, out, err = _train(tmp_path_factory.mktemp("clean"), "clean", [])
    assert rc == 0, out + err
    assert [r["iteration"] for r in records] == [1, 2, 3, 4] and "re-run" not in out
    return records


def test_transient_fault_continues_with_the_clean_runs_results(clean, tmp_path):
    tracker = tmp_path / "rejected.txt"
    rc, records, out, err = _train(tmp_path, "transient", TRANSIENT + ["--result-rejected-tracker-filename",
                                                                       str(tracker)])
    assert rc == 0, out + err
    assert _curve(records) == _curve(clean)  # exactly: same data, same dropout masks, no bad update
    for iteration in (2, 3, 4):  # the first step of a process is not validated (Megatron's rule)
        assert f"iteration {iteration}: found an injected fault" not in out
        assert (f"iteration {iteration}: found a NaN/Inf gradient norm; re-running the step on the same data and "
                f"random state") in out
        assert f"iteration {iteration}: the re-run differs and passes the checks (a transient fault)" in out
    assert "iteration 1:" not in out
    lines = tracker.read_text().splitlines()
    assert [(line.split(" iteration=")[1].split()[0], line.split(" status=")[1].split()[0]) for line in lines] == [
        (str(i), status) for i in (2, 3, 4) for status in ("initial_run", "first_rerun_not_reproducible")]


def test_injection_rate_draws_its_own_numbers(clean, tmp_path):
    """--error-injection-rate 2: Megatron's draw (randint(0, rate - 1) + rank) % rate == 0 on each
    validated step, from a generator of its own seeded with --seed (7): the steps it hits, and
    the run's results unchanged."""
    import random

    draws = random.Random(7)
    hit = [i for i in (2, 3, 4) if draws.randint(0, 1) == 0]
    assert 0 < len(hit) < 3  # the test shows both outcomes
    rc, records, out, err = _train(tmp_path, "rate2", ["--error-injection-rate", "2"])
    assert rc == 0, out + err
    assert [i for i in (2, 3, 4) if f"iteration {i}: the re-run differs" in out] == hit
    assert _curve(records) == _curve(clean)


def test_transient_fault_in_a_moe_model(tmp_path):
    """The MoE metrics of the bad try are dropped: the run equals the clean one, MoE metrics
    (aux losses, load imbalance) included, with the routers' expert bias on."""
    moe = MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-bias-update-rate", "0.1"]
    runs = [_train(tmp_path, name, moe + args) for name, args in [("moe_clean", []), ("moe_transient", TRANSIENT)]]
    (rc, reference, out, err), (rc2, records, out2, err2) = runs
    assert rc == rc2 == 0, out + err + out2 + err2
    assert out2.count("(a transient fault)") == 3
    keys = sorted(k for k in reference[0] if k.startswith(tuple(MOE_KEYS)))
    assert keys
    assert [[r[k] for k in ["lm_loss", "grad_norm"] + keys] for r in records] == \
        [[r[k] for k in ["lm_loss", "grad_norm"] + keys] for r in reference]


class _Counting(torch.nn.Module):
    """A weight, and a buffer that each forward adds its input's sum to (like a router's token
    counts); draws from torch's generator (like dropout)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.sum()
        return (self.weight * x * torch.rand(3)).sum()


def test_a_rerun_replays_the_batches_random_state_and_buffers():
    """The machine on its own: the step's second try sees the same two micro-batches, the same
    random numbers, and the module's buffer as before the step; the next step reads on."""
    from teratron.training.config import TrainingConfig
    from teratron.training.rerun import RerunStateMachine

    torch.manual_seed(0)
    model = _Counting()
    data = iter([torch.full((3,), float(i)) for i in range(1, 7)])
    training = TrainingConfig(micro_batch_size=1, global_batch_size=2, train_iters=3, seq_length=4,
                              error_injection_rate=1, error_injection_type="transient_error")
    machine = RerunStateMachine(training, [model], [data], torch.device("cpu"))
    tries = []

    def forward_backward():
        model.weight.grad = None
        batches = [next(machine.iterators[0]) for _ in range(2)]
        loss = sum(model(x) for x in batches)
        loss.backward()
        tries.append(([b[0].item() for b in batches], loss.item(), model.seen.item()))
        return {"lm loss": loss.detach()}

    lines = []
    for iteration in (1, 2, 3):
        machine.run_step(iteration, forward_backward, log=lines.append)
    # step 1 is not validated; steps 2 and 3 are injected, tried twice on the same batches
    assert [t[0] for t in tries] == [[1, 2], [3, 4], [3, 4], [5, 6], [5, 6]]
    assert tries[1][1] == tries[2][1] and tries[3][1] == tries[4][1]  # same random numbers
    assert [t[2] for t in tries] == [9, 30, 30, 63, 63]  # the buffer as if each step ran once (3 x each x)
    assert model.seen.item() == 63 and torch.isfinite(model.weight.grad).all()
    assert sum("(a transient fault)" in line for line in lines) == 2


def test_transient_fault_at_data_parallel_2(tmp_path):
    """Each DP rank draws its own dropout masks, so the reference is the clean run at DP 2."""
    rc, reference, out, err = _train(tmp_path, "dp2_clean", [], nproc=2)
    assert rc == 0 and "re-run" not in out, out + err
    rc, records, out, err = _train(tmp_path, "dp2", TRANSIENT, nproc=2)
    assert rc == 0, out + err
    assert out.count("(a transient fault)") == 3
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert _curve(records) == _curve(reference)


def test_persistent_fault_saves_and_exits_16(tmp_path):
    save = tmp_path / "ckpt"
    rc, records, out, err = _train(tmp_path, "persistent", ["--error-injection-rate", "1", "--error-injection-type",
                                                            "persistent_error", "--save", str(save),
                                                            "--save-interval", "100"])
    assert rc == 16, out + err
    errors = [line for line in err.splitlines() if line.startswith("teratron: error:")]
    assert errors == [
        "teratron: error: iteration 2: found a NaN/Inf gradient norm, and the re-run on the same data reproduced it "
        "(a persistent fault, or the data and weights really give it); if training diverged, lower --lr, check the "
        "data, or pass --skip-nan-steps; checkpoint of iteration 1 in "
        f"{save}: resume from it on other hardware to tell which; exiting with code 16"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert [r["iteration"] for r in records] == [1]  # the failed step is not logged


def test_correct_result_injection_is_reproduced(tmp_path):
    """Rejected although sound: the re-run agrees, so the run cannot tell it from a persistent fault."""
    rc, _, out, err = _train(tmp_path, "correct", ["--error-injection-rate", "1", "--error-injection-type",
                                                   "correct_result"])
    assert rc == 16, out + err
    assert ("iteration 2: found an injected fault (correct_result, --error-injection-type), and the re-run on the "
            "same data reproduced it") in err
    assert "no --save, nothing saved; exiting with code 16" in err


def test_determinism_report_on_cpu(clean, tmp_path):
    rc, records, out, err = _train(tmp_path, "stats", ["--rerun-mode", "report_stats"])
    assert rc == 0, out + err
    assert _curve(records) == _curve(clean)
    for iteration in (2, 4):
        assert (f"determinism stats after iteration {iteration} (all ranks): loss: 2 re-runs, 2 identical, relative "
                "spread mean 0.000e+00 max 0.000e+00; grad norm: 2 re-runs, 2 identical, relative spread mean "
                "0.000e+00 max 0.000e+00") in out


@pytest.mark.parametrize("args, message", [
    (["--rerun-mode", "disabled", "--error-injection-rate", "1"],
     "teratron: error: --error-injection-rate injects faults for the result checks of --rerun-mode validate_results; "
     "use that mode with a check (the NaN check is on by default)"),
    (["--error-injection-rate", "-1"],
     "teratron: error: --error-injection-rate must be 0 (off) or a positive number of steps, got -1"),
    (["--result-rejected-tracker-filename", "no/such/folder/file.txt"],
     "teratron: error: --result-rejected-tracker-filename no/such/folder/file.txt: cannot be appended to (No such "
     "file or directory); choose a writable file"),
])
def test_flag_errors_are_one_line(tmp_path, args, message):
    rc, _, out, err = _train(tmp_path, "bad", args)
    assert rc == 2 and err.strip().splitlines()[-1] == message, out + err
    assert len([line for line in err.splitlines() if line.startswith("teratron")]) == 1


def test_rerun_mode_values_are_megatrons(tmp_path):
    rc, _, out, err = _train(tmp_path, "bad", ["--rerun-mode", "sometimes"])
    assert rc == 2 and "--rerun-mode: invalid choice: 'sometimes'" in err


RESTARTS = ["--train-iters", "5", "--save-interval", "1"]


def _killed_once(tmp_path, killed_rank):
    """torchrun --max-restarts 1 with --save = --load, rank `killed_rank` SIGKILLed after iteration
    3's step is logged (before its save): (process, training records)."""
    save, path = str(tmp_path / "restarted"), tmp_path / "restarted.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "--max-restarts",
           "1", "-m", "teratron", "train"] + TINY + MOCK + DROPOUT + RESTARTS + [
        "--save", save, "--load", save, "--metrics-file", str(path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TERATRON_TEST_KILL_RANK_AT=f"{killed_rank}:3",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # see the test below
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return proc, [r for r in records if "lr" in r]


@pytest.mark.parametrize("killed_rank", [0, 1])
def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path, killed_rank):
    """torchrun stops the other rank and starts both again; they resume from iteration 2 of --save
    (a lock the dead attempt left is taken over: its process is gone) and end with the
    uninterrupted run's metrics, one record per iteration."""
    rc, reference, out, err = _train(tmp_path, "whole", RESTARTS + ["--save", str(tmp_path / "whole")], nproc=2)
    assert rc == 0, out + err
    proc, records = _killed_once(tmp_path, killed_rank)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from iteration 2 of --load" in proc.stdout
    # Rank 0 holds the lock: killed, it leaves it behind; stopped by torchrun, it gives it back.
    assert ("is no longer running; taking its lock over" in proc.stdout) == (killed_rank == 0)
    assert _curve(records) == _curve(reference)
    assert (tmp_path / "restarted" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"


@pytest.mark.parametrize("restart_count, fails_with_hint", [("1", True), ("0", False)])
def test_a_restart_that_cannot_connect_names_the_fix(monkeypatch, restart_count, fails_with_hint):
    """torchrun's shared store may hand a restarted rank the failed attempt's addresses (a race,
    so simulated here): the error names torchrun's switch; a first attempt's error is torch's own."""
    import teratron.parallel_state as parallel_state

    def refused(*args, **kwargs):
        raise RuntimeError("Gloo connectFullMesh failed: Connection refused")

    monkeypatch.setattr(parallel_state, "exit_with_parent", lambda: None)
    monkeypatch.setattr(parallel_state.dist, "init_process_group", refused)
    for name, value in [("WORLD_SIZE", "2"), ("RANK", "1"), ("TORCHELASTIC_RESTART_COUNT", restart_count),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True")]:
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError) as error:
        parallel_state.initialize_distributed("gloo")
    hint = ("the ranks of this torchrun restart could not connect: torchrun's shared store still holds the failed "
            "attempt's addresses (pytorch/pytorch#135712); run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    assert str(error.value) == (hint if fails_with_hint else "Gloo connectFullMesh failed: Connection refused")
