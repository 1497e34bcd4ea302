"""The activation model against what autograd really keeps.

A real GPTModel (built by the training code path from `teratron train` flags) runs one
micro-batch forward under `saved_tensors_hooks` (`teratron.estimate.measure`); the bytes of the distinct storages it saves
(parameters excluded) must equal the estimate's bytes for that micro-batch, counted with the
CPU's kernel profile (probed, not assumed). Under TP the same holds per rank, with and without
sequence parallelism. The same holds with the speed levers (layers really compiled by
--torch-compile, --cross-entropy-loss-fusion); the fused loss's working sets are checked against
the storages its ops allocate.
"""

import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dist import run_distributed
from teratron.estimate.activations import fused_loss_transients, norm_bytes
from teratron.estimate.kernels import CUDA_KERNELS, KernelProfile, probe_kernels
from teratron.estimate.report import estimate_from_args
from teratron.estimate.measure import main as measure_main
from teratron.estimate.measure import saved_activation_bytes
from teratron.tensor_parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.transformer import activation_offload

VOCAB, SEQ, MBS = 250, 32, 2
BASE = (f"--mock-data --tokenizer-type NullTokenizer --vocab-size {VOCAB} --num-layers 2 --hidden-size 64 "
        f"--num-attention-heads 4 --seq-length {SEQ} --micro-batch-size {MBS} --hidden-dropout 0 "
        "--attention-dropout 0 --train-iters 1 --lr 1e-3").split()


def parse(flags: str, **attributes):
    args = parse_train_args(BASE + flags.split())
    vars(args).update(use_cpu_initialization=True, seed=0, **attributes)  # CPU whatever the machine
    return args


def measured_saved_bytes(args, world_size: int = 1) -> int:
    return saved_activation_bytes(build_run_config(args, world_size), torch.device("cpu"))


def estimated_bytes(args, world_size: int = 1) -> int:
    stage = estimate_from_args(args, world_size, "cpu").stages[0]
    assert len(stage.chunk_activations) == 1
    return stage.chunk_activations[0]


CASES = [
    "",                                                            # fp32, LayerNorm, GELU, biases
    "--bf16",
    "--bf16 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear",
    "--normalization RMSNorm --position-embedding-type rope --swiglu",  # fp32 composite RMSNorm
    "--bf16 --group-query-attention --num-query-groups 2",
    "--bf16 --group-query-attention --num-query-groups 2 --position-embedding-type rope --rotary-percent 0.5",
    "--bf16 --qk-layernorm --group-query-attention --num-query-groups 2 --normalization RMSNorm",
    "--qk-layernorm --position-embedding-type rope --normalization RMSNorm",
    "--bf16 --hidden-dropout 0.1 --untie-embeddings-and-output-weights",
    # fp32 residuals of bf16 parameters (each norm keeps its weight, and a LayerNorm its bias, cast to
    # fp32; a LayerNorm's statistics are fp32), zero-centred norms (each keeps 1 + w)
    "--bf16 --fp32-residual-connection",
    "--bf16 --fp32-residual-connection --normalization RMSNorm",
    "--bf16 --apply-layernorm-1p --qk-layernorm --normalization RMSNorm",
    "--bf16 --recompute-granularity selective",
    "--bf16 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "--bf16 --num-layers 3 --recompute-granularity full --recompute-method uniform --recompute-num-layers 2 "
    "--position-embedding-type rope",
    "--bf16 --num-layers 3 --recompute-granularity full --recompute-method block --recompute-num-layers 1",
    "--bf16 --num-experts 4 --moe-router-topk 2",
    "--bf16 --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --swiglu",
    "--bf16 --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --disable-bias-linear "
    "--moe-shared-expert-intermediate-size 32 --moe-aux-loss-coeff 0.01",
    # Multi-token prediction: two depths; one MoE depth with dropout; under full recompute.
    "--position-embedding-type rope --mtp-num-layers 2",
    "--bf16 --position-embedding-type rope --mtp-num-layers 1 --num-experts 4 --moe-router-topk 2 "
    "--moe-layer-freq [0,1] --swiglu --hidden-dropout 0.1 --untie-embeddings-and-output-weights",
    "--bf16 --position-embedding-type none --mtp-num-layers 2 --recompute-granularity full "
    "--recompute-method uniform --recompute-num-layers 1 --normalization RMSNorm",
]


