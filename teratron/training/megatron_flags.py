"""Megatron-LM `pretrain_gpt.py` flags that `teratron train` does not implement as flags of its
own: the one table of what happens to each.

Every flag of Megatron-LM's argument parser is, in `teratron train`, one of:

- honoured: a flag of teratron's own parser (training/arguments.py) with Megatron's meaning;
- accepted: a kernel, library or implementation choice that teratron makes its own way (or a
  logging, tuning or inference knob that changes nothing teratron trains or saves). The run
  goes on; at start-up rank 0 prints one line per accepted flag saying what teratron does
  instead (`startup_notes`);
- refused: a feature teratron does not have. `check` raises one line,
  `--foo: <feature> is not supported by teratron; <what to do>`.

`ACCEPTED` and `REFUSED` list flags by what they share (a note, or a missing feature and what to
do). `BY_VALUE` classifies valued flags whose values differ: a value it lists is accepted (a
note) or refused (a `Refused`); other values are refused with the flag's `Refused` fallback.
Flag specs: `--flag` is a switch, `--flag=` takes one value, `--flag=+` one or more, `--flag=*`
any number; `--a|--b` are spellings of one flag. tests/training/megatron_flags.json lists
Megatron's parser (and the commit it was read from); tests/training/test_megatron_flags.py walks
it through teratron's parser.
"""

import argparse
from typing import NamedTuple


class Refused(NamedTuple):
    feature: str
    fix: str = "drop the flag"


_TE = "teratron builds its own layers (no Transformer Engine), so this Transformer Engine setting has nothing to set"
_INFERENCE = ("an inference-engine setting; teratron train does not run inference (teratron generate/serve have their "
              "own flags)")
_TP_OVERLAP_KNOB = "tunes --tp-comm-overlap, which teratron does not have; TP collectives run after their GEMMs"
_DIST_CKPT_KNOB = ("tunes Megatron's torch_dist save/load strategies; teratron saves and loads each rank's shards "
                   "with torch.distributed.checkpoint")
_ASYNC_SAVE_KNOB = "tunes Megatron's async checkpoint workers; teratron's --async-save writes on a background thread"
_NO_TIMERS = "teratron has no per-phase timers; the log line and --metrics-file carry the step time and throughput"
_TENSORBOARD = ("teratron's TensorBoard scalars are fixed: every --log-interval the metrics-file values "
                "(loss, lr, grad norm, throughput, peak memory, loss scale), and validation loss and perplexity")

