"""Issue 20's multi-latent-attention benchmark on one GPU, every model in one job (ratios between
runs of one job are what this measures; absolute numbers drift between jobs):

  dense        the benchmark shape of ARCHITECTURE.md (24 x 2048, 16 heads, SwiGLU FFN 5632)
  mla-moe      the same depth and width with DeepSeek-V2-Lite's attention (MLA: kv_lora_rank 512,
               qk_head_dim 128 + 64 RoPE channels, v_head_dim 128, no query compression, latent
               norms, YaRN) and MoE layers of as many active FFN channels as the dense FFN
               (8 experts of 1408, top-2, one shared expert of 2816: 5632)
  gqa-moe      the same MoE with GQA attention of about MLA's active attention parameters
               (16 heads, 8 query groups, head 128: 12.6 M per layer against MLA's 13.8 M)
  mla-moe-flash  mla-moe with --attention-backend flash (q, k, v padded to 192 channels)

Each runs `teratron bench --json` (tokens/s, TFLOP/s and MFU by Megatron's formulas, over
--iters timed iterations; the dense run with the HF baseline of its shape in the same job) with
iteration 2 (a warm-up one) profiled by torch.profiler; the attention share is the attention kernels' time (flash/cuDNN/efficient SDPA,
forward and backward) over all kernels' time of that iteration, and the attention TFLOP/s divide
the core-attention FLOPs of Megatron's formula (QK^T and PV, causal half, x3 for backward) by that
time, so MLA and GQA compare at equal work.

    TERATRON_COMMIT=<commit> python bench/mla_bench.py [--models mla-moe,gqa-moe] [--iters 10]
        [--results-md bench-out/entry.md] [any `teratron train` flag, e.g. --num-layers 4]

on the GPU machine from the repository root; extra flags go to every model (after its own).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "1408",
       "--moe-shared-expert-intermediate-size", "2816", "--moe-grouped-gemm", "--moe-token-dispatcher-type",
       "alltoall", "--moe-aux-loss-coeff", "1e-3"]
MLA = ["--multi-latent-attention", "--kv-lora-rank", "512", "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64",
       "--v-head-dim", "128", "--qk-layernorm", "--rope-type", "yarn", "--rotary-scaling-factor", "40",
       "--mscale", "0.707", "--mscale-all-dim", "0.707"]
GQA = ["--group-query-attention", "--num-query-groups", "8"]
MODELS = {
    "dense": [],
    "mla-moe": MLA + MOE,
    "gqa-moe": GQA + MOE,
    "mla-moe-flash": MLA + MOE + ["--attention-backend", "flash"],
}
PROFILED_ITERATION = 2


def bench(name: str, flags: list, args, extra: list, profile_dir: str) -> dict:
    """One model's `teratron bench` numbers; the dense model's run includes the HF baseline (the
    same shape in Hugging Face's Llama) unless --skip-baseline."""
    with_baseline = name == "dense" and not args.skip_baseline
    command = [sys.executable, "-m", "teratron", "bench", *([] if with_baseline else ["--skip-baseline"]),
               "--json", "--iters", str(args.iters),
               "--warmup-iters", str(args.warmup_iters), *flags, *extra, "--profile", "--use-pytorch-profiler",
               "--profile-dir", profile_dir, "--profile-step-start", str(PROFILED_ITERATION),
               "--profile-step-end", str(PROFILED_ITERATION + 1)]
    print(f"== {name}: {' '.join(command)}", flush=True)
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
    print(out, flush=True)
    result = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith('{"teratron"')))
    return {**result["teratron"], "estimated_peak_gib": result["estimated_peak_gib"], "baseline": result["baseline"],
            **kernel_times(os.path.join(profile_dir, "kernels_rank0.txt"))}


def kernel_times(path: str) -> dict:
    """Per kernel category the milliseconds of the profiled iteration (`teratron train --profile`)."""
    times = {}
    with open(path) as f:
        for line in f:
            match = re.match(r"(NCCL|attention|GEMM|elementwise/reduction/other)\s+([\d.]+) ms", line)
            if match:
                times[match.group(1)] = float(match.group(2))
    return {"attention_ms": times["attention"], "kernel_ms": sum(times.values())}