@pytest.mark.parametrize("flags", CASES)
def test_saved_activations_match_autograd(flags):
    args = parse(flags)
    assert estimated_bytes(args) == measured_saved_bytes(args)


@pytest.mark.parametrize("modules", [["mlp"], ["layernorm"], ["core_attn", "mlp", "layernorm"]])
def test_selective_recompute_modules(modules):
    flags = "--bf16 --recompute-granularity selective --normalization RMSNorm --swiglu"
    args = parse(flags, recompute_modules=modules)
    assert estimated_bytes(args) == measured_saved_bytes(args)


def _tensor_parallel_ranks(flag_sets):
    from teratron.training.initialize import initialize_model_parallel
    from teratron import parallel_state

    results = []
    for flags in flag_sets:
        run = build_run_config(parse(flags), 2)
        initialize_model_parallel(run.transformer, run.distributed)
        try:
            results.append((measured_saved_bytes(parse(flags), 2), estimated_bytes(parse(flags), 2)))
        finally:
            parallel_state.destroy_model_parallel()
    return results


def test_saved_activations_per_tensor_parallel_rank():
    flag_sets = [
        "--tensor-model-parallel-size 2 --bf16",
        "--tensor-model-parallel-size 2 --bf16 --sequence-parallel --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --hidden-dropout 0.1",
        "--tensor-model-parallel-size 2 --sequence-parallel --group-query-attention --num-query-groups 2 "
        "--qk-layernorm",
        "--tensor-model-parallel-size 2 --bf16 --sequence-parallel --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1",
        "--tensor-model-parallel-size 2 --bf16 --num-experts 4 --moe-router-topk 2 --swiglu --disable-bias-linear",
        # The dispatcher gathers the routing over expert-TP: with SP (ETP 2), without SP at ETP 1.
        "--tensor-model-parallel-size 2 --bf16 --sequence-parallel --num-experts 4 --moe-router-topk 2 "
        "--disable-bias-linear",
        "--tensor-model-parallel-size 2 --bf16 --num-experts 4 --moe-router-topk 2 --disable-bias-linear "
        "--expert-tensor-parallel-size 1",
        "--tensor-model-parallel-size 2 --bf16 --sequence-parallel --num-experts 4 --moe-router-topk 2 "
        "--moe-shared-expert-intermediate-size 32 --disable-bias-linear --expert-tensor-parallel-size 1",
        # The first layer's input norm offloads the whole embedding output it keeps a view of.
        "--tensor-model-parallel-size 2 --bf16 --sequence-parallel --fine-grained-activation-offloading "
        "--min-offloaded-tensor-size 1 --offload-modules attn_norm qkv_linear core_attn attn_proj mlp",
        # MTP under SP: the depths' embeddings and layer inputs are views of whole gathered tensors.
        "--tensor-model-parallel-size 2 --sequence-parallel --position-embedding-type rope --mtp-num-layers 2",
        "--tensor-model-parallel-size 2 --bf16 --sequence-parallel --normalization RMSNorm "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
        "--position-embedding-type rope --mtp-num-layers 1",
    ]
    for rank_results in run_distributed(_tensor_parallel_ranks, 2, flag_sets):
        for flags, (measured, estimated) in zip(flag_sets, rank_results):
            assert estimated == measured, flags


def test_saved_activations_per_context_parallel_rank():
    """CP 2: the exchanged types keep what SDPA keeps of this rank's tokens; a2a its own copies."""
    flag_sets = [
        "--context-parallel-size 2 --bf16 --swiglu --normalization RMSNorm --position-embedding-type rope",
        "--context-parallel-size 2 --cp-comm-type all_gather --group-query-attention --num-query-groups 2",
        "--context-parallel-size 2 --cp-comm-type a2a --bf16 --position-embedding-type rope",
        "--context-parallel-size 2 --cp-comm-type a2a --group-query-attention --num-query-groups 1 --qk-layernorm",
        "--context-parallel-size 2 --cp-comm-type p2p a2a --bf16 --recompute-granularity selective",
        # an MTP depth's layer exchanges as the last decoder layer does
        "--context-parallel-size 2 --cp-comm-type p2p a2a --bf16 --position-embedding-type rope --mtp-num-layers 1",
    ]
    for rank_results in run_distributed(_tensor_parallel_ranks, 2, flag_sets):
        for flags, (measured, estimated) in zip(flag_sets, rank_results):
            assert estimated == measured, flags


