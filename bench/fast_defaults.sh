#!/usr/bin/env bash
# `teratron train` without speed flags against the explicit speed levers and against the eager
# path, with the Hugging Face baseline, in one job on one GPU (issue 17: fast by default).
#
#   OUT=/path/to/logs bash bench/fast_defaults.sh      # on the GPU machine, from the repository root
#
# Each run appends its entry to $OUT/entry.md; copy the entries into bench/RESULTS.md.
set -euo pipefail
export PYTHONPATH=. NCCL_NVLS_ENABLE=0
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
python -m teratron bench --results-md "$OUT/entry.md" 2>&1 | tee "$OUT/defaults.log"
python -m teratron bench --skip-baseline --torch-compile --gradient-accumulation-fusion \
    --results-md "$OUT/entry.md" 2>&1 | tee "$OUT/levers.log"
python -m teratron bench --skip-baseline --no-torch-compile --no-gradient-accumulation-fusion \
    --results-md "$OUT/entry.md" 2>&1 | tee "$OUT/eager.log"