def model_numbers(flags: list) -> dict:
    """Total and active (per token) parameters, attention parameters per layer and the
    core-attention FLOPs of one iteration."""
    from teratron.bench.shapes import train_argv
    from teratron.estimate.params import attention_params, moe_params
    from teratron.estimate.report import estimate_from_run, resolve_vocab_size
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import run_config_from_args
    from teratron.transformer.moe import moe_layer_pattern

    args = parse_train_args(train_argv(False, 0, 1, flags, os.devnull))
    run = run_config_from_args(args, 1, resolve_vocab_size(args), cuda=True)
    t, s = run.transformer, run.training.seq_length
    total = estimate_from_run(run, "cuda").model_parameters
    inactive = 0
    if t.num_moe_experts:
        per_expert = sum(moe_params(t)[1]) / t.num_moe_experts  # all experts are local at EP 1
        moe_layers = sum(moe_layer_pattern(t.num_layers, t.moe_layer_freq))
        inactive = per_expert * (t.num_moe_experts - t.moe_router_topk) * moe_layers
    if t.multi_latent_attention:
        core_per_token = 6 * t.num_attention_heads * (t.qk_head_dim + t.qk_pos_emb_head_dim + t.v_head_dim) / 2 * s
    else:
        core_per_token = 6 * t.num_attention_heads * t.kv_channels * s
    tokens = run.training.global_batch_size * s
    return {"params_b": total / 1e9, "active_b": (total - inactive) / 1e9,
            "attention_params_m": sum(attention_params(t)) / 1e6,
            "core_attention_tflop": core_per_token * tokens * t.num_layers / 1e12}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="Comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup-iters", type=int, default=3)
    parser.add_argument("--results-md", default=None, help="Append the markdown entry here.")
    parser.add_argument("--skip-baseline", action="store_true", help="No HF baseline run with the dense model.")
    args, extra = parser.parse_known_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mla-bench-") as tmp:
        for name in names:
            measured = bench(name, MODELS[name], args, extra, os.path.join(tmp, name))
            print(f"RESULT {name}: attention {measured['attention_ms']:.1f} ms of {measured['kernel_ms']:.1f} ms "
                  f"kernel time ({measured['attention_ms'] / measured['kernel_ms']:.1%})", flush=True)
            rows.append((name, {**measured, **model_numbers(MODELS[name] + extra)}))
    lines = ["| model | params B (active) | attention params M/layer | tokens/s | TFLOP/s | MFU | peak GiB "
             "| attention ms (share of kernel time) | attention TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        attention_tflops = r["core_attention_tflop"] / (r["attention_ms"] / 1e3)
        lines.append(f"| {name} | {r['params_b']:.2f} ({r['active_b']:.2f}) | "
                     f"{r['attention_params_m']:.1f} | "
                     f"{r['tokens_per_sec']:,.0f} | {r['tflops_per_gpu']:.0f} | {mfu} | {r['mem_peak_gib']:.1f} | "
                     f"{r['attention_ms']:.1f} ({r['attention_ms'] / r['kernel_ms']:.1%}) | {attention_tflops:.0f} |")
        if r["baseline"]:
            b = r["baseline"]
            lines.append(f"| HF Llama ({name} shape, SDPA, torch.compile) | | | {b['tokens_per_sec']:,.0f} | "
                         f"{b['tflops']:.0f} | {b['mfu']:.1%} | {b['peak_mem_gib']:.1f} | | |")
    shares = {name: r["attention_ms"] / r["kernel_ms"] for name, r in rows}
    if "mla-moe" in shares and "gqa-moe" in shares:
        lines += ["", f"MLA / GQA attention share: {shares['mla-moe'] / shares['gqa-moe']:.2f}x"]
    table = "\n".join(lines)
    print(table)
    if args.results_md:
        import torch

        from teratron.bench.report import git_commit

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        with open(args.results_md, "a") as f:
            f.write(f"\n## MLA benchmark ({device}, commit {git_commit()})\n\n"
                    f"`python bench/mla_bench.py {' '.join(sys.argv[1:])}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