# note -> flags accepted with it
ACCEPTED = {
    "read only by the CuTeDSL Gated Delta Product kernel (--gdp-cutedsl-kernel), which teratron does not have; "
    "its own rule kernels keep every chunk's state": "--gdp-num-chunk-states-to-recompute=",
    "teratron's Mamba layers have one path (the chunked scan with its own kernels); there is no separate "
    "memory-efficient path to switch off": "--disable-mamba-mem-eff-path",
    "the attention softmax runs inside SDPA/FlexAttention (--attention-backend picks the kernel); there is no "
    "separate masked-softmax kernel to turn off": "--no-masked-softmax-fusion",
    "teratron has no persistent LayerNorm kernel; norms are torch ops (fused by --torch-compile)":
        "--no-persist-layer-norm",
    "norms and residual adds are torch ops, fused by --torch-compile": "--fused-residual-rmsnorm",
    "teratron fuses bias + activation only with --bias-swiglu-fusion (off by default; --torch-compile fuses it "
    "anyway)": "--no-bias-gelu-fusion",
    "attention runs in SDPA, which takes its flash kernel where it can (--attention-backend flash insists on it)":
        "--use-flash-attn --flash-attention-version=",
    "teratron's models are Megatron Core's (Megatron ignores this deprecated flag too)": "--use-mcore-models",
    "teratron's TP all-reduce is not asynchronous (Megatron-LM releases before 0.8 spelled this flag); nothing "
    "to turn off": "--no-async-tensor-model-parallel-allreduce",
    _TE: "--use-transformer-engine-op-fuser --use-te-activation-func --ckpt-drop-redundant-extra-state",
    "teratron's RNG tracker (teratron.tensor_parallel.random) serves every layer; the random streams are "
    "teratron's own": "--te-rng-tracker",
    _TP_OVERLAP_KNOB: "--no-tp-comm-bulk-wgrad|--disable-tp-comm-bulk-wgrad "
                      "--no-tp-comm-bulk-dgrad|--disable-tp-comm-bulk-dgrad "
                      "--no-tp-comm-overlap-ag|--disable-tp-comm-overlap-ag "
                      "--no-tp-comm-overlap-rs|--disable-tp-comm-overlap-rs "
                      "--no-tp-comm-split-ag|--disable-tp-comm-split-ag "
                      "--no-tp-comm-split-rs|--disable-tp-comm-split-rs --tp-comm-bootstrap-backend= "
                      "--tp-comm-overlap-cfg=",
    "pipeline stages exchange tensors with torch.distributed's batched isend/irecv (no ring-exchange kernel)":
        "--use-ring-exchange-p2p",
    "teratron's pipeline p2p is batched and not overlapped with compute by default, which is what this flag asks":
        "--no-overlap-p2p-communication",
    "teratron's collectives run on PyTorch's default communication streams": "--high-priority-a2a-comm-stream "
                                                                             "--high-priority-stream-groups=+",
    "a grouped-GEMM kernel choice; teratron runs dense and shared-expert MLPs as plain linear layers":
        "--use-grouped-gemm-for-shared-expert --use-grouped-gemm-for-dense-mlp",
    "teratron stores and computes the experts its own way (--moe-grouped-gemm stacks them)":
        "--moe-use-grouped-tensor --moe-single-grouped-weight --moe-single-grouped-bias",
    "token permutation and routing are torch ops in teratron (no fused kernels to choose)":
        "--moe-permute-fusion --moe-router-fusion",
    "teratron's MLA down-projections are plain linear layers (no fused kernel to choose)": "--mla-down-proj-fusion",
    "teratron's embedding does not clone the sequence-parallel scattered output (what this flag asks)":
        "--no-clone-scatter-output-in-embedding|--disable-clone-scatter-output-in-embedding",
    "a workaround of Megatron's legacy ONNX export; teratron's layers need none": "--onnx-safe=",
    "teratron's --batch-invariant-mode runs every GEMM in fixed-shape row tiles of the device's own GEMM (no "
    "separate kernel library to choose)": "--batch-invariant-backend=",
    "teratron's Newton-Schulz iterations use plain matmuls": "--muon-use-syrk",
    _INFERENCE: "--cache-mla-latents --moe-pad-experts-for-cuda-graph-inference --inference-cuda-graph-scope= "
                "--flash-decode --symmetric-ar-type= --nccl-all-reduce-for-prefill --inference-fuse-tp-communication "
                "--inference-disable-triton-nvls-kernels --inference-grouped-gemm-backend= "
                "--inference-moe-disable-fused-quant-kernels --inference-moe-token-dispatcher-type= "
                "--mlp-chunks-for-prefill= --inference-rng-tracker --inference-batch-times-seqlen-threshold= "
                "--max-tokens-to-oom= --use-legacy-static-engine --inference-max-requests= "
                "--inference-max-seq-length= --inference-dynamic-batching "
                "--inference-dynamic-batching-buffer-size-gb= --inference-dynamic-batching-paused-buffer-size-gb= "
                "--inference-dynamic-batching-mamba-memory-ratio= --inference-dynamic-batching-block-size= "
                "--inference-dynamic-batching-max-requests= --inference-dynamic-batching-max-tokens= "
                "--inference-dynamic-batching-num-cuda-graphs= "
                "--inference-dynamic-batching-track-paused-request-events "
                "--inference-dynamic-batching-track-generated-token-events --decode-only-cuda-graphs "
                "--inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens= "
                "--inference-dynamic-batching-unified-memory-level= --enable-chunked-prefill "
                "--num-speculative-tokens= "
                "--inference-dynamic-batching-prefix-caching|--no-inference-dynamic-batching-prefix-caching "
                "--inference-dynamic-batching-prefix-caching-eviction-policy= "
                "--inference-dynamic-batching-prefix-caching-coordinator-policy= "
                "--inference-dynamic-batching-prefix-caching-routing-alpha= "
                "--inference-dynamic-batching-prefix-caching-mamba-gb= "
                "--inference-dynamic-batching-cuda-graph-mixed-prefill-count= "
                "--inference-dynamic-batching-cuda-graph-sizing-distribution= "
                "--inference-dynamic-batching-sampling-backend= --use-same-sampling-seed-across-dp-ranks "
                "--inference-dynamic-batching-async-sched-mode= --inference-dynamic-batching-logprobs-mode= "
                "--inference-logging-step-interval= "
                "--inference-text-gen-server-logging|--no-inference-text-gen-server-logging "
                "--inference-wandb-logging|--no-inference-wandb-logging --inference-coordinator-port= "
                "--mamba-inference-conv-states-dtype= --mamba-inference-ssm-states-dtype= "
                "--inference-use-synchronous-zmq-collectives|--no-inference-use-synchronous-zmq-collectives "
                "--inference-disable-ep-consensus|--no-inference-disable-ep-consensus --inference-shards=",
    # profiling and logging
    "teratron's nsys mode (--profile) emits NVTX ranges for every op; it adds no ranges of its own":
        "--nvtx-ranges",
    "teratron's --use-pytorch-profiler always records shapes": "--pytorch-profiler-collect-shapes --record-shapes",
    "teratron's --use-pytorch-profiler records no call stacks or Chakra traces (a chrome trace and a kernel table)":
        "--pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra",
    "teratron records no CUDA memory history; the log line has the peak memory, --use-pytorch-profiler the "
    "kernels": "--record-memory-history --memory-snapshot-path=",
    "teratron logs tokens/s, TFLOP/s and MFU on every log line": "--log-throughput",
    "teratron writes no progress.txt; --metrics-file records every logged iteration": "--log-progress",
    "teratron does not log the parameter norm": "--log-params-norm",
    "teratron does not log the count of zero gradients": "--log-num-zeros-in-grad",
    _NO_TIMERS: "--timing-log-level= --timing-log-option= --no-barrier-with-level-1-timing --log-energy",
    _TENSORBOARD: "--tensorboard-log-interval= --tensorboard-queue-size= --log-timers-to-tensorboard "
                  "--no-log-loss-scale-to-tensorboard|--disable-log-loss-scale-to-tensorboard "
                  "--log-validation-ppl-to-tensorboard --log-memory-to-tensorboard --log-world-size-to-tensorboard",
    "teratron logs the peak memory (mem_peak_gib) on every log line": "--log-memory-interval= "
                                                                     "--log-device-memory-used",
    "teratron prints at its own level (errors as one line, notes, the log line)": "--logging-level=",
    "teratron's --log-straggler report has no run-time controller: it is on for the whole run":
        "--straggler-ctrlr-port=",
    "teratron reports to no one-logger (NVIDIA telemetry)": "--no-one-logger --one-logger-project= "
                                                            "--one-logger-run-name= --one-logger-async "
                                                            "--app-tag-run-name= --app-tag-run-version=",
    # training loop
    "teratron does not empty the CUDA cache between steps": "--empty-unused-memory-level=",
    "teratron synchronises with the device once per step (the loss)": "--train-sync-interval=",
    "teratron leaves Python's garbage collector automatic": "--manual-gc --manual-gc-interval= "
                                                            "--no-manual-gc-eval|--disable-manual-gc-eval",
    "teratron's data loader workers need no signal handler; the main process handles SIGTERM "
    "(--exit-signal-handler saves first)": "--exit-signal-handler-for-dataloader --exit-signal-handler-for-training",
    "teratron's --optimizer-cpu-offload steps torch's own optimizer on the host":
        "--use-torch-optimizer-for-cpu-offload",
    "teratron's CPU offload always copies gradients through a pinned host buffer": "--no-pin-cpu-grads",
    # data
    "teratron's data loader makes no attention-mask tensor (causal attention needs none)":
        "--no-create-attention-mask-in-dataloader",
    "dataset indices are built and cached by teratron's own builder": "--dataloader-fast-cache-load "
                                                                      "--dataloader-defer-npy-index-mmap "
                                                                      "--num-dataset-builder-threads=",
    # tokenizer
    "teratron's HuggingFaceTokenizer leaves special tokens out unless --tokenizer-hf-include-special-tokens":
        "--tokenizer-hf-no-include-special-tokens",
    "teratron reads tokenizer.json with the tokenizers library (the fast tokenizer) and runs no remote code":
        "--tokenizer-hf-no-use-fast --trust-remote-code",
    "teratron never takes the tokenizer from the checkpoint's args: the tokenizer flags give it (and a resume "
    "checks it against the checkpoint)":
        "--no-use-tokenizer-model-from-checkpoint-args|--disable-use-tokenizer-model-from-checkpoint-args",
    "teratron saves no tokenizer files, only the tokenizer's fingerprint (checked on resume)":
        "--no-save-tokenizer-assets|--disable-save-tokenizer-assets",
    # checkpoints
    "teratron loads its own checkpoint layout (the one it writes)": "--auto-detect-ckpt-format",
    "teratron's checkpoints are sharded (torch.distributed.checkpoint); Megatron ignores this deprecated flag too":
        "--use-dist-ckpt --dist-ckpt-format=",
    "every rank writes its own shards already (Megatron ignores this deprecated flag too)":
        "--ckpt-fully-parallel-save",
    "every rank writes its own shards; teratron has no single-writer save to fall back to":
        "--no-ckpt-fully-parallel-save",
    "every rank reads its own shards already": "--ckpt-fully-parallel-load",
    _DIST_CKPT_KNOB: "--ckpt-fully-parallel-load-exchange-algo= --ckpt-fully-parallel-load-per-rank-objects "
                     "--ckpt-fully-parallel-save-process-group= --ckpt-fully-parallel-load-process-group= "
                     "--ckpt-assume-constant-structure --ckpt-pg-tensors-cache-path= "
                     "--ckpt-pg-tensors-cache-create "
                     "--no-ckpt-load-validate-sharding-integrity|--disable-ckpt-load-validate-sharding-integrity "
                     "--no-strict-fsdp-dtensor-load|--disable-strict-fsdp-dtensor-load",
    _ASYNC_SAVE_KNOB: "--async-strategy= --use-persistent-ckpt-worker --async-ckpt-cpu-priority= "
                      "--async-ckpt-io-priority= --async-ckpt-use-cpu-shm --dist-ckpt-workers=",
    "teratron's loads are strict: a missing or unexpected key, or another shape, stops the load with one line":
        "--dist-ckpt-strictness=",
    "teratron's optimizer state always reshards on load (any TP/PP/DP layout, with or without the distributed "
    "optimizer)": "--dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient",
    # distributed
    "torchrun passes LOCAL_RANK in the environment, which teratron reads": "--local-rank=",
    "teratron builds its process groups with NCCL's defaults (set NCCL_* environment variables to tune them)":
        "--nccl-communicator-config-path= --use-sharp --sharp-enabled-group= --use-nccl-ub "
        "--disable-symmetric-registration --create-all-gather-group",
    "teratron creates no gloo groups besides the default group's backend": "--disable-gloo-process-groups",
    "teratron keeps --distributed-timeout-minutes for the whole run": "--distributed-timeout-seconds-after-init=",
    "NCCL's flight recorder is PyTorch's: set TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DUMP_ON_TIMEOUT":
        "--flight-recorder-dump-path= --flight-recorder-trace-buffer-size= "
        "--no-flight-recorder-dump-on-timeout|--disable-flight-recorder-dump-on-timeout "
        "--flight-recorder-include-stack-trace "
        "--no-flight-recorder-include-only-active|--disable-flight-recorder-include-only-active "
        "--no-flight-recorder-extra-dump-on-exec|--disable-flight-recorder-extra-dump-on-exec",
    "teratron has no TorchScript fusers; fusion is --torch-compile's": "--disable-jit-fuser",
    "teratron reduces gradients in the params dtype (bf16) unless --accumulate-allreduce-grads-in-fp32, which is "
    "what this flag asks": "--grad-reduce-in-bf16",
    "teratron's gradient reduction launches bucket by bucket on each stage": "--no-align-grad-reduce|"
                                                                            "--disable-align-grad-reduce",
    "teratron's parameter all-gather is dispatched per bucket as the forward reaches it": "--no-align-param-gather",
    "teratron sizes gradient buckets with --ddp-bucket-size": "--ddp-num-buckets=",
    "teratron scales gradients once per step (or inside the collective with --ddp-average-in-collective)":
        "--no-gradient-reduce-div-fusion",
    "teratron has no experimental switch; every feature it has is on its own flag": "--enable-experimental",
    "teratron reads paths from the local file system only (no multi-storage client)": "--disable-msc",
}