def test_context_parallel_transients():
    """The exchange's buffers, counted by hand for one layer: T = 16 x 2 tokens per rank, 4 heads
    of 8, 2 key/value groups, bf16."""
    from teratron.estimate.activations import Dims, context_parallel_transients
    from teratron.transformer.transformer_config import TransformerConfig

    d = Dims(s=16, b=2, tp=1, sp=False, a=2, r=2)
    kv, out32, lse, q32 = 32 * 2 * 16, 4 * 32 * 32, 4 * 32 * 4, 4 * 32 * 32  # elements of k + v; bytes
    block_grads = 2 * (32 * 32 + kv)

    def transients(comm_type, **fields):
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                   attention_dropout=0.0, context_parallel_size=4, cp_comm_type=comm_type, **fields)
        return context_parallel_transients(config, d, 1)
    assert transients("p2p") == (2 * 2 * kv + 2 * (out32 + lse), 2 * 2 * kv + 12 * kv + q32 + block_grads)
    assert transients("all_gather") == (4 * 2 * kv + 2 * (out32 + lse), 4 * 2 * kv + 5 * 4 * kv + q32 + block_grads)
    exchanged = 2 * 2 * 32 * (32 + 4 * 16)  # 2 groups don't split over 4 ranks: one key/value head per query head
    assert transients("a2a") == (exchanged, exchanged)
    assert transients("a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]) == (
        max(2 * 2 * 32 * (32 + 2 * 16), 2 * 2 * kv + 2 * (out32 + lse)),
        max(2 * 2 * 32 * (32 + 2 * 16), 2 * 2 * kv + 12 * kv + q32 + block_grads))


def test_probe_reads_the_cpu_kernels():
    cpu = probe_kernels(torch.device("cpu"), torch.bfloat16)
    assert cpu == KernelProfile(fused_rms_norm=False, fused_dropout=False, layer_norm_stat_bytes=2)
    assert probe_kernels(torch.device("cpu"), torch.float32).layer_norm_stat_bytes == 4


def test_norm_bytes_by_kernel():
    class Config:
        normalization, params_dtype, layernorm_zero_centered_gamma = "RMSNorm", torch.bfloat16, False

    # fused (CUDA): bf16 input + fp32 1/rms per row; composite: fp32 upcast + fp32 pre-weight value
    assert norm_bytes(Config, CUDA_KERNELS, elements=1000, rows=10, input_bytes=2, input_is_new=True) == 2040
    assert norm_bytes(Config, CUDA_KERNELS, elements=1000, rows=10, input_bytes=2, input_is_new=False) == 40
    composite = KernelProfile(fused_rms_norm=False, fused_dropout=False, layer_norm_stat_bytes=2)
    assert norm_bytes(Config, composite, elements=1000, rows=10, input_bytes=2, input_is_new=False) == 8040
    # an fp32 input (fp32 residuals) of bf16 parameters: also the weight cast to fp32 [100]
    assert norm_bytes(Config, composite, elements=1000, rows=10, input_bytes=4, input_is_new=False) == 4440
    Config.layernorm_zero_centered_gamma = True  # 1 + w: a new [100] tensor in the input's dtype
    assert norm_bytes(Config, CUDA_KERNELS, elements=1000, rows=10, input_bytes=2, input_is_new=False) == 240
    Config.layernorm_zero_centered_gamma = False
    Config.normalization = "LayerNorm"
    assert norm_bytes(Config, CUDA_KERNELS, elements=1000, rows=10, input_bytes=2, input_is_new=True) == 2080


def test_measure_command(capsys):
    assert measure_main(BASE + ["--bf16", "--swiglu", "--normalization", "RMSNorm"]) == 0
    assert "measured" in capsys.readouterr().out



def _estimate_chunk(args):
    """The estimate's ChunkActivations of a single-process run (device and host bytes)."""
    from teratron.estimate.activations import chunk_activations
    from teratron.estimate.kernels import kernels_for
    from teratron.estimate.params import ModelShape
    run = build_run_config(args, 1)
    config, model = run.transformer, run.model
    shape = ModelShape.of(model, run.training.seq_length)
    return chunk_activations(config, kernels_for("cpu", config.params_dtype), shape, run.training.micro_batch_size,
                             list(range(1, config.num_layers + 1)), True, True)


