"""The training loop's checkpoints (teratron.training.checkpointing): bit-exact resume, resume
into another layout, async saves, SIGTERM / --exit-interval (in process and a real SIGTERM to
`teratron train`), and the load-time refusals."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from dist import run_distributed
from teratron.dist_checkpointing import storage
from teratron.training import checkpointing
from teratron.training.arguments import parse_train_args
from teratron.training.build import build_model, build_optimizer, build_scheduler
from teratron.training.config import build_run_config
from teratron.training.training import pretrain

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--make-vocab-size-divisible-by",
        "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "1",
        "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0", "--num-workers", "0",
        "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--seed", "7", "--deterministic", "--hidden-dropout", "0", "--attention-dropout", "0"]


def train(argv):
    """Loss per iteration of the run (on the logging rank; {} elsewhere)."""
    return dict(pretrain(build_run_config(parse_train_args(TINY + argv))).loss_history)


def rewind(root, iteration, copy_to):
    """A copy of the save directory whose tracker names an earlier checkpoint."""
    shutil.copytree(root, copy_to)
    with open(os.path.join(copy_to, storage.TRACKER_FILENAME), "w") as f:
        f.write(str(iteration))
    return str(copy_to)


def test_resume_is_bit_exact(tmp_path):
    """Iterations 4..6 after a resume from 3 (saved in the background) repeat the uninterrupted
    run exactly (data position, model, optimizer, scheduler, dropout RNG)."""
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    full = train(["--train-iters", "6", "--save", str(tmp_path / "a"), "--save-interval", "3", "--async-save",
                  *dropout])
    assert sorted(os.listdir(tmp_path / "a")) == ["iter_0000003", "iter_0000006", storage.TRACKER_FILENAME]
    resumed = train(["--train-iters", "6", "--load", rewind(tmp_path / "a", 3, tmp_path / "b"), *dropout])
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[i] == full[i] for i in (4, 5, 6)), (resumed, full)


def _train_dp2_distributed_optimizer(save, *extra):
    return train(["--train-iters", "4", "--save", save, "--save-interval", "2", "--use-distributed-optimizer",
                  *extra])


OVERLAPS = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "2000"]


@pytest.mark.parametrize("overlap", [[], OVERLAPS], ids=["no-overlap", "overlap"])
def test_resume_into_another_layout(tmp_path, overlap):
    """DP = 2 with the distributed optimizer saves; one process with the plain optimizer resumes
    and continues the same curve (up to reduction order). With --overlap-param-gather the step
    leaves other ranks' param slices to the next forward: the save must gather them first."""
    full = run_distributed(_train_dp2_distributed_optimizer, 2, str(tmp_path / "a"), *overlap)[-1]
    resumed = train(["--train-iters", "4", "--load", rewind(tmp_path / "a", 2, tmp_path / "b")])
    assert sorted(resumed) == [3, 4]
    for i in (3, 4):
        assert resumed[i] == pytest.approx(full[i], rel=1e-5)


def setup(tmp_path, *extra):
    run = build_run_config(parse_train_args(TINY + ["--train-iters", "10", "--save", str(tmp_path / "ckpt"), *extra]))
    model = build_model(run, torch.device("cpu"))
    optimizer = build_optimizer(run, model)
    return run, model, optimizer, build_scheduler(run, optimizer)


def changed(run, section, **changes):
    """`run` with some fields of one section changed (a RunConfig is frozen)."""
    return dataclasses.replace(run, **{section: dataclasses.replace(getattr(run, section), **changes)})


