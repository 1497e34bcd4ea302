#!/usr/bin/env bash
# Issue 23's performance runs: FSDP against DDP on one H200, and on two H200s FSDP's per-GPU
# speed and a model the distributed optimizer cannot fit.
#
#   OUT=/path/to/logs bash bench/fsdp_bench.sh one-gpu     # nvidia-h200
#   OUT=/path/to/logs bash bench/fsdp_bench.sh two-gpus    # nvidia-h200-x2
#
# Each `teratron bench` run appends its entry to $OUT/entry.md (copy them into bench/RESULTS.md).
# Targets: --data-parallel-sharding-strategy no_shard within 2 % of plain DDP at the benchmark shape
# (one GPU); optim_grads_params at DP 2 >= 0.95 of the one-GPU per-GPU tokens/s; a ~13 B model
# (`teratron estimate`: 149 GiB per GPU with the distributed optimizer, 103 GiB with FSDP) trains.
set -euo pipefail
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
LEVERS=(--torch-compile --iters 10)

run() {  # run <name> [flags...]: the benchmark model
    local name=$1
    shift
    python -m teratron bench "${LEVERS[@]}" --results-md "$OUT/entry.md" "$@" 2>&1 | tee "$OUT/$name.log"
}

# 13 B: 40 x 5120, SwiGLU 13824, 40 heads, sequence 4096, full recompute (the rest: the benchmark shape's).
BIG=(--num-layers 40 --hidden-size 5120 --ffn-hidden-size 13824 --num-attention-heads 40
     --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 16
     --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)

case "${1:-}" in
  one-gpu)
    run ddp --gradient-accumulation-fusion  # with the HF baseline of the same shape
    run no-shard --skip-baseline --use-megatron-fsdp --data-parallel-sharding-strategy no_shard \
        --gradient-accumulation-fusion
    run fsdp2-one-rank --skip-baseline --use-torch-fsdp2  # FSDP2's hooks and casts on a mesh of one
    ;;
  two-gpus)
    run ddp-dp2 --skip-baseline --nproc-per-node 2 --use-distributed-optimizer --overlap-grad-reduce \
        --overlap-param-gather --gradient-accumulation-fusion --global-batch-size 64
    run fsdp2-dp2 --skip-baseline --nproc-per-node 2 --use-torch-fsdp2 --global-batch-size 64
    run fsdp2-dp2-optim-grads --skip-baseline --nproc-per-node 2 --use-megatron-fsdp \
        --data-parallel-sharding-strategy optim_grads --global-batch-size 64
    python -m teratron estimate --world-size 2 --vocab-size 50304 --tokenizer-type NullTokenizer --swiglu \
        --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
        --untie-embeddings-and-output-weights --bf16 --accumulate-allreduce-grads-in-fp32 "${BIG[@]}" \
        --use-distributed-optimizer | tee "$OUT/big-estimate.log"
    run big-fsdp2-dp2 --skip-baseline --iters 4 --nproc-per-node 2 "${BIG[@]}" --use-torch-fsdp2 \
        --init-model-with-meta-device
    ;;
  *)
    echo "usage: OUT=DIR bash bench/fsdp_bench.sh one-gpu|two-gpus" >&2
    exit 2
    ;;
esac
