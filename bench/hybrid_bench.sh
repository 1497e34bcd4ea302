#!/usr/bin/env bash
# Issue 24's model-level runs on one H200: a Nemotron-H-like hybrid of about the benchmark model's
# size against the dense benchmark model, at sequence 2,048 and 8,192, in one job.
#
#   OUT=/path/to/logs bash bench/hybrid_bench.sh [2k|8k]    (both lengths without an argument)
#
# The hybrid: "M-M-M*-" x 6 (42 layers: 18 Mamba-2, 18 MLP, 6 attention) at hidden 2,048,
# Mamba-2 state 128, head 64, 8 groups (64 heads), the dense model's MLP (SwiGLU 5,632) and
# attention (16 heads): 1.25 B parameters against the dense model's 1.24 B. Targets: the hybrid
# >= 90 % of the dense model's tokens/s at 2,048 and ahead of it at 8,192. The scan kernels alone:
# `python bench/ssm_bench.py`. Each run appends its entry to $OUT/entry.md (copy into bench/RESULTS.md).
set -euo pipefail
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
LEVERS=(--torch-compile --gradient-accumulation-fusion --iters 10)
HYBRID=(--hybrid-layer-pattern "M-M-M*-M-M-M*-M-M-M*-M-M-M*-M-M-M*-M-M-M*-" --mamba-state-dim 128
        --mamba-head-dim 64 --mamba-num-groups 8)

run() {  # run <name> [flags...]
    local name=$1
    shift
    python -m teratron bench "${LEVERS[@]}" --results-md "$OUT/entry.md" "$@" 2>&1 | tee "$OUT/$name.log"
}

LENGTHS=${1:-2k 8k}
if [[ $LENGTHS == *2k* ]]; then
    run dense-2k                                  # with the HF baseline of the same shape
    run hybrid-2k --skip-baseline "${HYBRID[@]}"
fi
if [[ $LENGTHS == *8k* ]]; then
    LONG=(--skip-baseline --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 8)
    run dense-8k "${LONG[@]}"
    run hybrid-8k "${LONG[@]}" "${HYBRID[@]}"
fi
