"""The activation model of hybrid models against what autograd keeps, with the Mamba, Gated Delta
Product and Gated DeltaNet layers on their Triton kernels (what a GPU runs): test_hybrid_estimate.py
runs it in Triton's interpreter, in a subprocess (Triton reads TRITON_INTERPRET when kernels are
defined):

    PYTHONPATH=tests TRITON_INTERPRET=1 python tests/estimate/hybrid_estimate_cases.py [one | tp | cp | cp-compiled ...]

For each case a real hybrid model (built by the training code path) runs one micro-batch forward
under `saved_tensors_hooks`; the bytes of the storages autograd keeps must equal the estimate's,
in one process and per rank under TP 2 and CP 2 (gloo). Prints how many cases it checked.
"""

import os
import sys

from dist import run_distributed
from estimate.test_activations import _tensor_parallel_ranks, estimated_bytes, measured_saved_bytes, parse

SIZES = ("--mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2 --linear-key-head-dim 16 "
         "--linear-value-head-dim 16 --linear-num-key-heads 2 --linear-num-value-heads 4 ")
MOE = " --num-experts 4 --moe-router-topk 2"
MLA = (" --multi-latent-attention --kv-lora-rank 12 --qk-head-dim 10 --qk-pos-emb-head-dim 6 --v-head-dim 16 "
       "--q-lora-rank 20 --qk-layernorm --rotary-scaling-factor 4 --mscale-all-dim 1 --position-embedding-type rope")