def test_async_save_exit_signal_and_exit_interval(tmp_path):
    run, model, optimizer, scheduler = setup(tmp_path, "--save-interval", "2")
    save = run.checkpoint.save
    checkpointer = checkpointing.Checkpointer(changed(run, "checkpoint", async_save=True))
    saved, stop = checkpointer.after_iteration(2, model, optimizer, scheduler, 8, 0)
    assert saved and not stop
    checkpointer.finalize_async_save(blocking=True)
    assert storage.read_tracker(save) == 2

    checkpointer = checkpointing.Checkpointer(run)
    handler = checkpointing.ExitSignalHandler()
    try:
        assert not handler.any_rank_received()
        assert checkpointer.after_iteration(3, model, optimizer, scheduler, 12, 0, False) == (False, False)
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
        assert handler.any_rank_received()
        assert checkpointer.after_iteration(3, model, optimizer, scheduler, 12, 0, True) == (True, True)
    finally:
        handler.restore()
    assert storage.read_tracker(save) == 3
    checkpointer = checkpointing.Checkpointer(changed(run, "training", exit_interval=5))
    assert checkpointer.after_iteration(4, model, optimizer, scheduler, 16, 0) == (True, False)
    assert checkpointer.after_iteration(5, model, optimizer, scheduler, 20, 0) == (True, True)
    assert storage.read_tracker(save) == 5

    checkpointer = checkpointing.Checkpointer(changed(run, "checkpoint", load=save))
    torch.manual_seed(11)
    checkpointer.save(5, model, optimizer, scheduler, 20)
    expected_draw = torch.rand(3)  # the RNG states are saved: a resume draws the same numbers
    torch.manual_seed(12)
    assert checkpointer.load(model, optimizer, scheduler) == (5, 20, 0)
    assert torch.equal(torch.rand(3), expected_draw)
    finetune = checkpointing.Checkpointer(changed(run, "checkpoint", load=save, finetune=True))
    assert finetune.load(model, optimizer, scheduler) == (0, 0, 0)


def test_load_refusals(tmp_path):
    run, model, optimizer, scheduler = setup(tmp_path, "--no-save-optim")
    save = run.checkpoint.save
    checkpointer = checkpointing.Checkpointer(changed(run, "checkpoint", load=save))
    assert checkpointer.load(model, optimizer, scheduler) == (0, 0, 0)  # nothing yet
    checkpointer.save(4, model, optimizer, scheduler, 16)
    with pytest.raises(ValueError, match="has no optimizer state; add --no-load-optim"):
        checkpointer.load(model, optimizer, scheduler)
    checkpointer = checkpointing.Checkpointer(changed(run, "checkpoint", load=save, no_load_optim=True))
    assert checkpointer.load(model, optimizer, scheduler) == (4, 16, 0)

    other, other_model, other_optimizer, other_scheduler = setup(tmp_path, "--hidden-size", "48")
    other = changed(other, "checkpoint", load=save, no_load_optim=True)
    with pytest.raises(ValueError, match=r"another model: --hidden-size \(saved 32, now 48\)"):
        checkpointing.Checkpointer(other).load(other_model, other_optimizer, other_scheduler)
    # A description that lies about the model: the tensors themselves disagree.
    t = run.transformer
    lying = dataclasses.replace(other.model, transformer=dataclasses.replace(
        other.transformer, hidden_size=t.hidden_size, kv_channels=t.kv_channels, ffn_hidden_size=t.ffn_hidden_size))
    shapes = r"22 keys with other shapes: .*linear_fc1.weight: saved \(128, 32\), expected \(256, 48\)"
    with pytest.raises(ValueError, match=shapes):
        checkpointing.Checkpointer(dataclasses.replace(other, model=lying)).load(
            other_model, other_optimizer, other_scheduler)

    meta = os.path.join(save, "iter_0000004", "metadata.json")
    record = json.loads(open(meta).read())
    assert record["format"] == storage.FORMAT and record["format_version"] == storage.FORMAT_VERSION
    open(meta, "w").write(json.dumps({**record, "format_version": storage.FORMAT_VERSION + 1}))
    with pytest.raises(ValueError, match="format version 2 is newer than this teratron reads"):
        checkpointer.load(model, optimizer, scheduler)
    open(meta, "w").write("{not json")
    with pytest.raises(ValueError, match="metadata.json: not valid JSON"):
        checkpointer.load(model, optimizer, scheduler)
    open(os.path.join(save, storage.TRACKER_FILENAME), "w").write("7")
    with pytest.raises(FileNotFoundError, match="iter_0000007 is missing"):
        checkpointer.load(model, optimizer, scheduler)
    open(os.path.join(save, storage.TRACKER_FILENAME), "w").write("soon")
    with pytest.raises(ValueError, match="not an iteration number"):
        checkpointer.load(model, optimizer, scheduler)


