"""bench/inference.py: the CPU smoke run of all four workloads (--tiny, a few seconds), and the
arithmetic and parsing around them (rooflines, Poisson arrivals, shared prefixes, latencies, the
Hugging Face anchor's lines)."""

import importlib.util
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
_spec = importlib.util.spec_from_file_location("bench_inference", BENCH / "inference.py")
inference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(inference)

# The lines bench/hf_generate.py prints, in its exact format.
HF_LOG = """compiling
RESULT hf batch-1 decode static+compile: 270 tok/s (incl. prefill); HBM roofline 1668 tok/s; ratio 0.16
RESULT hf static batched B=64: 9200 output tok/s (128 requests 512/256, 3.6 s)
RESULT hf continuous batching generate_batch: 660 output tok/s (49.6 s)
"""


def _number(pattern, text):
    return float(re.search(pattern, text).group(1))


def test_tiny_cpu_run_of_every_workload(tmp_path, capsys):
    hf_log, results = tmp_path / "hf.log", tmp_path / "RESULTS.md"
    hf_log.write_text(HF_LOG)
    assert inference.main(["--tiny", "--hf-results", str(hf_log), "--results-md", str(results)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    offline, batch1, poisson, prefix = lines[:4]

    assert offline.startswith("RESULT teratron offline throughput: ") and "(8 requests 16/8," in offline
    assert "HBM roofline at batch 4 (weights + KV)" in offline  # --max-requests 4 of 8 requests
    assert batch1.startswith("RESULT teratron batch-1 decode: ") and "median of 2" in batch1
    driver = "async engine" if importlib.util.find_spec("teratron.inference.async_engine") else "engine step loop"
    assert f"(6 requests 16/8, {driver})" in poisson
    assert _number(r"TTFT p50 ([\d.]+)", poisson) <= _number(r"TTFT p50 [\d.]+ ms p99 ([\d.]+)", poisson)
    assert _number(r"TPOT p50 ([\d.]+)", poisson) <= _number(r"TPOT p50 [\d.]+ ms p99 ([\d.]+)", poisson)
    # Without caching each request computes its 16 prompt tokens and 3 of its 4 outputs (the last
    # is never fed back). With it, a request that finds the 14-token prefix cached skips its 3 full
    # blocks of 4; at least the first computes everything.
    plain = _number(r"without prefix caching .*?(\d+) tokens computed", prefix)
    cached = _number(r"with [\d.]+ s .*?(\d+) tokens computed", prefix)
    assert plain == 8 * (16 + 4 - 1) and plain - 7 * 12 <= cached < plain

    assert "RESULT ratio teratron offline throughput / hf static batched B=64: " in out
    assert "(target >= 3x)" in out and "(target >= 10x)" in out
    entry = results.read_text()
    assert entry.startswith("## ") and "- command: `PYTHONPATH=. python bench/inference.py --tiny" in entry
    assert "- commit: " in entry and "- model: tiny" in entry and "- engine: max_requests 4" in entry
    assert "| teratron offline throughput | " in entry and "| hf static batched B=64 | 9200 tok/s |" in entry


def test_poisson_through_the_step_loop_without_the_async_engine(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "teratron.inference.async_engine", None)  # import fails
    assert inference.main(["--tiny", "--workloads", "c", "--poisson-requests", "3"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "(3 requests 16/8, engine step loop): TTFT p50 " in line


def test_a_failed_workload_is_reported_and_the_next_runs(tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise ValueError("no such thing")

    monkeypatch.setitem(inference.RUNS, "a", broken)
    results = tmp_path / "RESULTS.md"
    assert inference.main(["--tiny", "--workloads", "a,b", "--results-md", str(results)]) == 1
    out = capsys.readouterr().out
    assert "RESULT teratron (a) broken failed: ValueError: no such thing" in out
    assert "RESULT teratron batch-1 decode: " in out and "| teratron (a) broken failed | ValueError" in results.read_text()


def test_sigterm_keeps_what_was_measured(tmp_path, monkeypatch):
    def killed(*args):  # what `timeout` does to a job that runs long
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the workload")

    monkeypatch.setitem(inference.RUNS, "c", killed)
    results = tmp_path / "RESULTS.md"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        inference.main(["--tiny", "--workloads", "b,c,d", "--results-md", str(results)])
    assert exit_info.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) == before
    entry = results.read_text()
    assert "| teratron batch-1 decode | " in entry and "shared prefix" not in entry
    assert "| teratron stopped | SIGTERM (the job's timeout) before the workloads not listed above ended |" in entry


def test_roofline_matches_a_step_by_step_count():
    weights, kv, prompt, output, batch, bandwidth = 2.9e9, 196608, 512, 256, 64, 4.8e12
    # `batch` requests decode together for `output` steps; step j reads the weights once and each
    # request's keys and values of prompt + j tokens.
    total_bytes = sum(weights + batch * (prompt + j) * kv for j in range(output))
    expected = batch * output / (total_bytes / bandwidth)
    assert inference.roofline_tokens_per_s(weights, kv, prompt, output, batch, bandwidth) == pytest.approx(
        expected, rel=1e-12)
    # Weights only at batch 1: one read of the weights per token (issue 19: 2.9 GB at 4.8 TB/s).
    assert inference.roofline_tokens_per_s(2.9e9, 0, prompt, output, 1, bandwidth) == pytest.approx(4.8e12 / 2.9e9)


def test_model_bytes_of_the_tiny_model():
    model = inference.build_model(tiny=True, device=torch.device("cpu"))
    # 2 layers x (K and V) x 4 query groups x 16 channels x 4 bytes (fp32).
    assert inference.kv_bytes_per_token(model) == 2 * 2 * 4 * 16 * 4
    hidden, ffn, vocab = 64, 176, 512
    layer = hidden * 3 * hidden + hidden * hidden + hidden * 2 * ffn + ffn * hidden + 2 * hidden
    assert inference.weight_bytes(model) == 4 * (2 * layer + 2 * vocab * hidden + hidden)


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    times = inference.poisson_arrivals(20000, 10.0, seed=3)
    assert times == inference.poisson_arrivals(20000, 10.0, seed=3) != inference.poisson_arrivals(20000, 10.0, 4)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert min(gaps) > 0
    # Exponential gaps of mean 0.1 s: the mean of 20000 has a standard error of 0.1 / sqrt(20000).
    assert abs(sum(gaps) / len(gaps) - 0.1) < 4 * 0.1 / math.sqrt(20000)


def test_shared_prefix_prompts():
    prompts = inference.shared_prefix_prompts(5, 20, 0.9, 1000, torch.Generator().manual_seed(0))
    assert len(prompts) == 5 and all(len(p) == 20 for p in prompts)
    assert all(p[:18] == prompts[0][:18] for p in prompts)
    assert len({tuple(p[18:]) for p in prompts}) == 5  # 1000^2 draws: a clash would be a bug


def test_request_timing():
    timing = inference.RequestTiming(arrival=10.0)
    for new_tokens, now in [(0, 10.5), (1, 11.0), (1, 11.2), (2, 11.6), (0, 11.7)]:
        timing.record(new_tokens, now)
    assert timing.tokens == 4 and timing.time_to_first_token == pytest.approx(1.0)
    assert timing.time_per_output_token == pytest.approx(0.6 / 3)
    one = inference.RequestTiming(arrival=0.0)
    one.record(1, 2.0)
    assert one.time_to_first_token == 2.0 and math.isnan(one.time_per_output_token)


def test_hf_lines_and_ratios():
    hf = inference.hf_results(HF_LOG)
    assert hf == {"batch-1 decode static+compile": 270.0, "static batched B=64": 9200.0,
                  "continuous batching generate_batch": 660.0}
    ours = ["RESULT teratron offline throughput: 27600 output tok/s (1000 requests 512/256, ...)",
            "RESULT teratron batch-1 decode: 1350 tok/s (incl. prefill), ..."]
    assert inference.anchor_ratios(ours, hf) == [
        "RESULT ratio teratron offline throughput / hf static batched B=64: 3.00x (target >= 3x)",
        "RESULT ratio teratron offline throughput / hf continuous batching generate_batch: 41.82x (target >= 10x)",
        "RESULT ratio teratron batch-1 decode / hf batch-1 decode static+compile: 5.00x"]


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "a,x"], "--workloads 'a,x': give some of a, b, c, d"),
    (["--prefix-fraction", "1"], "--prefix-fraction 1.0: give a fraction in [0, 1)"),
    (["--hf-results", "/nonexistent/hf.log"], "--hf-results /nonexistent/hf.log: no such file"),
])
def test_bad_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        inference.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_tiny_defaults_and_workload_order():
    args = inference.parse_args(["--tiny", "--workloads", "d,b", "--requests", "3"])
    assert args.workloads == ["d", "b"] and args.requests == 3 and args.prompt_tokens == 16
    assert inference.parse_args([]).requests == 1000
