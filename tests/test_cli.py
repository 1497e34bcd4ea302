"""`teratron train` end to end: mock data single-process vs TP=2 under torchrun, resume from a
checkpoint (same layout and TP=2), pipeline layouts (1F1B, interleaved, a layout string) and
optimizer CPU offload against the single process, MoE under EP (both dispatchers) and PP against
the single process, the shrunken MoE examples, the metrics file, the shortened embedded demo,
NaN handling, every bad-input case, and the estimate/bench subcommands."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from teratron import cli

METRIC_KEYS = {"iteration", "lm_loss", "grad_norm", "lr", "tokens_per_sec", "tflops_per_gpu", "mfu",
               "mem_peak_gib", "skipped"}
# Vocab 100 pads to 128 alone and to 256 with TP = 2 (Megatron's 128 x TP): padding is not a token,
# so both runs compute the same loss.
TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--lr-warmup-iters", "2",
        "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1", "--num-workers", "0",
        "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--seed", "7"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _teratron(args, cwd, launcher=None):
    cmd = (launcher or [sys.executable, "-m", "teratron"]) + ["train"] + args
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _metrics(path):
    """The training log records (evaluation records have no "lr")."""
    return [r for r in _records(path) if "lr" in r]


def test_mock_data_single_process_tp2_torchrun_and_resume(tmp_path):
    single = tmp_path / "single.jsonl"
    _teratron(TINY + NO_DROPOUT + ["--train-iters", "10", "--metrics-file", str(single),
                                   "--save", str(tmp_path / "ckpt"), "--save-interval", "5"], tmp_path)
    records = _metrics(single)
    assert [r["iteration"] for r in records] == list(range(1, 11))
    # Validation at 5 and 10 (not repeated at the end), then the test split once.
    evals = [r for r in _records(single) if "lr" not in r]
    assert [(r["iteration"], set(r) - {"iteration"}) for r in evals] == [
        (5, {"val_lm_loss"}), (10, {"val_lm_loss"}), (10, {"test_lm_loss"})]
    for r in records:
        assert set(r) == METRIC_KEYS
        assert r["skipped"] == 0 and r["mfu"] is None and r["tokens_per_sec"] > 0
    assert records[-1]["lm_loss"] < records[0]["lm_loss"]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "iter_0000005", "iter_0000010", "latest_checkpointed_iteration.txt"]

    # TP = 2 under torchrun (gloo): the same losses as the single process.
    tp2 = tmp_path / "tp2.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone", "-m", "teratron"]
    _teratron(TINY + NO_DROPOUT + ["--train-iters", "10", "--tensor-model-parallel-size", "2",
                                   "--metrics-file", str(tp2)], tmp_path, launcher=torchrun)
    tp_records = _metrics(tp2)
    assert [r["iteration"] for r in tp_records] == list(range(1, 11))
    for a, b in zip(records, tp_records):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)

    # Resume from iteration 5: iterations 6..10 repeat the uninterrupted run.
    resume_dir = tmp_path / "resume"
    shutil.copytree(tmp_path / "ckpt", resume_dir)
    (resume_dir / "latest_checkpointed_iteration.txt").write_text("5")
    resumed = tmp_path / "resumed.jsonl"
    _teratron(TINY + NO_DROPOUT + ["--train-iters", "10", "--load", str(resume_dir),
                                   "--metrics-file", str(resumed)], tmp_path)
    again = _metrics(resumed)
    assert [r["iteration"] for r in again] == list(range(6, 11))
    for a, b in zip(records[5:], again):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-6)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-12)

    # The same checkpoint resumed with TP = 2: the sharded format reshards on load.
    resharded = tmp_path / "resharded.jsonl"
    _teratron(TINY + NO_DROPOUT + ["--train-iters", "10", "--load", str(resume_dir),
                                   "--tensor-model-parallel-size", "2", "--metrics-file", str(resharded)],
              tmp_path, launcher=torchrun)
    for a, b in zip(records[5:], _metrics(resharded)):
        assert b["iteration"] == a["iteration"]
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)


def _write_short_documents(prefix):
    """400 documents of 2..11 tokens, each ending in EOD (99, NullTokenizer's last id at vocab
    100): every 16-token sample spans several, so --reset-position-ids changes the positions."""
    import numpy as np

    from teratron.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16) as builder:
        for _ in range(400):
            n = int(rng.integers(2, 12))
            builder.add_document(np.concatenate([rng.integers(0, 99, n - 1), [99]]), [n])
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _pipeline_flags(tmp_path):
    """4 layers; RoPE with --reset-position-ids, so a stage that did not get the batch's position
    ids would rotate with 0..s-1; init std and lr large enough that positions move the loss."""
    model = TINY[TINY.index("--tokenizer-type"):]
    model[model.index("--num-layers") + 1] = "4"
    model[model.index("--lr") + 1] = "1e-2"
    return model + NO_DROPOUT + [
        "--data-path", _write_short_documents(tmp_path / "short"), "--split", "90,10,0",
        "--data-cache-path", str(tmp_path / "cache"), "--reset-position-ids",
        "--init-method-std", "0.3", "--eval-interval", "3", "--train-iters", "6"]


def test_pipeline_layouts_and_offload_equal_single_process(tmp_path):
    """PP 2 (1F1B), PP 2 x VPP 2 (interleaved) and a layout string with uneven, empty-decoder
    virtual stages under torchrun, and CPU offload of half the optimizer (plain and distributed):
    each run's losses and grad norms equal the single process's."""
    flags = _pipeline_flags(tmp_path)

    def train(name, extra, launcher=None):
        path = tmp_path / f"{name}.jsonl"
        _teratron(flags + extra + ["--metrics-file", str(path)], tmp_path, launcher)
        records = _metrics(path)
        assert [r["iteration"] for r in records] == list(range(1, 7)), name
        return records

    reference = train("single", [])
    # The data exercises the position ids: without the reset the losses differ.
    flags.remove("--reset-position-ids")
    plain_positions = train("no-reset", [])
    flags.append("--reset-position-ids")
    assert plain_positions[0]["lm_loss"] != pytest.approx(reference[0]["lm_loss"], rel=1e-4)

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone", "-m", "teratron"]
    pp2 = ["--pipeline-model-parallel-size", "2"]
    runs = {
        # The distributed optimizer's offload path too (DP 1: the shards are whole buffers).
        "pp2-distopt-offload": (pp2 + ["--use-distributed-optimizer", "--optimizer-cpu-offload",
                                       "--optimizer-offload-fraction", "0.5"], torchrun),
        "pp2-vpp2": (pp2 + ["--num-layers-per-virtual-pipeline-stage", "1"], torchrun),
        # stages [E t t] [t] | [t] [L]: rank 0 holds 2 + 1 layers, rank 1 1 + 0.
        "layout": (pp2 + ["--pipeline-model-parallel-layout", "Ett|t|t|L"], torchrun),
        "offload": (["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"], None),
    }
    for name, (extra, launcher) in runs.items():
        for a, b in zip(reference, train(name, extra, launcher)):
            assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5), (name, a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (name, a, b)


def test_shortened_demo(tmp_path):
    demo_dir = tmp_path / "demo"
    proc = _teratron(["--train-iters", "20", "--log-interval", "10", "--eval-interval", "10",
                      "--save-interval", "20", "--demo-dir", str(demo_dir), "--demo-samples", "2",
                      "--no-progress-bar"], tmp_path)
    assert (demo_dir / "loss.png").stat().st_size > 1000
    assert (demo_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "20"
    samples = (demo_dir / "samples.txt").read_text().splitlines()
    assert len(samples) == 2 and all(samples)
    assert samples[0] in proc.stdout.replace("  > ", "")
    losses = [r["lm_loss"] for r in _metrics(demo_dir / "metrics.jsonl")]
    assert losses[-1] < losses[0]


def _write_corrupt_dataset(tmp_path):
    prefix = tmp_path / "corrupt"
    (tmp_path / "corrupt.bin").write_bytes(b"\x00" * 64)
    (tmp_path / "corrupt.idx").write_bytes(b"NOT-AN-INDEX" * 4)
    return str(prefix)


def _bad_input_cases(tmp_path):
    """name -> (flags, a phrase the one-line message must contain)."""
    data = TINY[TINY.index("--tokenizer-type"):]  # the tiny run without --mock-data
    return {
        "missing .bin/.idx": (data + ["--data-path", str(tmp_path / "nothing")], "nothing.bin"),
        "corrupt .bin/.idx": (data + ["--data-path", _write_corrupt_dataset(tmp_path)], "corrupt.idx"),
        "unparsable --data-path": (data + ["--data-path", "0.5", "a", "0.5"], "--data-path"),
        "unparsable --split": (TINY + ["--split", "a,b"], "--split 'a,b'"),
        "unknown tokenizer": (TINY + ["--tokenizer-type", "NoSuchTokenizer"], "NoSuchTokenizer"),
        "missing vocab files": (TINY + ["--tokenizer-type", "GPT2BPETokenizer",
                                        "--vocab-file", str(tmp_path / "no-vocab.json"),
                                        "--merge-file", str(tmp_path / "no-merges.txt")], "--vocab-file"),
        "global batch not divisible": (TINY + ["--global-batch-size", "3"], "--global-batch-size (3)"),
        "shape the config rejects": (TINY + ["--hidden-size", "30"], "--hidden-size (30)"),
        "config field out of range": (TINY + ["--hidden-dropout", "1.5"], "--hidden-dropout must be in [0, 1]"),
        "warm-up longer than training": (TINY + ["--lr-warmup-iters", "5"], "--lr-warmup-iters (5)"),
        "unknown flag": (TINY + ["--num-layer", "2"], "--num-layer"),
        "zero query groups": (TINY + ["--group-query-attention", "--num-query-groups", "0"],
                              "--num-query-groups (0) must divide"),
        "negative seed": (TINY + ["--seed", "-1"], "--seed must be in"),
        "a model no machine holds": (TINY + ["--hidden-size", "1000000000"], "GiB per process (teratron estimate)"),
        "copy-engine collectives without a GPU": (
            TINY + ["--use-distributed-optimizer", "--ddp-copy-engine-collectives"],
            "--ddp-copy-engine-collectives needs CUDA GPUs"),
        "negative learning rate": (TINY + ["--lr", "-1"], "--lr=-1.0 must be a finite number >= 0"),
        "metrics file is a directory": (TINY + ["--metrics-file", str(tmp_path)], "--metrics-file"),
        "tensorboard dir is a file": (TINY + ["--tensorboard-dir", _write_corrupt_dataset(tmp_path) + ".bin"],
                                      "--tensorboard-dir"),
        "missing config file": (TINY + ["--config", str(tmp_path / "none.yaml")], "none.yaml"),
        "config is a directory": (TINY + ["--config", str(tmp_path)], "--config"),
        "load from a corrupt checkpoint": (TINY + ["--load", _write_corrupt_checkpoint(tmp_path)],
                                           "iter_0000003"),
    }


def _write_corrupt_checkpoint(tmp_path):
    """A tracker naming iteration 3, whose folder holds only garbage."""
    folder = tmp_path / "bad-ckpt"
    (folder / "iter_0000003").mkdir(parents=True)
    for name in ("metadata.json", "common.pt", "__0_0.distcp", ".metadata"):
        (folder / "iter_0000003" / name).write_bytes(b"not a checkpoint")
    (folder / "latest_checkpointed_iteration.txt").write_text("3")
    return str(folder)


def test_bad_input_in_process(tmp_path, capsys):
    """Each case: exit status 2, one `teratron: error:` line naming the problem, no traceback,
    no checkpoint folder."""
    for i, (name, (argv, phrase)) in enumerate(_bad_input_cases(tmp_path).items()):
        save = tmp_path / f"ckpt-{i}"
        status = cli.main(["train"] + argv + ["--train-iters", "4", "--save", str(save)])
        out, err = capsys.readouterr()
        assert status == 2, name
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("teratron: error: "), (name, err)
        assert phrase in lines[0], (name, lines[0])
        assert "Traceback" not in out + err, name
        assert not save.exists(), name


def test_demo_flag_errors(capsys):
    """The demo's own flags fail before its corpus is prepared."""
    for argv, phrase in [(["--demo-samples", "-1"], "--demo-samples must be >= 0"),
                         (["--vocab-file", "x.json"], "the embedded demo uses its own tokenizer")]:
        assert cli.main(["train"] + argv) == 2, argv
        out, err = capsys.readouterr()
        assert err.startswith("teratron: error: ") and phrase in err, (argv, err)
        assert "teratron demo" not in out, (argv, out)