def test_parameters_without_optimizer_state_are_named(tmp_path, monkeypatch, capsys):
    """A checkpoint whose optimizer state lacks some parameters' (frozen when it was saved, as in
    MTP-only training, or another model's state) loads the others' and says which start fresh, in one
    line; a checkpoint with every parameter's state says nothing."""
    from teratron.dist_checkpointing import serialization

    train(["--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"])  # Adam has state
    run, model, optimizer, scheduler = setup(tmp_path, "--train-iters", "2")
    checkpointer = checkpointing.Checkpointer(changed(run, "checkpoint", load=run.checkpoint.save))
    capsys.readouterr()
    assert checkpointer.load(model, optimizer, scheduler)[0] == 2
    assert "holds no optimizer state" not in capsys.readouterr().out
    saved_keys = serialization.saved_keys
    lost = "decoder.layers.1.mlp.linear_fc2.weight"
    monkeypatch.setattr(serialization, "saved_keys", lambda folder: {
        key: shape for key, shape in saved_keys(folder).items()
        if not (key.startswith("optimizer.state.") and key.endswith(lost))})
    assert checkpointer.load(model, optimizer, scheduler)[0] == 2
    notes = [line for line in capsys.readouterr().out.splitlines() if "holds no optimizer state" in line]
    assert len(notes) == 1 and f"for 1 of the model's parameters ({lost})" in notes[0], notes


def test_sigterm_saves_and_exits_cleanly_without_evaluating(tmp_path):
    """SIGTERM under --exit-signal-handler: the iteration it arrives in is saved and the run
    stops, with no validation (due every iteration here) nor test evaluation first."""
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "teratron", "train", *TINY, "--train-iters", "100000", "--save", str(save),
           "--exit-signal-handler", "--metrics-file", str(metrics), "--eval-iters", "1", "--eval-interval", "1"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = records[-1]["iteration"]
    assert 3 <= last < 100000 and storage.read_tracker(str(save)) == last
    assert sorted(os.listdir(save)) == [f"iter_{last:07d}", storage.TRACKER_FILENAME]
    evaluated = [r["iteration"] for r in records if "lr" not in r]
    assert evaluated == list(range(1, last))  # every iteration but the signalled one; no test split
    assert "lr" in records[-1] and not any("test_lm_loss" in r for r in records)
    assert out.count(f"saved checkpoint at iteration {last} to {save}") == 1
    assert f"exiting after iteration {last}: SIGTERM (--exit-signal-handler), no evaluation" in out