OFFLOAD = "--fine-grained-activation-offloading --min-offloaded-tensor-size 1 --offload-modules"
OFFLOAD_CASES = [
    f"--bf16 --swiglu --normalization RMSNorm --position-embedding-type rope {OFFLOAD} attn_norm qkv_linear "
    "core_attn attn_proj mlp_norm mlp",
    f"--bf16 {OFFLOAD} core_attn",                      # SDPA's output stays: linear_proj keeps a view
    f"--bf16 {OFFLOAD} attn_proj",                      # copies SDPA's output, frees nothing: SDPA keeps it
    f"--group-query-attention --num-query-groups 2 --qk-layernorm {OFFLOAD} core_attn attn_proj",  # k-norm keeps QKV
    f"--bf16 --hidden-dropout 0.1 {OFFLOAD} attn_norm mlp_norm mlp",
    f"--bf16 --recompute-granularity selective {OFFLOAD} core_attn attn_proj mlp",
    f"--bf16 --num-layers 3 --recompute-granularity full --recompute-method block --recompute-num-layers 1 "
    f"{OFFLOAD} attn_norm mlp",
    f"--bf16 --num-experts 4 --moe-router-topk 2 --swiglu {OFFLOAD} expert_fc1 moe_act mlp_norm",
    f"--bf16 --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm {OFFLOAD} expert_fc1 moe_act",
    f"--bf16 --position-embedding-type rope --mtp-num-layers 1 {OFFLOAD} attn_norm qkv_linear core_attn "
    "attn_proj mlp_norm mlp",                           # the MTP layer offloads as a decoder layer
    # [T, h] storages move, the per-token norm statistics and SDPA's logsumexp stay.
    "--normalization RMSNorm --fine-grained-activation-offloading --min-offloaded-tensor-size 1024 "
    "--offload-modules attn_norm core_attn attn_proj mlp_norm",
]


def _offloaded_and_device_bytes(args):
    """(bytes the offloader copied to the host, device bytes measure counts) of one micro-batch."""
    activation_offload.stats.reset()
    device = measured_saved_bytes(args)
    return sum(activation_offload.stats.offloaded.values()), device


@pytest.mark.parametrize("flags", OFFLOAD_CASES)
def test_offloaded_activations_match_autograd(flags):
    args = parse(flags)
    chunk = _estimate_chunk(args)
    host, device = _offloaded_and_device_bytes(args)
    assert (chunk.host, chunk.stored) == (host, device)
    without = estimated_bytes(parse(flags.split("--fine-grained")[0]))
    frees_device = not flags.endswith("--offload-modules attn_proj")
    assert host > 0 and (chunk.stored < without if frees_device else chunk.stored == without)


# Speed levers: `--torch-compile` (Inductor's partitioner decides what each compiled layer keeps;
# the hooks see what its autograd function saves) and `--cross-entropy-loss-fusion`.
DENSE = "--bf16 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear"
COMPILED_CASES = [
    DENSE,                                                        # the benchmark's layer
    "--hidden-dropout 0.1",                                       # fp32, LayerNorm, GELU, biases, masks
    "--bf16 --qk-layernorm --group-query-attention --num-query-groups 2 --position-embedding-type rope",
    f"{DENSE} --recompute-granularity selective",                 # core_attn: graph breaks at the checkpoint
    f"{DENSE} --num-layers 3 --recompute-granularity full --recompute-method block --recompute-num-layers 1",
    f"{DENSE} --cross-entropy-loss-fusion",
    f"{DENSE} --mtp-num-layers 2",                                # the MTP layers are compiled too
]


@pytest.mark.parametrize("flags", COMPILED_CASES)
def test_compiled_layers_keep_what_the_estimate_counts(flags):
    args = parse(f"{flags} --torch-compile")
    estimated = estimated_bytes(args)
    assert estimated == measured_saved_bytes(args)
    if "full" not in flags:  # full recompute keeps only the checkpoint inputs either way
        assert estimated < estimated_bytes(parse(flags))


@pytest.mark.parametrize("modules", [["mlp"], ["layernorm"]])
def test_compiled_layers_under_selective_recompute(modules):
    args = parse(f"{DENSE} --recompute-granularity selective --torch-compile", recompute_modules=modules)
    assert estimated_bytes(args) == measured_saved_bytes(args)


