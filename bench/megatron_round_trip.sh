#!/usr/bin/env bash
# Issue 22's round trip through Megatron-LM itself, on a GPU machine (Megatron-LM's saver and optimizer
# assume CUDA). Megatron-LM's source goes at .megatron-lm (gitignored, 13 MB):
#   git --git-dir=<a clone of NVIDIA/Megatron-LM> archive d98e8a64dd megatron pretrain_gpt.py gpt_builders.py \
#       model_provider.py | tar -x -C .megatron-lm
#   OUT=logs bash bench/megatron_round_trip.sh
# 1. Megatron-LM trains 8 iterations, saving at 4 ($OUT/mlm_iter4.tgz: the fixture
#    tests/dist_checkpointing/fixtures/megatron_lm); 2. Megatron-LM resumes its own iteration 4 (the control);
# 3. teratron resumes Megatron's iteration 4: its losses 5-8 are Megatron's; 4. teratron trains 8 saving
# --ckpt-format torch_dist at 4, and Megatron-LM resumes that: its losses 5-8 should be teratron's.
# Megatron runs through bench/megatron_lm_pretrain.py (two fixes for resuming without Transformer Engine).
# Megatron-LM prints a run's second iteration as the mean of its first two (after a resume: iteration 6 is
# (loss 5 + loss 6) / 2; docs/checkpoints.md). Vocabulary 128, no padding column: Megatron-LM counts
# padding columns in its loss, teratron does not.
ROOT=$PWD
export PYTHONPATH=$ROOT NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=4
OUT=${OUT:-$ROOT/out}; mkdir -p $OUT
ARCH="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
 --ffn-hidden-size 128 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
 --untie-embeddings-and-output-weights --seq-length 64 --max-position-embeddings 64 --hidden-dropout 0
 --attention-dropout 0 --tokenizer-type NullTokenizer --vocab-size 128 --make-vocab-size-divisible-by 128 --bf16"
TRAIN="--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2
 --train-iters 8 --log-interval 1 --eval-iters 0 --eval-interval 1000 --data-path $ROOT/tests/dist_checkpointing/fixtures/megatron_lm/docs --split 100,0,0
 --seed 1234 --use-distributed-optimizer --ckpt-format torch_dist"
MLM="torchrun --nproc-per-node 1 --master-port 29611 $ROOT/bench/megatron_lm_pretrain.py $ARCH $TRAIN --transformer-impl local
 --deterministic-mode --no-rope-fusion --no-gradient-accumulation-fusion --no-masked-softmax-fusion
 --no-bias-swiglu-fusion --no-persist-layer-norm --dist-ckpt-optim-fully-reshardable"
losses() { grep -oE "iteration +[0-9]+/ +8 .*lm loss: [0-9.E+-]+" $1 | sed -E 's/iteration +([0-9]+).*lm loss: /\1 /'; }
# 1. Megatron-LM trains 8 iterations, saving at 4 and 8.
(cd .megatron-lm && PYTHONPATH=. timeout 120 $MLM --save $OUT/mlm --save-interval 4 > $OUT/mlm_train.log 2>&1)
echo "== Megatron-LM"; losses $OUT/mlm_train.log | tr '\n' ' '; grep -E "Error" $OUT/mlm_train.log | tail -3; echo
tar -czf $OUT/mlm_iter4.tgz -C $OUT/mlm iter_0000004
echo 4 > $OUT/mlm/latest_checkpointed_iteration.txt
# 2. Megatron-LM resumes its own iteration 4 (the control: how exactly Megatron continues itself).
(cd .megatron-lm && PYTHONPATH=. timeout 90 $MLM --load $OUT/mlm > $OUT/mlm_resume.log 2>&1)
echo "== Megatron-LM resumes itself"; losses $OUT/mlm_resume.log | tr '\n' ' '; grep -E "Error" $OUT/mlm_resume.log | tail -3; echo
echo 4 > $OUT/mlm/latest_checkpointed_iteration.txt
# 3. teratron continues Megatron-LM's iteration 4 (model, optimizer, scheduler, data position).
timeout 90 python -m teratron train $ARCH $TRAIN --load $OUT/mlm > $OUT/teratron_from_mlm.log 2>&1
echo "== teratron from Megatron-LM"; losses $OUT/teratron_from_mlm.log | tr '\n' ' '; grep -E "error" $OUT/teratron_from_mlm.log | tail -3; echo
# 4. teratron trains 8, saving Megatron's layout at 4; Megatron-LM continues it.
timeout 90 python -m teratron train $ARCH $TRAIN --save $OUT/tt --save-interval 4 > $OUT/teratron_train.log 2>&1
echo "== teratron"; losses $OUT/teratron_train.log | tr '\n' ' '; grep -E "error" $OUT/teratron_train.log | tail -3; echo
echo 4 > $OUT/tt/latest_checkpointed_iteration.txt
(cd .megatron-lm && PYTHONPATH=. timeout 90 $MLM --load $OUT/tt --no-load-rng > $OUT/mlm_from_teratron.log 2>&1)
echo "== Megatron-LM from teratron"; losses $OUT/mlm_from_teratron.log | tr '\n' ' '
grep -E "Error|error:" $OUT/mlm_from_teratron.log | grep -v "^ " | tail -4; echo
rm -rf $OUT/mlm $OUT/tt