def test_another_vocabulary_or_tokenizer_is_refused_unless_asked_for(tmp_path, capsys):
    """The vocabulary belongs to the model: a resume with another --vocab-size (or another
    tokenizer) stops with one line, unless --allow-tokenizer-change, which says what it does."""
    from teratron.tokenizers import NullTokenizer

    run, model, optimizer, scheduler = setup(tmp_path)
    embedding = model[0].module.embedding.word_embeddings.weight
    with torch.no_grad():
        embedding.add_(1.0)  # rows no initialisation draws
    checkpointing.Checkpointer(run, NullTokenizer(100)).save(4, model, optimizer, scheduler, 16)
    save = run.checkpoint.save
    record = storage.read_metadata(os.path.join(save, "iter_0000004"))
    assert record["tokenizer"] == NullTokenizer(100).fingerprint()

    other, other_model, other_optimizer, other_scheduler = setup(tmp_path, "--vocab-size", "120")
    refused = checkpointing.Checkpointer(changed(other, "checkpoint", load=save), NullTokenizer(120))
    with pytest.raises(ValueError, match=r"its vocabulary has 100 ids, this run's 120; .*--allow-tokenizer-change"):
        refused.load(other_model, other_optimizer, other_scheduler)
    allowed = checkpointing.Checkpointer(changed(other, "checkpoint", load=save, allow_tokenizer_change=True),
                                         NullTokenizer(120))
    assert allowed.load(other_model, other_optimizer, other_scheduler) == (4, 16, 0)
    assert "NOTE: --allow-tokenizer-change: its vocabulary has 100 ids" in capsys.readouterr().out
    # The checkpoint's rows are loaded (both pad to 128 rows here).
    assert torch.equal(other_model[0].module.embedding.word_embeddings.weight[:100], embedding[:100])

    # Same vocabulary size, another tokenizer (its id -> token table differs).
    stranger = NullTokenizer(100)
    stranger.fingerprint = lambda: {"class": "ByteLevelTokenizer", "vocab_size": 100, "sha256": "0" * 64}
    with pytest.raises(ValueError, match=r"another tokenizer \(NullTokenizer, 100 ids; now ByteLevelTokenizer"):
        checkpointing.Checkpointer(changed(run, "checkpoint", load=save), stranger).load(model, optimizer, scheduler)


def _async_group_timeout(timeout):
    import torch.distributed as dist

    from teratron.dist_checkpointing import checkpoint

    asked = []
    new_group = dist.new_group
    dist.new_group = lambda *args, **kwargs: asked.append(kwargs) or new_group(*args, **kwargs)
    try:
        checkpoint._ASYNC_GROUP = None
        group = checkpoint._async_group(timeout)
        assert checkpoint.all_ranks_true(True, group)
    finally:
        dist.new_group = new_group
    return asked


def test_the_async_writer_group_times_out_with_the_run(tmp_path, monkeypatch):
    """--async-save's own gloo group takes --distributed-timeout-minutes, not gloo's default."""
    import datetime

    minutes = datetime.timedelta(minutes=3)
    assert run_distributed(_async_group_timeout, 2, minutes) == [[{"backend": "gloo", "timeout": minutes}]] * 2
    run, model, optimizer, scheduler = setup(tmp_path, "--async-save", "--distributed-timeout-minutes", "3")
    started = []
    monkeypatch.setattr(checkpointing.dist_checkpointing, "start_async_save",
                        lambda **kwargs: started.append(kwargs["timeout"]))
    checkpointing.Checkpointer(run).save(1, model, optimizer, scheduler, 4)
    assert started == [minutes]


def test_ctrl_c_inside_a_save_is_an_interruption_and_the_last_checkpoint_stays(tmp_path, monkeypatch):
    """DCP wraps a KeyboardInterrupt of its writers with every other failure: the save re-raises
    it as Ctrl+C (the CLI then names the checkpoint to resume from), not as a failed save."""
    from torch.distributed.checkpoint import CheckpointException

    from teratron.dist_checkpointing import serialization

    run, model, optimizer, scheduler = setup(tmp_path)
    checkpointer = checkpointing.Checkpointer(run)
    checkpointer.save(2, model, optimizer, scheduler, 8)

    def interrupted_write(*args, **kwargs):
        raise CheckpointException("write", {0: (KeyboardInterrupt(), None)})

    monkeypatch.setattr(serialization, "save", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        checkpointer.save(3, model, optimizer, scheduler, 12)
    save = run.checkpoint.save
    assert storage.read_tracker(save) == 2 and sorted(os.listdir(save)) == ["iter_0000002", storage.TRACKER_FILENAME]
    assert checkpointing.resume_hint(save) == f"resume from iteration 2 with --load {save}"
    monkeypatch.setattr(serialization, "save", lambda *a, **k: (_ for _ in ()).throw(
        CheckpointException("write", {0: (OSError("disk full"), None)})))
    with pytest.raises(OSError, match="writing checkpoint iteration 3 failed .*disk full"):
        checkpointer.save(3, model, optimizer, scheduler, 12)