def test_fused_loss_keeps_no_logits():
    for flags in ("--cross-entropy-loss-fusion",
                  "--bf16 --cross-entropy-loss-fusion --untie-embeddings-and-output-weights"):
        args = parse(flags)
        assert estimated_bytes(args) == measured_saved_bytes(args), flags


def _compiling_tensor_parallel_ranks(flag_sets):
    # Compile in this process: a pool of compile workers forked from a parent that already
    # compiled would hang.
    torch._inductor.config.compile_threads = 1
    return _tensor_parallel_ranks(flag_sets)


def test_compiled_and_fused_per_tensor_parallel_rank():
    flag_sets = [f"--tensor-model-parallel-size 2 --sequence-parallel {DENSE} --torch-compile "
                 "--cross-entropy-loss-fusion"]
    for rank_results in run_distributed(_compiling_tensor_parallel_ranks, 2, flag_sets):
        for flags, (measured, estimated) in zip(flag_sets, rank_results):
            assert estimated == measured, flags


class _PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages the ops under this mode allocate; storages of `existing`
    tensors (and views of them) are not new."""

    def __init__(self, *existing):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                storage = t.untyped_storage()
                self.known.add(storage.data_ptr())
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, storage.data_ptr(), storage.nbytes())
        return out

    def _freed(self, ptr, nbytes):
        self.live -= nbytes
        self.known.discard(ptr)


def _fused_loss_peaks(group, dtype, vocab, hidden, chunk, tokens=(32, 2)):
    """(forward, backward) peak bytes allocated by the fused output layer + loss."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*tokens, hidden, dtype=dtype, generator=g).requires_grad_()
    weight = torch.randn(vocab, hidden, dtype=dtype, generator=g).requires_grad_()
    target = torch.randint(0, vocab, tokens, generator=g)
    with _PeakBytes(x, weight, target) as forward:
        loss = fused_vocab_parallel_cross_entropy(x, weight, target, group=group, chunk_size=chunk)
    grad = torch.ones_like(loss)
    with _PeakBytes(x, weight, target, loss, grad) as backward:
        loss.backward(grad)
    return forward.peak, backward.peak


def _fused_loss_cases():
    group = dist.group.WORLD
    results = []
    # One chunk, several (the last one shorter), and a wide hidden size where the [vocab, h]
    # weight-gradient product outweighs the chunk's logits.
    for dtype, hidden, chunk in [(torch.bfloat16, 32, 64), (torch.bfloat16, 32, 24), (torch.float32, 32, 16),
                                 (torch.float32, 32, 64), (torch.bfloat16, 256, 8)]:
        peaks = [_fused_loss_peaks(group, dtype, vocab, hidden, chunk) for vocab in (256, 1024)]
        results.append((dtype.itemsize, hidden, chunk, peaks))
    return results


def test_fused_loss_transients():
    (cases,) = run_distributed(_fused_loss_cases, 1)
    for a, hidden, chunk, (small, large) in cases:
        model = [fused_loss_transients(a, 64, hidden, vocab, chunk) for vocab in (256, 1024)]
        for phase in (0, 1):  # forward, backward
            assert large[phase] - small[phase] == model[1][phase] - model[0][phase], (a, hidden, chunk, phase)
            assert small[phase] >= model[0][phase]


SHAPE = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 50304 --num-layers 24 --hidden-size 2048 "
         "--ffn-hidden-size 5632 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
         "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
         "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 4 "
         "--global-batch-size 32 --bf16 --accumulate-allreduce-grads-in-fp32 --no-gradient-accumulation-fusion")


@pytest.mark.parametrize("levers, measured_gib", [
    ("--no-torch-compile", 43.80),  # measured before compiled layers became the CUDA default
    ("--torch-compile", 39.50),
    ("--torch-compile --recompute-granularity selective", 39.49),
    ("--torch-compile --fine-grained-activation-offloading --offload-modules mlp", 32.59),
])
def test_benchmark_shape_against_the_h200(levers, measured_gib):
    """torch.cuda.max_memory_allocated of `teratron bench` on one H200 (bench/RESULTS.md, the
    2026-11-30 12:2x entries: commit 2eb9e32 with the cross-entropy rewrite)."""
    estimate = estimate_from_args(parse_train_args((SHAPE + " " + levers).split()), 1, "cuda")
    assert estimate.peak_allocated / 2**30 == pytest.approx(measured_gib, rel=0.01)
