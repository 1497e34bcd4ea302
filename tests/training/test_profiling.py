"""`teratron train --profile`: torch.profiler over iterations [start, end) writes a chrome trace
and a kernel table; bad ranges and missing folders are one-line errors; kernel categories."""

import json
import os
import re

import pytest
import torch

from teratron import cli
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.profiling import OTHER, category_times, kernel_category, timeline_lines
from test_cli import NO_DROPOUT, TINY

RUN = TINY + NO_DROPOUT + ["--train-iters", "3", "--eval-iters", "0"]
PROFILE = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "3"]


BUSY = "device busy (union of kernels)"   # a timeline line, only when the device ran kernels


def _summary(text):
    """{category: (ms, fraction of wall)} from a kernels file's summary lines (and the busy line)."""
    rows = re.findall(r"^(.+?)\s+([\d.]+) ms\s+([\d.]+)% of wall time", text, re.M)
    return {name.strip(): (float(ms), float(pct) / 100) for name, ms, pct in rows}


def _profiled_run(tmp_path, capsys, extra=()):
    folder = tmp_path / "profile"
    assert cli.main(["train"] + RUN + PROFILE + ["--profile-dir", str(folder), *extra]) == 0
    assert f"profile of iterations 2-2 (rank 0): {folder}" in capsys.readouterr().out
    with open(folder / "trace_rank0.json") as f:
        trace = json.load(f)
    return trace, (folder / "kernels_rank0.txt").read_text()


def test_profiled_range_writes_a_trace_and_a_kernel_table(tmp_path, capsys):
    trace, table = _profiled_run(tmp_path, capsys)
    # Host-side events only (on a GPU, annotations are mirrored on the device timeline).
    names = [e.get("name") for e in trace["traceEvents"] if e.get("cat") != "gpu_user_annotation"]
    assert {"aten::mm", "aten::addmm"} & set(names)
    assert names.count("Optimizer.step#AdamW.step") == 1  # iteration 2 only
    assert table.startswith("rank 0, iterations 2-2 (1), wall time ")
    summary = _summary(table)
    summary.pop(BUSY, None)  # CPU ops have no device timeline
    assert set(summary) == {"NCCL", "attention", "GEMM", OTHER}
    assert summary["GEMM"][0] > 0 and summary["attention"][0] > 0 and summary["NCCL"][0] == 0
    rows = [line for line in table.splitlines() if line.strip().startswith("aten::")]
    assert 0 < len(rows) <= 60 and any(r.strip().startswith(("aten::mm ", "aten::addmm ")) for r in rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels need a GPU")
def test_cuda_kernels_are_categorised(tmp_path, capsys):
    _, table = _profiled_run(tmp_path, capsys, ["--bf16"])
    summary = _summary(table)
    busy = summary.pop(BUSY)[1]
    assert "(CUDA kernel time)" in table and summary["GEMM"][0] > 0 and summary["attention"][0] > 0
    kernel_time = sum(fraction for _, fraction in summary.values())
    # Kernels may overlap (NCCL beside compute), so their sum can exceed the busy union, not the wall.
    assert 0 < busy <= min(kernel_time, 1.0) + 1e-3 and kernel_time <= 1.0


def test_kernel_categories():
    assert kernel_category("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "NCCL"
    assert kernel_category("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"  # not GEMM
    assert kernel_category("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_knob_7") == "attention"
    assert kernel_category("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN") == "GEMM"
    assert kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "GEMM"
    assert kernel_category("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16>") == "GEMM"
    assert kernel_category("aten::addmm") == "GEMM"
    assert kernel_category("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor>") == OTHER
    totals = category_times([("ampere_bf16_s16816gemm_bf16_128x64", 7.0), ("flash_bwd", 2.5),
                             ("reduce_kernel", 1.0), ("elementwise_kernel", 0.5)])
    assert totals == {"NCCL": 0.0, "attention": 2.5, "GEMM": 7.0, OTHER: 1.5}


def _check(argv, world_size=1):
    return build_run_config(parse_train_args(RUN + argv), world_size).profiling


def test_profile_flags_are_validated(tmp_path, capsys):
    assert _check(PROFILE + ["--tensorboard-dir", "tb"]).profile_dir == os.path.join("tb", "profile")
    assert _check(["--profile", "--profile-step-start", "2", "--profile-step-end", "3"]).profile_dir is None  # nsys
    assert _check(["--use-pytorch-profiler"]).profile_dir is None  # the range 10-12 is not checked without --profile
    for argv, message in [
        (PROFILE, "--profile needs --profile-dir or --tensorboard-dir"),
        (PROFILE[:2] + ["--profile-step-start", "0", "--profile-step-end", "2", "--profile-dir", "p"],
         "use 1 <= start < end"),
        (PROFILE[:2] + ["--profile-step-start", "3", "--profile-step-end", "3", "--profile-dir", "p"],
         "use 1 <= start < end"),
        (PROFILE[:2] + ["--profile-step-start", "4", "--profile-step-end", "5", "--profile-dir", "p"],
         "after the last iteration"),
        (PROFILE + ["--profile-dir", "p", "--profile-ranks", "0", "2"], "--profile-ranks 2: no such rank"),
    ]:
        assert cli.main(["train"] + RUN + argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("teratron: error: ") and message in err and "\n" not in err
    if not torch.cuda.is_available():
        assert cli.main(["train"] + RUN + ["--profile", "--profile-step-start", "2", "--profile-step-end", "3"]) == 2
        assert "add --use-pytorch-profiler" in capsys.readouterr().err


def test_timeline_busy_hidden_nccl_and_idle_gaps():
    # GEMM 0-10 us, NCCL 5-20 (5 us beside the GEMM), elementwise 30-35 and 36-40, NCCL 50-60 alone.
    kernels = [("ncclDevKernel_ReduceScatter", 5.0, 20.0), ("sm90_xmma_gemm", 0.0, 10.0),
               ("vectorized_elementwise", 30.0, 35.0), ("vectorized_elementwise_b", 36.0, 40.0),
               ("ncclDevKernel_AllGather", 50.0, 60.0)]
    lines = timeline_lines(kernels, wall_us=100.0)
    # busy = 20 + 5 + 4 + 10 = 39 us; NCCL 25 us of which 5 overlap compute -> 20 not hidden.
    assert re.search(r"device busy \(union of kernels\)\s+0\.039 ms\s+39\.0% of wall time", lines[0])
    assert re.search(r"NCCL not hidden by compute\s+0\.020 ms", lines[1])
    gaps = [line.split() for line in lines[3:]]
    # Idle gaps, largest first: 10 us after the reduce-scatter (ends at 20), 10 us before the
    # all-gather (after the elementwise ending at 40), 1 us between the elementwise kernels.
    assert [(g[0], g[2].rstrip(":"), g[3], g[5]) for g in gaps] == [
        ("0.010", "0.040", "vectorized_elementwise_b", "ncclDevKernel_AllGather"),
        ("0.010", "0.020", "ncclDevKernel_ReduceScatter", "vectorized_elementwise"),
        ("0.001", "0.035", "vectorized_elementwise", "vectorized_elementwise_b")]
    assert timeline_lines([], 1.0) == []