def test_bad_input_subprocess_unwritable_save(tmp_path):
    """A real process: an unwritable --save fails before training, one line, status 2."""
    save = "/proc/teratron-cannot-write-here"
    proc = subprocess.run([sys.executable, "-m", "teratron", "train"] + TINY + [
        "--train-iters", "4", "--save", save], cwd=tmp_path, env=_env(), capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("teratron: error: --save"), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "iteration" not in proc.stdout


def test_non_finite_loss_stops_or_skips(tmp_path, capsys):
    """A huge learning rate blows the weights up: the re-run reproduces the NaN and the run stops
    with one line and Megatron's exit code 16 (rerun state machine), or with --rerun-mode disabled
    with exit status 2; with --skip-nan-steps it skips those steps and finishes."""
    blow_up = TINY + ["--train-iters", "6", "--lr", "1e30", "--min-lr", "1e30", "--clip-grad", "0"]
    assert cli.main(["train"] + blow_up) == 16
    out, err = capsys.readouterr()
    assert err.startswith("teratron: error: iteration ") and "NaN/Inf" in err and "reproduced it" in err
    assert "--skip-nan-steps" in err and "no --save, nothing saved" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err
    assert cli.main(["train"] + blow_up + ["--rerun-mode", "disabled"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("teratron: error: iteration ") and "NaN/Inf" in err and "--skip-nan-steps" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err

    metrics = tmp_path / "skip.jsonl"
    assert cli.main(["train"] + blow_up + ["--skip-nan-steps", "--metrics-file", str(metrics)]) == 0
    records = _metrics(metrics)
    assert records[-1]["iteration"] == 6 and records[-1]["skipped"] > 0
    # Counted per logged window (--log-interval 1: one iteration), as in Megatron's log line.
    assert all(r["skipped"] in (0, 1) for r in records), records
    assert records[0]["skipped"] == 0 and math.isfinite(records[0]["lm_loss"])


def test_top_level_command_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("teratron ")
    for argv, phrase in [(["bogus"], "invalid choice: 'bogus'"), ([], "command"),
                         (["preprocess", "--input", "x.jsonl"], "--output-prefix"),
                         (["merge"], "--inputs"), (["convert", "nope"], "invalid choice: 'nope'"),
                         (["estimate", "--mock-data", "--num-layer", "2"], "unrecognized arguments: --num-layer"),
                         (["estimate", "--mock-data", "--world-size", "0"], "--world-size must be >= 1, got 0"),
                         (["bench", "--iters", "0"], "--iters"),
                         (["bench", "--train-iters", "5"], "set by teratron bench")]:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("teratron: error: ") and phrase in err[0], (argv, err)


def test_estimate_command(capsys):
    """`teratron estimate` takes the train flags (pipeline and offload ones included) and prints
    its table; `teratron --help` lists it and bench."""
    flags = TINY[:TINY.index("--lr")] + ["--num-layers", "4", "--global-batch-size", "8",
                                         "--pipeline-model-parallel-size", "2",
                                         "--num-layers-per-virtual-pipeline-stage", "1",
                                         "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
                                         "--world-size", "4"]
    assert cli.main(["estimate"] + flags) == 0
    out, err = capsys.readouterr()
    assert out.startswith("teratron estimate: ") and "PP 2 x CP 1 x DP 2" in out, out
    assert "stage 1" in out and "PEAK ALLOCATED" in out and not err

    # A layout string (here with the embedding and loss on stages of their own, which the
    # whole-model parameter count must not inherit), and MoE layers on one stage only.
    layout = flags[:flags.index("--num-layers-per-virtual-pipeline-stage")] + [
        "--pipeline-model-parallel-layout", "E|tt|tt|L", "--world-size", "4", "--json"]
    assert cli.main(["estimate"] + layout) == 0
    with_layout = json.loads(capsys.readouterr().out)
    assert with_layout["layout"]["vpp"] == 2 and len(with_layout["stages"]) == 2
    assert cli.main(["estimate"] + layout[:layout.index("--pipeline-model-parallel-layout")] + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_parameters"] == with_layout["model_parameters"]
    # Virtual stages E | tt | tt | L go to ranks 0, 1, 0, 1: layers 1-2 (the MoE ones) on rank 1.
    moe = layout + ["--num-experts", "4", "--moe-layer-freq", "[1,1,0,0]", "--expert-model-parallel-size", "2"]
    assert cli.main(["estimate"] + moe) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [any("moe" in part for part in s["params"]) for s in stages] == [False, True], stages
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "teratron estimate" in out and "teratron bench" in out


# 4 layers, MoE in layers 1 and 3 (--moe-layer-freq 2), 4 experts, top-2, aux loss and z-loss
# large enough that scaling their gradients wrongly moves the losses beyond the tolerance.
MOE = ["--num-layers", "4", "--global-batch-size", "8", "--lr", "1e-2", "--num-experts", "4",
       "--moe-router-topk", "2", "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "24",
       "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01", "--moe-per-layer-logging",
       "--train-iters", "4", "--eval-interval", "4"]
MOE_KEYS = {"load_balancing_loss", "z_loss", "moe_load_imbalance"} | {
    f"{name}_layer_{n}" for n in (1, 3)
    for name in ("load_balancing_loss", "z_loss", "tokens_per_expert", "moe_load_imbalance")}


def test_moe_expert_and_pipeline_parallel_equal_single_process(tmp_path):
    """EP 2 with each dispatcher (allgather with the expert loop; alltoall with grouped GEMM and
    a sigmoid router whose expert bias moves every step by the token counts of all DP ranks)
    PP 2 with MoE layers only on the first stage (3 + 1 layers), and TP 2 with expert-TP 1 under
    torchrun: the losses, grad norms and MoE metrics of every iteration equal the single
    process's (4 micro-batches per step there, under PP and TP, 2 per rank under EP x DP 2)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone", "-m", "teratron"]

    def train(name, extra, launcher=None):
        path = tmp_path / f"{name}.jsonl"
        _teratron(TINY + NO_DROPOUT + MOE + extra + ["--metrics-file", str(path)], tmp_path, launcher)
        records = _metrics(path)
        assert [r["iteration"] for r in records] == [1, 2, 3, 4], name
        for r in records:
            assert set(r) == METRIC_KEYS | MOE_KEYS, (name, set(r) ^ (METRIC_KEYS | MOE_KEYS))
        return records

    softmax = train("single", [])
    assert all(sum(r["tokens_per_expert_layer_1"]) == 8 * 16 * 2 for r in softmax)  # tokens x top-2
    assert softmax[-1]["lm_loss"] < softmax[0]["lm_loss"]
    biased = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
              "--moe-router-bias-update-rate", "0.05"]
    sigmoid = train("single-sigmoid-bias", biased)
    ep2 = ["--expert-model-parallel-size", "2"]
    runs = {
        "ep2-alltoall": (sigmoid, biased + ep2 + ["--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]),
        # The expert loop's linears, like the dense ones, with their weight gradients added into
        # main_grad by the GEMM (expert grad buffers included).
        "ep2-allgather": (softmax, ep2 + ["--moe-token-dispatcher-type", "allgather",
                                          "--gradient-accumulation-fusion"]),
        "pp2-moe-on-one-stage": (softmax, ["--pipeline-model-parallel-size", "2",
                                           "--decoder-first-pipeline-num-layers", "3"]),
        # Whole experts on both TP ranks: their grads go over expert-DP (allreduce=False at EP 1).
        "tp2-etp1": (softmax, ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                               "--gradient-accumulation-fusion"]),
    }
    for name, (reference, extra) in runs.items():
        for a, b in zip(reference, train(name, extra, torchrun)):
            for key in sorted(MOE_KEYS - {"tokens_per_expert_layer_1", "tokens_per_expert_layer_3"}) + [
                    "lm_loss", "grad_norm"]:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (name, key, a[key], b[key])
            for n in (1, 3):
                assert b[f"tokens_per_expert_layer_{n}"] == a[f"tokens_per_expert_layer_{n}"], (name, n)


def _shrunken_example(path, tmp_path, **overrides):
    """An examples/moe YAML with CPU-sized shapes on mock data, everything else as shipped."""
    import yaml

    data = yaml.safe_load(path.read_text())
    for key in ("tokenizer-type", "split", "eval-interval", "eval-iters"):
        data.pop(key)
    data.update({"num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 16,
                 "max-position-embeddings": 16, "moe-ffn-hidden-size": 16, "expert-model-parallel-size": 1,
                 "micro-batch-size": 2, "global-batch-size": 4, "train-iters": 3, "lr-warmup-iters": 1,
                 "log-interval": 1, "mock-data": True, "num-workers": 0, "eval-iters": 0, **overrides})
    out = tmp_path / path.name
    out.write_text(yaml.safe_dump(data))
    return out


def test_shrunken_moe_examples_train(tmp_path):
    """examples/moe/*.yaml shrunk to CPU size (their MoE settings kept, bf16 included) train
    three iterations through --config; the metrics carry each example's MoE losses."""
    import pathlib

    examples = pathlib.Path(__file__).parents[1] / "examples" / "moe"
    cases = {
        "mixtral_like": ({"num-query-groups": 2}, {"load_balancing_loss", "z_loss"}),
        "deepseek_like": ({"moe-layer-freq": [0, 1], "ffn-hidden-size": 64, "moe-shared-expert-intermediate-size": 16},
                          {"seq_load_balancing_loss", "seq_load_balancing_loss_layer_2", "tokens_per_expert_layer_2"}),
    }
    for name, (overrides, keys) in cases.items():
        config = _shrunken_example(examples / f"{name}.yaml", tmp_path, **overrides)
        metrics = tmp_path / f"{name}.jsonl"
        argv = ["train", "--config", str(config), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                "--metrics-file", str(metrics), "--no-progress-bar"]
        assert cli.main(argv) == 0, name
        records = _metrics(metrics)
        assert [r["iteration"] for r in records] == [1, 2, 3], name
        assert all(math.isfinite(r["lm_loss"]) and keys <= set(r) for r in records), (name, records[0])


def test_speed_levers_keep_the_loss_curve(tmp_path):
    """--torch-compile, the fusion flags (gradient accumulation's too) and the reference attention
    path train like the default eager SDPA path (fp32 on CPU: differences are rounding only)."""
    common = TINY + NO_DROPOUT + ["--train-iters", "4", "--eval-iters", "0", "--disable-bias-linear"]
    losses = {}
    for name, flags in {"eager": [], "compiled": ["--torch-compile", "--apply-rope-fusion",
                                                  "--bias-swiglu-fusion", "--bias-dropout-fusion",
                                                  "--gradient-accumulation-fusion"],
                        "reference_attention": ["--attention-backend", "unfused"]}.items():
        metrics = tmp_path / f"{name}.jsonl"
        _teratron(common + flags + ["--metrics-file", str(metrics)], tmp_path)
        losses[name] = [r["lm_loss"] for r in _metrics(metrics)]
    assert len(losses["eager"]) == 4 and losses["eager"][-1] < losses["eager"][0]
    for name in ("compiled", "reference_attention"):
        assert losses[name] == pytest.approx(losses["eager"], rel=1e-5), name


def test_fused_loss_with_gradient_accumulation_fusion_trains_the_output_layer(tmp_path):
    """The fused cross entropy computes the untied output layer's weight gradient itself (not
    through the layer's GEMM): with gradient-accumulation fusion on, DDP must still add it."""
    common = TINY + NO_DROPOUT + ["--train-iters", "4", "--eval-iters", "0", "--untie-embeddings-and-output-weights",
                                  "--cross-entropy-loss-fusion"]
    losses = {}
    for name, flags in {"plain": [], "fused": ["--gradient-accumulation-fusion"]}.items():
        metrics = tmp_path / f"{name}.jsonl"
        _teratron(common + flags + ["--metrics-file", str(metrics)], tmp_path)
        losses[name] = [r["lm_loss"] for r in _metrics(metrics)]
    assert losses["fused"] == pytest.approx(losses["plain"], rel=1e-5)