GDP = " --spec megatron.core.models.hybrid.hybrid_layer_specs gdp_stack_spec"  # the M layers: Gated Delta Product
# fp32 and bf16, RMSNorm (the CPU's composite) and LayerNorm, every layer kind, dropout, MTP depths
# of hybrid layers (an MoE one among them), full and selective recompute, fp32 residuals and zero-centred norms
# (weights cast or shifted), a sequence of two scan chunks and a ragged one; layers compiled by
# --torch-compile (Inductor's choices: fp32 and bf16, both norms, a depth's Mamba layer uncompiled);
# multi-latent attention layers (+), with MLA's selective recompute; Gated Delta Product layers (GDP:
# fp32 and bf16, M = 1 (views of the convolution's output), 2 (a ragged chunk of the expanded sequence)
# and 3, one sequence a micro-batch, full recompute, compiled, an MTP depth's).
CASES = [
    "--hybrid-layer-pattern M --normalization RMSNorm",
    "--hybrid-layer-pattern M --normalization RMSNorm --bf16",
    "--hybrid-layer-pattern G --normalization RMSNorm",
    "--hybrid-layer-pattern G --bf16",
    "--hybrid-layer-pattern MG*-MG --bf16 --hidden-dropout 0.1",
    "--hybrid-layer-pattern MG*-E/M- --position-embedding-type rope --normalization RMSNorm" + MOE,
    "--hybrid-layer-pattern MGM*- --recompute-granularity full --recompute-method uniform --recompute-num-layers 2 "
    "--bf16",
    "--hybrid-layer-pattern MG --seq-length 200 --bf16",
    "--hybrid-layer-pattern G*M-E --bf16 --apply-layernorm-1p --fp32-residual-connection" + MOE,
    "--hybrid-layer-pattern MG/G*E --bf16 --position-embedding-type rope --normalization RMSNorm" + MOE,
    "--hybrid-layer-pattern MG*-E --bf16 --recompute-granularity selective --position-embedding-type rope" + MOE,
    "--hybrid-layer-pattern GM*-E --bf16 --recompute-granularity selective --recompute-modules layernorm mlp moe "
    "core_attn --normalization RMSNorm" + MOE,
    "--torch-compile --hybrid-layer-pattern MG --normalization RMSNorm",
    "--torch-compile --hybrid-layer-pattern MG --bf16",
    "--torch-compile --hybrid-layer-pattern GM --bf16 --normalization RMSNorm --hidden-dropout 0.1",
    "--torch-compile --hybrid-layer-pattern MG*-E --bf16 --position-embedding-type rope --swiglu "
    "--normalization RMSNorm" + MOE,
    "--torch-compile --hybrid-layer-pattern M*-G/M- --bf16 --position-embedding-type rope",
    "--hybrid-layer-pattern M+-G+E --bf16 --normalization RMSNorm" + MLA + MOE,
    "--hybrid-layer-pattern M+-G --recompute-granularity selective --recompute-modules mla_up_proj core_attn"
    + MLA,
    "--hybrid-layer-pattern M*- --normalization RMSNorm" + GDP,
    "--hybrid-layer-pattern MG*-E/M- --bf16 --hidden-dropout 0.1 --position-embedding-type rope" + MOE + GDP,
    "--hybrid-layer-pattern MG --seq-length 200 --bf16 --gdp-num-householder 2" + GDP,
    "--hybrid-layer-pattern M- --gdp-num-householder 1" + GDP,
    "--hybrid-layer-pattern M --bf16 --gdp-num-householder 1 --micro-batch-size 1" + GDP,
    "--hybrid-layer-pattern MM*- --bf16 --recompute-granularity full --recompute-method uniform "
    "--recompute-num-layers 2" + GDP,
    "--torch-compile --hybrid-layer-pattern MG --normalization RMSNorm --gdp-num-householder 2" + GDP,
    "--torch-compile --hybrid-layer-pattern M*-/M- --bf16 --position-embedding-type rope --micro-batch-size 1" + GDP,
]
TP_CASES = [
    "--tensor-model-parallel-size 2 --sequence-parallel --hybrid-layer-pattern MG*-E/M- --bf16 --normalization RMSNorm "
    "--position-embedding-type rope --disable-bias-linear --expert-tensor-parallel-size 1" + MOE,
    "--tensor-model-parallel-size 2 --hybrid-layer-pattern GM*- --recompute-granularity full --recompute-method "
    "uniform --recompute-num-layers 1",
    "--tensor-model-parallel-size 2 --sequence-parallel --hybrid-layer-pattern M+-G+ --bf16 --normalization RMSNorm "
    "--disable-bias-linear" + MLA,
    "--tensor-model-parallel-size 2 --sequence-parallel --hybrid-layer-pattern MG*-E --bf16 --normalization RMSNorm "
    "--disable-bias-linear --expert-tensor-parallel-size 1" + MOE + GDP,
]
# Context parallelism: the mixers' shares of heads over whole sequences (fewer groups than CP ranks:
# every rank reads the one group), next to p2p and a2a attention (sharing the token order), MTP
# depths, a ragged last scan chunk, full recompute; compiled layers (graphs broken at the exchanges:
# fp32 with LayerNorm, bf16 with MoE and an MTP depth).
CP_CASES = [
    "--context-parallel-size 2 --hybrid-layer-pattern MG*-/M- --normalization RMSNorm "
    "--position-embedding-type rope",
    "--context-parallel-size 2 --cp-comm-type a2a --hybrid-layer-pattern GM*-E --bf16 --mamba-num-groups 1 "
    "--linear-num-key-heads 1" + MOE,
    "--context-parallel-size 2 --hybrid-layer-pattern MG --seq-length 200 --bf16 --hidden-dropout 0.1",
    "--context-parallel-size 2 --hybrid-layer-pattern GM*- --bf16 --recompute-granularity full "
    "--recompute-method uniform --recompute-num-layers 1",
    "--context-parallel-size 2 --hybrid-layer-pattern MG*-/M- --normalization RMSNorm --position-embedding-type rope"
    + GDP,
    "--context-parallel-size 2 --cp-comm-type a2a --hybrid-layer-pattern M*-G --seq-length 200 --bf16 "
    "--mamba-num-groups 1 --linear-num-key-heads 1 --gdp-num-householder 2" + GDP,
]
CP_COMPILED_CASES = [
    "--torch-compile --context-parallel-size 2 --hybrid-layer-pattern GM --seq-length 200",
    "--torch-compile --context-parallel-size 2 --hybrid-layer-pattern MG*-E/M- --bf16 --position-embedding-type rope "
    "--swiglu --normalization RMSNorm" + MOE,
    "--torch-compile --context-parallel-size 2 --hybrid-layer-pattern MG --seq-length 200" + GDP,
    "--torch-compile --context-parallel-size 2 --hybrid-layer-pattern M*-E/M- --bf16 --position-embedding-type rope "
    "--swiglu --normalization RMSNorm --gdp-num-householder 2" + MOE + GDP,
]
# Each part runs in a process of its own (test_hybrid_estimate.py: one subprocess each, within its time limit).
PARTS = {"one": CASES, "tp": TP_CASES, "cp": CP_CASES, "cp-compiled": CP_COMPILED_CASES}


def main(parts) -> None:
    import torch

    from teratron.estimate.kernels import probe_kernels

    assert os.environ.get("TRITON_INTERPRET") == "1", "needs the interpreter (the scans' Triton path)"
    assert probe_kernels(torch.device("cpu")).triton_scans
    checked = 0
    for part in parts:
        flag_sets = [SIZES + flags for flags in PARTS[part]]
        if part == "one":
            for flags in flag_sets:
                args = parse(flags)
                assert estimated_bytes(args) == measured_saved_bytes(args), flags
            checked += len(flag_sets)
            continue
        for rank_results in run_distributed(_tensor_parallel_ranks, 2, flag_sets, timeout=540):
            for flags, (measured, estimated) in zip(flag_sets, rank_results):
                assert estimated == measured, f"{flags}: estimated {estimated}, measured {measured}"
        checked += len(flag_sets)
    print(f"checked {checked} cases")


if __name__ == "__main__":
    main(sys.argv[1:] or list(PARTS))