# (missing feature, what to do) -> flags refused with it
REFUSED = {
    Refused("generalized tensor parallelism (weight shards, rematerialisation)"):
        "--tensor-parallel-num-weight-shards= --expert-tensor-parallel-num-weight-shards= --gtp-remat-opt-in-modules=+ "
        "--gtp-remat-reduce-scatter-with-fp32-accumulation --gtp-remat-nccl-ub --gtp-expert-remat-nccl-ub",
    Refused("hybrid context parallelism", "use --context-parallel-size"):
        "--max-seqlen-per-dp-cp-rank= --hybrid-context-parallel",
    Refused("TP communication/GEMM overlap (Transformer Engine userbuffers)",
            "drop it; TP collectives run after their GEMMs"): "--tp-comm-overlap --tp-comm-overlap-rs-dgrad",
    Refused("overlapping the expert-parallel all-to-all with other micro-batches (and the delayed weight "
            "gradients it needs)"):
        "--overlap-moe-expert-parallel-comm --delay-wgrad-compute --overlap-dispatch-backward-with-experts-wgrad "
        "--ep-overlap-early-attn-memory-release",
    Refused("deferring the output layer's weight-gradient GEMMs to the pipeline flush"):
        "--defer-embedding-wgrad-compute --wgrad-deferral-limit=",
    Refused("p2p overlap in the pipeline warm-up and flush"): "--overlap-p2p-communication-warmup-flush",
    Refused("a standalone MTP stage flag", "place the MTP layers with --pipeline-model-parallel-layout (m)"):
        "--mtp-standalone",
    Refused("an MTP variant beyond Megatron's standard MTP (repeated layer, detached heads, HSM, hybrid pattern)"):
        "--mtp-use-repeated-layer --mtp-detach-heads --mtp-hsm --mtp-hybrid-override-pattern=",
    Refused("CPU offloading of whole layers", "use --fine-grained-activation-offloading with --offload-modules"):
        "--cpu-offloading-num-layers= --cpu-offloading-retain-pinned-cpu-buffers",
    Refused("tuning of Megatron's activation offloading (partial, delayed or bounded offloads)",
            "use --fine-grained-activation-offloading with --offload-modules and --min-offloaded-tensor-size"):
        "--delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks= --activation-offload-fraction= "
        "--fine-grained-offloading-max-inflight-offloads=",
    Refused("the paged MoE activation stash"): "--moe-paged-stash --moe-paged-stash-page-size= "
                                               "--moe-paged-stash-buffer-size-factor-cuda= "
                                               "--moe-paged-stash-buffer-size-factor-cpu=",
    Refused("L2-normalised queries and keys", "use --qk-layernorm for normalised queries and keys"): "--qk-l2-norm",
    Refused("an experimental attention variant in a GPT model (DeepSeek sparse attention, linear attention "
            "layers); Gated DeltaNet layers come through --hybrid-layer-pattern (G)"):
        "--experimental-attention-variant= --dsa-indexer-n-heads= --dsa-indexer-head-dim= --dsa-indexer-topk= "
        "--dsa-indexer-topk-freq= --dsa-indexer-skip-topk-offset= --dsa-indexer-loss-coeff= "
        "--dsa-indexer-use-sparse-loss --dsa-kernel-backend= --dsa-indexer-rope-interleaved "
        "--no-dsa-indexer-rotate-activation|--disable-dsa-indexer-rotate-activation "
        "--no-dsa-indexer-scoring-relu|--disable-dsa-indexer-scoring-relu --dsa-indexer-k-norm-epsilon= "
        "--dsa-indexer-k-norm-fp32 --linear-attention-freq=",
    Refused("muP (maximal update parametrisation)"):
        "--use-mup --mup-width-mult= --mup-base-hidden-size= --mup-embedding-mult= --mup-output-mult= "
        "--mup-base-head-dim= --mup-attn-scale-power=",
    Refused("turning off bf16 reduced-precision matmul reductions"): "--disable-bf16-reduced-precision-matmul",
    Refused("the weighted squared ReLU activation"): "--use-fused-weighted-squared-relu",
    Refused("distributing recomputed layers' saved inputs over TP"): "--distribute-saved-activations",
    Refused("a custom FP8 quantizer or an MXFP8 output projection"): "--fp8-quantizer-factory= --fp8-output-proj",
    Refused("keeping the parameters in FP8 (gathered in FP8)", "drop it; --fp8-format keeps bf16 weights"):
        "--fp8-param-gather",
    Refused("per-module precision configs of Transformer Engine"): "--te-precision-config-file=",
    Refused("the kitchen quantization extension"): "--use-kitchen-attention --kitchen-attention-backend=",
    Refused("FP4 training"): "--fp4-format= --fp4-recipe= --fp4-quantizer-factory= --fp4-param-gather",
    Refused("keeping the parameters in MXFP8"): "--reuse-grad-buf-for-mxfp8-param-ag",
    Refused("an interleaved GLU weight layout", "drop it; gated MLP weights hold the gate, then the linear half"):
        "--moe-shared-expert-glu-interleave-size= --moe-mlp-glu-interleave-size=",
    Refused("MoE routing replay"): "--moe-enable-routing-replay",
    Refused("router padding for FP8/FP4 grouped GEMMs"):
        "--moe-router-padding-for-quantization --moe-router-padding-for-fp8",
    Refused("a forced router bias"): "--moe-router-force-biased=",
    Refused("the flex token dispatcher (DeepEP/HybridEP/NCCL EP)", "use --moe-token-dispatcher-type alltoall"):
        "--moe-enable-deepep --moe-flex-dispatcher-backend= --moe-permute-fusion-into-hybridep "
        "--moe-hybridep-pad-uneven-dispatch-inputs --moe-flex-dispatcher-num-sms= --moe-deepep-num-sms= "
        "--moe-hybridep-num-sms= --moe-hybridep-num-blocks-permute= --moe-hybridep-num-blocks-unpermute= "
        "--moe-hybridep-num-sms-preprocessing= --moe-ncclep-zero-copy",
    Refused("the latent MoE projection"): "--moe-latent-size=",
    Refused("per-rank expert capacity"): "--moe-expert-rank-capacity-factor=",
    Refused("upcycling a dense checkpoint into experts"): "--moe-use-upcycling --moe-upcycling-granularity=",
    Refused("tracing the MoE routing"): "--moe-routing-trace-path= --moe-routing-trace-max-training-iters= "
                                   "--moe-routing-trace-capture-logits --moe-routing-trace-capture-hidden-states "
                                   "--moe-routing-trace-dump-weights",
    Refused("mHC (manifold hyper-connections)"): "--enable-mhc-connections --mhc-num-residual-streams= "
                                                 "--mhc-sinkhorn-iterations= --mhc-init-gating-factor= "
                                                 "--mhc-recompute-layer-num=",
    Refused("multimodal RoPE"): "--mrope-section=+",
    Refused("the CuTeDSL Gated Delta Product kernel package (gdp_attn)",
            "drop it; teratron's GDP layers run its own gated-delta-rule kernels"): "--gdp-cutedsl-kernel",
    Refused("a Mamba SSM state dtype other than fp32 in training", "drop the flag (the scan keeps fp32 states)"):
        "--mamba-training-ssm-states-dtype=",
    Refused("chunking the MLP in training"): "--mlp-chunks-for-training=",
    Refused("an encoder-decoder model (T5) or its relative position embedding",
            "train a GPT with --num-layers and --seq-length"):
        "--encoder-num-layers= --decoder-num-layers= --decoder-seq-length= --relative-attention-num-buckets= "
        "--relative-attention-max-distance=",
    Refused("RoPE sequence-length interpolation"): "--rotary-seq-len-interpolation-factor=",
    Refused("training BERT, T5 or retrieval (ICT/biencoder) models", "teratron train trains GPT models"):
        "--bert-no-binary-head --output-bert-embeddings --bert-embedder-type= --mask-prob= --short-seq-prob= "
        "--ict-head-size= --biencoder-projection-dim= --biencoder-shared-query-context-model --ict-load= "
        "--bert-load= --titles-data-path= --query-in-block-prob= --use-one-sent-docs --evidence-data-path= "
        "--retriever-report-topk-accuracies=+ --retriever-score-scaling --block-data-path= --embedding-path= "
        "--indexer-batch-size= --indexer-log-interval=",
    Refused("training vision models", "teratron train trains GPT models"):
        "--num-classes= --img-h= --img-w= --num-channels= --patch-dim= --classes-fraction= "
        "--data-per-class-fraction= --no-data-sharding --head-lr-mult= --vision-pretraining "
        "--vision-pretraining-type= --vision-backbone-type= --swin-backbone-type= --mask-type= --mask-factor= "
        "--iter-per-epoch= --dino-local-img-size= --dino-local-crops-number= --dino-head-hidden-size= "
        "--dino-bottleneck-size= --dino-freeze-last-layer= --dino-norm-last-layer --dino-warmup-teacher-temp= "
        "--dino-teacher-temp= --dino-warmup-teacher-temp-epochs=",
    Refused("reinforcement learning (GRPO)", "teratron train pretrains; use Megatron-LM's RL loop"):
        "--perform-rl-step --rl-prompts-per-eval= --grpo-prompts-per-step= --grpo-group-size= "
        "--rl-generation-lag= --rl-max-inflight-requests= --rl-submission-granularity= "
        "--rl-consumption-granularity= --rl-durable-rollout-bank --rl-rollout-bank-dir= "
        "--rl-rollout-bank-max-bytes= --grpo-iterations= --grpo-clamp-eps-lower= --grpo-clamp-eps-upper= "
        "--grpo-kl-beta= --grpo-entropy-term-weight= --grpo-filter-groups-with-same-reward --langrl-env-config= "
        "--rl-default-temperature= --rl-default-top-p= --rl-default-top-k= --rl-offload-optimizer-during-inference "
        "--rl-kv-cache-management-mode= --rl-persist-cuda-graphs|--no-rl-persist-cuda-graphs "
        "--rl-partial-rollouts|--no-rl-partial-rollouts "
        "--rl-inference-logprobs-is-correction|--no-rl-inference-logprobs-is-correction "
        "--rl-importance-sampling-truncation-coef= --rl-use-sequence-packing|--no-rl-use-sequence-packing "
        "--rl-sequence-packing-max-sequences-per-bin= --rl-sequence-packing-algo= "
        "--rl-training-cuda-graphs|--no-rl-training-cuda-graphs --rl-inference-tensor-model-parallel-size= "
        "--rl-inference-pipeline-model-parallel-size= --rl-inference-expert-model-parallel-size= "
        "--rl-inference-expert-tensor-model-parallel-size= --rl-inference-model-unified-memory-level= "
        "--rl-offload-inference-model-weights-when-idle|--no-rl-offload-inference-model-weights-when-idle "
        "--refit-method= --rl-verify-model-weights-swap|--no-rl-verify-model-weights-swap "
        "--rl-skip-bos-token|--no-rl-skip-bos-token --rl-profile --rl-profile-dir= --rl-inference-parsers=*",
    Refused("supervised fine-tuning (SFT) data"): "--sft --sft-tokenizer-prompt-format=",
    Refused("logits distillation"): "--logits-save-top-k= --logits-save-top-p= --logits-save-top-p-min-k= "
                                    "--logits-save-dir= --logits-save-dtype= --logits-load-dir= "
                                    "--logits-load-decode-threads= --logits-load-prefetch-factor= "
                                    "--logits-load-msc-prefetch-depth= --logits-load-kd-loss-alpha= "
                                    "--logits-load-ignore-errors",
    Refused("a heterogeneous layer config"): "--heterogeneous-layers-config-path= "
                                            "--heterogeneous-layers-config-encoded-json=",
    Refused("Megatron's YAML config", "use --config (a YAML file of teratron train's flag names)"): "--yaml-cfg=",
    Refused("the precision-aware optimizer (low-precision optimizer states)"): "--use-precision-aware-optimizer",
    Refused("tuning of Megatron-FSDP's own buffers and hybrid-sharding variants",
            "drop it; teratron's FSDP runs on FSDP2 (--use-megatron-fsdp / --use-torch-fsdp2)"):
        "--megatron-fsdp-version= --no-use-layer-wise-param-layout "
        "--fsdp-manual-registration --outer-dp-sharding-strategy= "
        "--fsdp-double-buffer --suggested-communication-unit-size= --keep-fp8-transpose-cache "
        "--enable-full-sharding-in-hsdp --megatron-fsdp-main-params-dtype= --megatron-fsdp-main-grads-dtype= "
        "--megatron-fsdp-grad-comm-dtype= --megatron-fsdp-enable-fine-grained-param-gather "
        "--megatron-fsdp-max-pool-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail",
    Refused("an external DDP manager (lazy model-parallel init)"): "--lazy-mpu-init",
    Refused("the tp-pp-dp rank order", "drop it; teratron orders ranks tp-cp-ep-dp-pp, as Megatron's default"):
        "--use-tp-pp-dp-mapping",
    Refused("a fake process group"): "--fake-process-group",
    Refused("fp32 accumulation inside the reduce-scatter or per parameter",
            "use --accumulate-allreduce-grads-in-fp32"):
        "--ddp-reduce-scatter-with-fp32-accumulation --ddp-param-name-patterns-for-fp32-local-accumulation=+",
    Refused("overlapping the parameter all-gather with the optimizer step",
            "use --overlap-param-gather (overlapped with the next forward)"):
        "--overlap-param-gather-with-optimizer-step",
    Refused("overlapping the CPU optimizer's copies with its step"): "--overlap-cpu-optimizer-d2h-h2d",
    Refused("fp16 cross entropy"): "--fp16-lm-cross-entropy",
    Refused("choosing the output logits' dtype"): "--output-logit-dtype=",
    Refused("a stepwise batch-size schedule", "use --rampup-batch-size START INCREMENT SAMPLES"):
        "--step-batch-size-schedule=",
    Refused("shrinking the global batch to fit the data-parallel size", "set --global-batch-size"):
        "--decrease-batch-size-if-needed",
    Refused("checking that data-parallel replicas' weights agree"): "--check-weight-hash-across-dp-replicas-interval=",
    Refused("GPU sniff testing"): "--gpu-sniff-test-interval=",
    Refused("a wall-clock limit on training", "use --exit-interval, or --exit-signal-handler with your "
                                              "scheduler's SIGTERM"): "--exit-duration-in-mins=",
    Refused("skipping chosen iterations"): "--iterations-to-skip=+",
    Refused("capturing the optimizer step in a CUDA graph"): "--optimizer-cuda-graph",
    Refused("a per-module CUDA graph scope", "use --cuda-graph-scope full, attn or full_iteration"):
        "--cuda-graph-modules=+",
    Refused("dumping the parameter-to-group map"): "--dump-param-to-param-group-map=",
    Refused("different initial weights per data-parallel rank"): "--data-parallel-random-init",
    Refused("Xavier-uniform initialisation", "use --init-method-std"): "--init-method-xavier-uniform",
    Refused("freezing every layer (teacher logit dumps)"): "--freeze-all-layers",
    Refused("dumping parameters, activations, gradients or tokens per expert during training"):
        "--save-params-interval= --save-activations-interval= --save-tokens-per-expert-interval= "
        "--save-wgrads-interval= --save-dgrads-interval=",
    Refused("deleting older checkpoints (retention)"): "--save-retain-interval=",
    Refused("loading fp32 main params without the optimizer state"): "--load-main-params-from-ckpt",
    Refused("non-persistent (local or in-memory) checkpointing", "use --save with --save-interval"):
        "--non-persistent-save-interval= --non-persistent-ckpt-type= --non-persistent-global-ckpt-dir= "
        "--non-persistent-local-ckpt-dir= --non-persistent-local-ckpt-algo=",
    Refused("a separate pretrained checkpoint", "use --load DIR --finetune"): "--pretrained-checkpoint=",
    Refused("loading a chosen iteration", "write it into the folder's latest_checkpointed_iteration.txt"):
        "--ckpt-step= --override-ckpt-iteration=",
    Refused("converting checkpoints inside training", "use teratron convert"):
        "--ckpt-convert-format= --ckpt-convert-save= --ckpt-convert-update-legacy-dist-opt-format",
    Refused("Megatron's pre-0.14 checkpoint layout"): "--dist-ckpt-save-pre-mcore-014",
    Refused("checkpoint replication"): "--replication --replication-jump= --replication-factor=",
    Refused("checkpoint integrity verification"): "--verify-integrity",
    Refused("evaluating only, test mode or several validation sets"):
        "--skip-train --test-mode --full-validation --multiple-validation-sets --validation-set-names=+",
    Refused("a separate evaluation batch size or a delayed first evaluation"):
        "--eval-global-batch-size= --eval-micro-batch-size= --start-eval-at-iter=",
    Refused("a data phase transition"): "--phase-transition-iterations=",
    Refused("reading data paths from a file", "pass --data-path, or --train/valid/test-data-path"):
        "--data-args-path= --per-split-data-args-path= --per-dataset-sequences-path=",
    Refused("sub-sampling the training data"): "--sample-rate=",
    Refused("Megatron's inter-document masking",
            "use --reset-attention-mask (documents as packed sequences, no attention across EOD)"):
        "--dataloader-inter-document-masking",
    Refused("reading datasets from object storage (multi-storage client)"): "--object-storage-cache-path= --enable-msc",
    Refused("a pad token that shares its id with another special token"): "--allow-ambiguous-pad-tokens",
    Refused("fill-in-the-middle (FIM) data"): "--fim-data --fim-rate= --fim-spm-rate= --fim-split-sample= "
                                              "--fim-fragment-rate= --fim-no-prefix= --fim-prefix-token= "
                                              "--fim-middle-token= --fim-suffix-token= --fim-pad-token= "
                                              "--fim-eod-token=",
    Refused("an unpadded vocabulary", "use --make-vocab-size-divisible-by 1 (the vocabulary still pads to a "
                                      "multiple of TP)"): "--no-pad-vocab-size|--disable-pad-vocab-size",
    Refused("this option of Megatron's tokenizer library (metadata, special tokens, chat templates, SentencePiece "
            "legacy/whitespace modes, NullTokenizer ids, gigatoken)"):
        "--tokenizer-metadata= --tokenizer-special-tokens=+ --tokenizer-sentencepiece-legacy "
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces"
        "|--disable-tokenizer-sentencepiece-ignore-extra-whitespaces "
        "--null-tokenizer-eod-id= --null-tokenizer-pad-id= --chat-template= --use-gigatoken",
    Refused("ADLR autoresume", "use --exit-signal-handler with your scheduler's SIGTERM"):
        "--adlr-autoresume --adlr-autoresume-interval=",
    Refused("Weights & Biases logging", "use --tensorboard-dir or --metrics-file"):
        "--wandb-project= --wandb-exp-name= --wandb-save-dir= --wandb-entity=",
    Refused("the workload inspector server"): "--run-workload-inspector-server",
    Refused("in-process restart (nvidia-resiliency-ext)"):
        "--inprocess-restart --inprocess-max-iterations= --inprocess-monitor-thread-interval= "
        "--inprocess-monitor-process-interval= --inprocess-progress-watchdog-interval= "
        "--inprocess-heartbeat-interval= --inprocess-soft-timeout= --inprocess-hard-timeout= "
        "--inprocess-heartbeat-timeout= --inprocess-barrier-timeout= --inprocess-completion-timeout= "
        "--inprocess-last-call-wait= --inprocess-termination-grace-time= --inprocess-granularity= "
        "--inprocess-active-world-size= --inprocess-empty-cuda-cache",
    Refused("switching the straggler report on at run time", "drop --log-straggler to run without it"):
        "--disable-straggler-on-startup",
    Refused("the fault-tolerance package"): "--enable-ft-package --calc-ft-timeouts --ft-num-warmup-iters=",
    Refused("the fault injector"): "--fault-injector-ranks= --fault-injector-num-ranks= --fault-injector-fault-types= "
                                   "--fault-injector-fault-probabilities= --fault-injector-fault-delay= "
                                   "--fault-injector-delay-start-iteration= --fault-injector-mtti-seconds= "
                                   "--fault-injector-offset-seconds= --fault-injector-seed=",
    # Flags Megatron itself no longer accepts.
    Refused("--batch-size (removed from Megatron)", "use --micro-batch-size"): "--batch-size=",
    Refused("--warmup (removed from Megatron)", "use --lr-warmup-fraction or --lr-warmup-iters"): "--warmup=",
    Refused("--model-parallel-size (removed from Megatron)", "use --tensor-model-parallel-size"):
        "--model-parallel-size=",
    Refused("--checkpoint-activations (removed from Megatron)",
            "use --recompute-activations, or --recompute-granularity and --recompute-method"):
        "--checkpoint-activations",
}

