"""`teratron bench --reference-flags`: a second training run with the reference path's flags and
the two lm-loss curves compared; train's --profile flags pass through the harness."""

import json

import pytest

from teratron.bench import cli
from teratron.bench.report import loss_curve
from teratron.bench.runs import compare_losses

SHORT = ["--tiny", "--iters", "2", "--warmup-iters", "1"]


def _json_report(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_reference_with_the_same_flags_gives_the_same_curve(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    assert cli.main(SHORT + ["--reference-flags", "--attention-backend auto", "--json",
                             "--results-md", str(results)]) == 0
    report = _json_report(capsys)
    ref = report["reference"]
    assert ref["reference_flags"] == "--attention-backend auto" and ref["iterations"] == 3
    assert ref["max_abs_delta"] == 0.0 and ref["mean_abs_delta"] == 0.0
    assert ref["first"][0] == 1 and ref["last"][0] == 3 and ref["first"][1] == ref["first"][2]
    assert ref["last"][1] == report["teratron"]["lm_loss"] and ref["reference"]["tokens_per_sec"] > 0
    entry = results.read_text()
    assert "| teratron reference (`--attention-backend auto`) |" in entry
    assert "over 3 iterations: max |delta| 0.000e+00" in entry and "| iteration | teratron lm loss |" in entry


def test_unfused_attention_reference_and_profile_flags_pass_through(tmp_path, capsys):
    profile = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "3",
               "--profile-dir", str(tmp_path / "prof")]
    assert cli.main(SHORT + profile + ["--reference-flags", "--attention-backend unfused", "--json"]) == 0
    ref = _json_report(capsys)["reference"]
    # The tiny bench trains in bf16: SDPA and the explicit path differ by rounding only.
    assert ref["iterations"] == 3 and 0.0 < ref["max_abs_delta"] < 1e-3
    assert ref["mean_abs_delta"] <= ref["max_abs_delta"]
    # The reference run's trace does not overwrite the measured run's.
    for folder in (tmp_path / "prof", tmp_path / "prof" / "reference"):
        assert {p.name for p in folder.glob("*rank0*")} == {"trace_rank0.json", "kernels_rank0.txt"}


def _records(losses, skipped=()):
    records = [{"iteration": i, "lr": 1e-3, "lm_loss": loss, "tokens_per_sec": 100.0 * i, "tflops_per_gpu": 1.0,
                "mfu": None, "mem_peak_gib": 1.0, "skipped": int(i in skipped)} for i, loss in losses.items()]
    return records + [{"iteration": max(losses), "val_lm_loss": 9.0}]  # evaluation records are not compared


def test_compare_losses_over_the_common_iterations():
    ours = {i: 5.0 - 0.1 * i for i in range(1, 26)}
    ref = {i: v + (0.002 if i % 2 else -0.001) for i, v in ours.items() if i != 25}  # one iteration fewer
    ref[7] = None  # a window of skipped steps logs no loss
    result = compare_losses(_records(ours), _records(ref), "--attention-backend unfused", warmup_iters=2)
    common = [i for i in range(1, 25) if i != 7]
    deltas = [0.002 if i % 2 else 0.001 for i in common]
    assert result.iterations == 23 and result.max_abs_delta == pytest.approx(0.002)
    assert result.mean_abs_delta == pytest.approx(sum(deltas) / len(deltas))
    assert result.first == (1, ours[1], ref[1]) and result.last == (24, ours[24], ref[24])
    assert [row[0] for row in result.curve] == [1, 10, 20, 24]
    # The reference's rates: iterations 3..24 (after warm-up, 7 included), combined by total time.
    timed = [100.0 * i for i in range(3, 25)]
    assert result.reference.tokens_per_sec == pytest.approx(len(timed) / sum(1 / t for t in timed))
    lines = loss_curve(result)
    assert "over 23 iterations: max |delta| 2.000e-03" in lines[1]
    assert lines[-1] == f"| 24 | {ours[24]:.6f} | {ref[24]:.6f} | {ours[24] - ref[24]:+.3e} |"
    with pytest.raises(ChildProcessError, match="common iteration"):
        compare_losses(_records({1: 1.0}), _records({2: 1.0}), "", 0)


def test_reference_flags_are_checked_like_train_flags():
    with pytest.raises(ValueError, match="--train-iters is set by teratron bench"):
        cli.parse_args(["--reference-flags", "--train-iters 5"])
    with pytest.raises(ValueError, match="--reference-flags .*quoted"):
        cli.parse_args(["--reference-flags", "--seed 'x"])
    args = cli.parse_args(["--reference-flags=--no-rope-fusion", "--profile", "--profile-ranks", "0", "1"])
    assert args.reference == ["--no-rope-fusion"] and args.train_flags == ["--profile", "--profile-ranks", "0", "1"]
    assert cli.parse_args([]).reference is None
