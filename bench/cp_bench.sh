#!/usr/bin/env bash
# Issue 21's performance runs: long sequences on one H200 with the CP code paths in place (CP 1),
# packed documents against padded / dense-mask batches, and CP 2 on two H200s with a profile of
# the p2p ring.
#
#   OUT=/path/to/logs bash bench/cp_bench.sh one-gpu     # nvidia-h200
#   OUT=/path/to/logs bash bench/cp_bench.sh two-gpus    # nvidia-h200-x2
#
# Each `teratron bench` run appends its entry to $OUT/entry.md (copy them into bench/RESULTS.md);
# logs and the CP 2 profile go to $OUT. The reference (one H200, --torch-compile
# --gradient-accumulation-fusion, 65 k tokens per step, before CP existed): sequence 8 k 49.4 k
# tokens/s, 16 k 40.2 k, 32 k 29.1 k at 82.7 GiB, all 52 % MFU. Targets: the same numbers at CP 1;
# CP 2 at 32 k and 64 k >= 0.90 of the one-GPU per-token speed at the same tokens per GPU (65 k per
# GPU per step), the ring's transfers hidden under the attention (profile).
set -euo pipefail
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
LEVERS=(--skip-baseline --torch-compile --gradient-accumulation-fusion --micro-batch-size 1 --iters 10)

long() {  # long <name> <seq> <global batch> [flags...]: the benchmark model at one sequence length
    local name=$1 seq=$2 gbs=$3
    shift 3
    python -m teratron bench "${LEVERS[@]}" --seq-length "$seq" --max-position-embeddings "$seq" \
        --global-batch-size "$gbs" --results-md "$OUT/entry.md" "$@" 2>&1 | tee "$OUT/$name.log"
}

case "${1:-}" in
  one-gpu)
    long seq8k 8192 8
    long seq16k 16384 4
    long seq32k 32768 2
    # The same 32 k with the CP module in the loop for packed documents (--reset-attention-mask on
    # mock data: documents of 1..4095 tokens, FlexAttention document masks).
    long seq32k-documents 32768 2 --reset-attention-mask --reset-position-ids --eod-mask-loss
    # Packed THD documents of mixed lengths against padded batches and packed rows with a dense
    # s x s mask: real tokens per second of the model's forward + backward.
    python bench/packed_sequences_bench.py 2>&1 | tee "$OUT/packed.log"
    ;;
  two-gpus)
    # 65 k tokens per GPU per step: global batch 4 at 32 k, 2 at 64 k over 2 GPUs.
    long cp2-seq32k 32768 4 --nproc-per-node 2 --context-parallel-size 2 --use-distributed-optimizer
    long cp2-seq64k 65536 2 --nproc-per-node 2 --context-parallel-size 2 --use-distributed-optimizer
    long cp2-seq32k-a2a 32768 4 --nproc-per-node 2 --context-parallel-size 2 --cp-comm-type a2a \
        --use-distributed-optimizer
    # One GPU at 32 k in the same job: the per-token speed the CP 2 runs are compared with.
    long seq32k-same-job 32768 2
    # A trace of the ring: iterations 6-7 of CP 2 at 32 k (the send/recv kernels on NCCL's stream
    # should overlap the flash kernels).
    long cp2-seq32k-profile 32768 4 --nproc-per-node 2 --context-parallel-size 2 --use-distributed-optimizer \
        --profile --use-pytorch-profiler --profile-step-start 6 --profile-step-end 8 --profile-dir "$OUT/profile"
    ;;
  *)
    echo "usage: OUT=DIR bash bench/cp_bench.sh one-gpu|two-gpus" >&2
    exit 2
    ;;
esac
