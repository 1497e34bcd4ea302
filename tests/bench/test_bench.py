"""`teratron bench`: the CPU smoke run end to end (a real `teratron train` subprocess), and the
parsing and arithmetic around it."""

import json

import pytest

from teratron.bench import cli
from teratron.bench.report import comparison
from teratron.bench.runs import BaselineResult, TrainResult, parse_baseline, run_baseline, summarize, train_command


def test_tiny_cpu_run_end_to_end(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    assert cli.main(["--tiny", "--iters", "2", "--warmup-iters", "1", "--json", "--results-md", str(results)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert sum("iteration" in line and "lm loss" in line for line in out) == 3  # train's own log lines
    report = json.loads(out[-1])
    ours = report["teratron"]
    assert ours["iterations"] == 2 and ours["tokens_per_sec"] > 0 and ours["tflops_per_gpu"] > 0
    assert ours["mfu"] is None and ours["mem_peak_gib"] > 0 and ours["lm_loss"] > 0
    assert report["baseline"] is None and report["world_size"] == 1 and report["estimated_peak_gib"] > 0
    entry = results.read_text()
    assert entry.startswith("## ") and "command: `teratron bench --tiny --iters 2" in entry
    assert "commit: " in entry and "| teratron |" in entry and "--metrics-file" not in entry


def test_summarize_times_only_iterations_after_warmup():
    def record(i, tps, skipped=0):
        return {"iteration": i, "lr": 1e-3, "tokens_per_sec": tps, "tflops_per_gpu": tps / 100,
                "mfu": tps / 1000, "mem_peak_gib": i, "lm_loss": 1.0 / i, "skipped": skipped}

    evaluation = {"iteration": 3, "val_lm_loss": 2.0}  # evaluation records carry no rates
    result = summarize([record(1, 1.0), record(2, 100.0), record(3, 300.0), evaluation,
                        record(4, 5.0, skipped=1)], 1)
    # Equal tokens per iteration: 2 iterations in 1/100 + 1/300 time units -> 150 tokens per unit.
    assert result.iterations == 2 and result.tokens_per_sec == pytest.approx(150.0)
    assert result.tflops_per_gpu == pytest.approx(1.5) and result.mfu == pytest.approx(0.15)
    assert result.mem_peak_gib == 4 and result.lm_loss == pytest.approx(1 / 3)
    with pytest.raises(ChildProcessError, match="--iters"):
        summarize([record(1, 1.0)], 1)


def test_parse_baseline_line():
    line = "hf_baseline compile=True tokens/s=48912 TFLOP/s=421.6 MFU=0.426 peak_mem_GiB=46.3\n"
    assert parse_baseline("compiling...\n" + line) == BaselineResult(True, 48912.0, 421.6, 0.426, 46.3)
    with pytest.raises(ChildProcessError):
        parse_baseline("Traceback ...")


def test_missing_baseline_script_names_the_flag_and_the_shipped_copy(tmp_path):
    missing = tmp_path / "hf_baseline.py"
    with pytest.raises(FileNotFoundError, match=rf"^--hf-baseline {missing}: no such file; pass the path of the "
                                                r"repository's bench/hf_baseline.py, or pass --skip-baseline$"):
        run_baseline(str(missing), compile=True, micro_batch_size=1, accumulation=1, steps=1)


def test_comparison_ratio_and_estimate_error():
    ours = TrainResult(iterations=10, tokens_per_sec=2 * 60000.0, tflops_per_gpu=517.0, mfu=0.523,
                       mem_peak_gib=50.0, lm_loss=10.0)
    base = BaselineResult(True, 40000.0, 344.8, 0.349, 46.3)
    text = "\n".join(comparison(ours, base, 2, 52.5, on_gpu=True))
    assert "| teratron | 60,000 | 517 | 52.3% | 50.00 |" in text
    assert "1.500x" in text and "52.50 GiB" in text and "+5.0%" in text
    text = "\n".join(comparison(ours, None, 1, None, on_gpu=True))  # a run the estimate does not model
    assert "`teratron estimate` does not model this run; measured peak allocated: 50.00 GiB" in text


def test_flags_the_harness_owns_and_gpu_only_baseline(monkeypatch):
    with pytest.raises(ValueError, match="--iters"):
        cli.parse_args(["--train-iters", "5"])
    with pytest.raises(ValueError, match="--metrics-file"):
        cli.parse_args(["--metrics-file=x.jsonl"])
    args = cli.parse_args(["--tensor-model-parallel-size", "2", "--nproc-per-node", "2"])
    assert args.train_flags == ["--tensor-model-parallel-size", "2"] and args.nproc_per_node == 2
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="--skip-baseline"):
        cli.run(cli.parse_args([]))
    assert train_command(["--bf16"], 2)[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert train_command(["--bf16"], 1)[1:4] == ["-m", "teratron", "train"]
    assert train_command(["--use-torch-fsdp2"], 1)[1:4] == ["-m", "torch.distributed.run", "--standalone"]


def test_commit_comes_from_the_environment_on_a_copy_without_git(monkeypatch):
    from teratron.bench.report import git_commit

    monkeypatch.setenv("TERATRON_COMMIT", "abc1234 (sent from the host)")
    assert git_commit() == "abc1234 (sent from the host)"