_MXFP8_DISPATCH = Refused("MXFP8 expert dispatch/combine", "drop it; tokens travel in the compute dtype")
_LOW_PRECISION_STATES = Refused("keeping optimizer states or gradients in low precision (precision-aware optimizer)",
                                "drop it; teratron keeps fp32 master weights, gradients and Adam states")
_FP32_STATES = "teratron keeps fp32 master weights, main gradients (with --accumulate-allreduce-grads-in-fp32) " \
               "and Adam states"

# valued flag -> {value: note (accepted) or Refused}, with "*" the fallback for other values
BY_VALUE = {
    "--transformer-impl=": {
        "local": "teratron builds its own layers (no Transformer Engine) for either value",
        "transformer_engine": "teratron builds its own layers (no Transformer Engine) for either value",
        "*": Refused("Megatron's inference-optimized layers", "use --transformer-impl local"),
    },
    "--ckpt-format=": {
        "torch_dist": "--save writes Megatron-LM's torch_dist layout (teratron resumes it with the optimizer; RNG "
                      "states are not written); without the flag teratron writes its own layout, which also "
                      "records checksums, the model args and RNG states",
        "torch": Refused("Megatron's legacy torch format (one file per model-parallel rank)",
                         "use --ckpt-format torch_dist (Megatron-LM's sharded layout) or teratron's own (the default)"),
        "torch_dcp": Refused("Megatron's torch_dcp format", "use --ckpt-format torch_dist (Megatron-LM's sharded "
                                                            "layout, also torch.distributed.checkpoint)"),
        "fsdp_dtensor": Refused("Megatron FSDP's fsdp_dtensor format", "use --ckpt-format torch_dist"),
        "*": Refused("this checkpoint format", "use --ckpt-format torch_dist"),
    },
    "--pipeline-model-parallel-comm-backend=": {
        "nccl": "pipeline sends go through the run's torch.distributed backend (--distributed-backend)",
        "*": Refused("a pipeline p2p backend other than the run's (UCC)", "drop it"),
    },
    "--dataloader-type=": {
        "single": "teratron's sampler is Megatron's single pass: samples in order, resumed after the consumed ones",
        "*": Refused("this data loader (cyclic or external)", "use --dataloader-type single (teratron's sampler)"),
    },
    "--exit-signal=": {
        "SIGTERM": "teratron's --exit-signal-handler listens for SIGTERM",
        "*": Refused("exiting on a signal other than SIGTERM", "use SIGTERM"),
    },
    "--moe-dispatch-fwd-dtype=": {"bf16": "tokens travel in the compute dtype", "*": _MXFP8_DISPATCH},
    "--moe-combine-bwd-dtype=": {"bf16": "tokens travel in the compute dtype", "*": _MXFP8_DISPATCH},
    "--main-grads-dtype=": {"fp32": _FP32_STATES, "*": _LOW_PRECISION_STATES},
    "--main-params-dtype=": {"fp32": _FP32_STATES, "*": _LOW_PRECISION_STATES},
    "--exp-avg-dtype=": {"fp32": _FP32_STATES, "*": _LOW_PRECISION_STATES},
    "--exp-avg-sq-dtype=": {"fp32": _FP32_STATES, "*": _LOW_PRECISION_STATES},
}


