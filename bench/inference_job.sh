#!/usr/bin/env bash
# Issue 19's inference benchmark on one GPU: the Hugging Face anchor (bench/hf_generate.py) and
# teratron's engine (bench/inference.py) in one job, on the same GPU, so their ratios mean something.
#
#   TERATRON_COMMIT=<commit> bash bench/inference_job.sh [bench/inference.py flags]
#
# on the GPU machine, from the repository root (the copy sent there has no .git: name the commit).
# Logs go under $OUT (default bench-out): env.txt, hf.log, inference.log, and entry.md, the
# RESULTS.md entry to copy into bench/RESULTS.md. PARTS=hf or PARTS=teratron runs one half;
# HF_TIMEOUT and TERATRON_TIMEOUT (seconds) keep the whole inside one 10-minute device command;
# a part cut short keeps the RESULT lines it printed (and inference.py still writes its entry).
# HF_N and HF_B: the anchor's requests and static batch (issue 19 measured continuous batching on
# 128 requests).
set -uo pipefail
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
PARTS=${PARTS:-hf,teratron}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
status=0

{ nvidia-smi; "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
  transformers.__version__, torch.cuda.get_device_name())"; } >"$OUT/env.txt" 2>&1

if [[ ,$PARTS, == *,hf,* ]]; then
    N=${HF_N:-128} B=${HF_B:-64} timeout "${HF_TIMEOUT:-240}" "$PYTHON" bench/hf_generate.py 2>&1 \
        | tee "$OUT/hf.log" || { status=$?; echo "bench/hf_generate.py failed or timed out (exit $status)"; }
fi

if [[ ,$PARTS, == *,teratron,* ]]; then
    hf=()
    [[ -s $OUT/hf.log ]] && hf=(--hf-results "$OUT/hf.log")
    timeout "${TERATRON_TIMEOUT:-330}" "$PYTHON" bench/inference.py "${hf[@]}" --results-md "$OUT/entry.md" "$@" \
        2>&1 | tee "$OUT/inference.log" || { status=$?; echo "bench/inference.py failed or timed out (exit $status)"; }
fi
exit "$status"