class Entry(NamedTuple):
    spellings: tuple
    nargs: object  # 0 for a switch, None for one value, "+" or "*"
    rule: object  # a note (str), a Refused, or a BY_VALUE dict


def _entry(spec: str, rule) -> Entry:
    """'--a|--b=+' -> Entry(('--a', '--b'), '+', rule)."""
    names, _, value = spec.partition("=")
    return Entry(tuple(names.split("|")), 0 if "=" not in spec else (value or None), rule)


def _table() -> dict:
    """Each spelling -> its Entry."""
    entries = [_entry(spec, note) for note, specs in ACCEPTED.items() for spec in specs.split()]
    entries += [_entry(spec, refused) for refused, specs in REFUSED.items() for spec in specs.split()]
    entries += [_entry(spec, rule) for spec, rule in BY_VALUE.items()]
    table = {}
    for entry in entries:
        for name in entry.spellings:
            assert name not in table, f"{name} is classified twice"
            table[name] = entry
    return table


TABLE = _table()

# Flags of teratron's own parser that BY_VALUE also classifies (honoured with a note per Megatron
# value), each with its teratron-only values, which need no note.
OWN_FLAGS_WITH_NOTES = {"--ckpt-format": ("teratron",)}


class MegatronFlagAction(argparse.Action):
    """Records a Megatron-only flag and its value in `namespace.megatron_flags` (a dict, the
    spelling given -> the value; None for a switch)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = dict(getattr(namespace, self.dest) or {})
        given[option_string] = None if self.nargs == 0 else values
        setattr(namespace, self.dest, given)


def add_megatron_flags(parser: argparse.ArgumentParser, own: set) -> None:
    """Add every flag of the table that `own` (teratron's option strings) lacks; help suppressed
    (README.md's "Coming from Megatron-LM" describes them)."""
    group = parser.add_argument_group("Megatron-LM flags teratron accepts or refuses "
                                      "(teratron.training.megatron_flags)")
    for name, entry in TABLE.items():
        if name != entry.spellings[0]:
            continue  # added with its first spelling
        spellings = [name for name in entry.spellings if name not in own]
        if spellings:
            group.add_argument(*spellings, nargs=entry.nargs, action=MegatronFlagAction, dest="megatron_flags",
                               default=None, help=argparse.SUPPRESS)


def classify(flag: str, value=None):
    """A note (accepted), a Refused, or None when the table does not know `flag`."""
    entry = TABLE.get(flag)
    if entry is None:
        return None
    if isinstance(entry.rule, dict):
        key = " ".join(value) if isinstance(value, (list, tuple)) else value
        return entry.rule.get(key, entry.rule.get("*"))
    return entry.rule


def _shown(flag: str, value) -> str:
    if value is None:
        return flag
    return f"{flag} {' '.join(value) if isinstance(value, (list, tuple)) else value}"


def check(given: dict) -> tuple:
    """The accepted ((flag, value), ...) of `given` (spelling -> value); raises NotImplementedError
    with one line for the first refused flag."""
    accepted = []
    for flag, value in given.items():
        rule = classify(flag, value)
        if isinstance(rule, Refused):
            raise NotImplementedError(f"{_shown(flag, value)}: {rule.feature} is not supported by teratron; "
                                      f"{rule.fix}")
        accepted.append((flag, tuple(value) if isinstance(value, list) else value))
    return tuple(accepted)


def startup_notes(accepted) -> list:
    """One line per accepted Megatron flag: what teratron does instead."""
    return [f"NOTE: {_shown(flag, value)}: accepted; {classify(flag, value)}" for flag, value in accepted]
