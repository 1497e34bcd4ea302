"""Fine-grained activation offloading: a training step with any set of offloaded modules gives the
outputs and gradients of a run without offloading bit for bit (fp32 and bf16, dense and MoE,
with recompute, under TP=2 + SP and under a 2-stage 1F1B pipeline); the saved tensors really
leave (bytes per module against sizes computed here from the shapes); backward reloads a layer
and prefetches the one before it; bad flags are one-line errors."""

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from teratron import cli
from teratron import parallel_state as ps
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.pipeline_parallel import get_forward_backward_func
from teratron.process_groups import ProcessGroupCollection
from teratron.transformer import activation_offload
from teratron.transformer.activation_offload import OFFLOAD_MODULES
from teratron.transformer.transformer_config import TransformerConfig

SEQ, BATCH, VOCAB, LAYERS = 16, 2, 64, 3
T = SEQ * BATCH
HIDDEN, HEADS, GROUPS, FFN, MOE_FFN, TOPK = 32, 4, 2, 64, 32, 2
Q, KV = HIDDEN, HIDDEN // HEADS * GROUPS  # query and key/value widths (kv_channels 8)


def make_config(dtype=torch.float32, experts=None, grouped=False, offload=(), **kwargs):
    moe = dict(num_moe_experts=experts, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
               moe_grouped_gemm=grouped) if experts else {}
    off = dict(fine_grained_activation_offloading=True, offload_modules=list(offload),
               min_offloaded_tensor_size=1) if offload else {}
    defaults = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                    ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                    hidden_dropout=0.1, attention_dropout=0.1, use_cpu_initialization=True,
                    params_dtype=dtype, bf16=dtype == torch.bfloat16)
    return TransformerConfig(**{**defaults, **kwargs, **moe, **off})


def build(config, **kwargs):
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm),
                     VOCAB, SEQ, position_embedding_type="rope", **kwargs)
    return model.to(config.params_dtype)


def data():
    return torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def step(config, on_layer_backward=None):
    """Per-token loss and every gradient of one step; (offloaded per module, reloaded) bytes."""
    from teratron.tensor_parallel import model_parallel_cuda_manual_seed

    model = build(config, pg_collection=ProcessGroupCollection())
    if on_layer_backward is not None:
        def watch(i, output):  # runs after the offloader's own hook on the layer's output
            def hook(grad):
                on_layer_backward(i)
            output.register_hook(hook)

        for i, layer in enumerate(model.decoder.layers):
            layer.register_forward_hook(lambda m, args, out, i=i: watch(i, out[0]))
    ids, labels = data()
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    activation_offload.stats.reset()
    loss = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels)
    loss.sum().backward()
    stats = dict(activation_offload.stats.offloaded), activation_offload.stats.reloaded
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, stats


def assert_identical(run, reference, what):
    assert torch.equal(run[0], reference[0]), f"{what}: loss"
    assert run[1].keys() == reference[1].keys()
    for name, grad in reference[1].items():
        assert torch.equal(run[1][name], grad), f"{what}: {name} grad"


NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)
DENSE_SETS = [[m] for m in ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp")]
MOE_SETS = [["expert_fc1"], ["moe_act"]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,grouped", [(None, False), (4, False), (4, True)])
def test_offloading_is_bit_identical(dtype, experts, grouped):
    from teratron.transformer.moe import clear_aux_losses_tracker

    clear_aux_losses_tracker()
    reference = step(make_config(dtype, experts, grouped))
    sets = (MOE_SETS if experts else DENSE_SETS) + [list(OFFLOAD_MODULES)]
    for modules in sets:
        run = step(make_config(dtype, experts, grouped, offload=modules))
        assert_identical(run, reference, modules)
        offloaded, reloaded = run[2]
        # An MoE layer has no dense MLP, a dense one no experts; all together, SDPA's output counts
        # for core_attn, which saves it first (attn_proj has a tensor of its own only when SDPA's
        # math path returns a non-contiguous output, as with dropout on CPU).
        present = set(modules) - ({"mlp"} if experts else {"expert_fc1", "moe_act"})
        assert present - {"attn_proj"} <= set(offloaded) <= present, modules
        assert reloaded == sum(offloaded.values()) > 0
    clear_aux_losses_tracker()


def _layernorm(dtype_bytes):
    return dtype_bytes * T * HIDDEN + 2 * dtype_bytes * T  # input, mean and 1/std per token


# Bytes one layer offloads per module alone: fp32, LayerNorm, SwiGLU, RoPE, GQA (2 groups), no
# biases, no dropout: the storages autograd keeps inside each module, from the shapes.
EXPECTED_PER_LAYER = {
    "attn_norm": _layernorm(4),
    "qkv_linear": 4 * T * HIDDEN,                               # linear_qkv's input
    # QKV output (v is a view), q and k after RoPE, SDPA's output and fp32 logsumexp [b, np, s].
    "core_attn": 4 * T * (Q + 2 * KV) + 4 * T * (Q + KV) + 4 * T * Q + 4 * T * HEADS,
    "attn_proj": 4 * T * Q,                                     # a view of SDPA's output
    "mlp_norm": _layernorm(4),
    "mlp": 4 * T * (HIDDEN + 2 * FFN + 3 * FFN),                # fc1 input, fc1 out, act(gate), up, product
    "expert_fc1": 4 * T * TOPK * HIDDEN,                        # the permuted tokens
    "moe_act": 4 * T * TOPK * (2 * MOE_FFN + 2 * MOE_FFN),     # fc1 out, act(gate), up (product: fc2)
}


@pytest.mark.parametrize("experts", [None, 4])
def test_offloaded_bytes_per_module(experts):
    names = ["expert_fc1", "moe_act"] if experts else [n for n in EXPECTED_PER_LAYER if "expert" not in n
                                                       and n != "moe_act"]
    for name in names:
        offloaded, reloaded = step(make_config(experts=experts, offload=[name], **NO_DROPOUT))[2]
        assert offloaded == {name: LAYERS * EXPECTED_PER_LAYER[name]}, name
        assert reloaded == LAYERS * EXPECTED_PER_LAYER[name]


def test_offloaded_storages_are_released_after_the_forward(monkeypatch):
    storages = []  # weak references to the device storages the offloader copied
    init = activation_offload._HostCopy.__init__

    def recording_init(copy, storage_bytes, copier):
        storages.append(storage_bytes.untyped_storage()._weak_ref())
        init(copy, storage_bytes, copier)

    monkeypatch.setattr(activation_offload._HostCopy, "__init__", recording_init)
    model = build(make_config(offload=list(OFFLOAD_MODULES), **NO_DROPOUT), pg_collection=ProcessGroupCollection())
    ids, labels = data()
    loss = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels)
    # Per layer: 2 norms x (input, mean, 1/std); qkv input; QKV output, q, k, SDPA's output and
    # logsumexp; fc1 input, fc1 output, act(gate), up, product.
    assert len(storages) == LAYERS * (2 * 3 + 1 + 5 + 5)
    assert all(torch.UntypedStorage._expired(ref) for ref in storages)  # autograd holds only host copies
    loss.sum().backward()


def test_min_offloaded_tensor_size_keeps_small_storages():
    # The per-token mean and 1/std [T] stay; the [T, h] input goes.
    config = make_config(offload=["attn_norm"], **NO_DROPOUT)
    config.min_offloaded_tensor_size = T + 1
    assert step(config)[2][0] == {"attn_norm": LAYERS * 4 * T * HIDDEN}


def test_backward_reloads_a_layer_and_prefetches_the_previous_one():
    per_layer = EXPECTED_PER_LAYER["mlp"]
    seen = {}
    step(make_config(offload=["mlp"], **NO_DROPOUT), lambda i: seen.setdefault(i, activation_offload.stats.reloaded))
    # When backward reaches layer i, layers i and i - 1 (and the later ones) are on their way back.
    assert seen == {2: 2 * per_layer, 1: 3 * per_layer, 0: 3 * per_layer}


def test_recompute_saves_nothing_to_offload():
    everything = list(OFFLOAD_MODULES)
    for recompute, expected in [
        (dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm"]),
         {"qkv_linear", "attn_proj", "mlp"}),  # attn_proj now alone keeps SDPA's output
        (dict(recompute_granularity="selective", recompute_modules=["mlp"]),
         {"attn_norm", "qkv_linear", "core_attn", "mlp_norm"}),
    ]:
        reference = step(make_config(**recompute))
        run = step(make_config(offload=everything, **recompute))
        assert_identical(run, reference, recompute)
        assert expected <= set(run[2][0]) <= expected | {"attn_proj"}, recompute  # see above
    assert step(make_config(offload=everything, recompute_granularity="selective", recompute_modules=["core_attn"],
                            **NO_DROPOUT))[2][0]["attn_proj"] == LAYERS * 4 * T * Q
    # Full recompute: recomputed layers offload nothing, in forward or in backward.
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    reference = step(make_config(**full))
    run = step(make_config(offload=everything, **full))
    assert_identical(run, reference, full)
    assert run[2] == ({}, 0)
    block = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    reference = step(make_config(**block))
    run = step(make_config(offload=["mlp"], **block))  # dropout masks sit outside the MLP
    assert_identical(run, reference, block)
    assert run[2][0] == {"mlp": (LAYERS - 1) * EXPECTED_PER_LAYER["mlp"]}


def test_retain_graph_backward_twice():
    model = build(make_config(offload=list(OFFLOAD_MODULES), **NO_DROPOUT),
                  pg_collection=ProcessGroupCollection())
    ids, labels = data()
    loss = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels).sum()
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    for name, grad in model.named_parameters():
        assert torch.equal(grad.grad, 2 * first[name]), name


def _tensor_parallel_ranks():
    from teratron.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        runs = []
        for offload in ((), OFFLOAD_MODULES):
            config = make_config(dtype, offload=offload, tensor_model_parallel_size=2, sequence_parallel=True)
            model = build(config)
            ids, labels = data()
            model_parallel_cuda_manual_seed(5)
            loss = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels)
            activation_offload.stats.reset()
            loss.sum().backward()
            runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        results.append(all(torch.equal(runs[0][1][n], g) for n, g in runs[1][1].items())
                       and torch.equal(runs[0][0], runs[1][0]) and activation_offload.stats.reloaded > 0)
    return results


def test_tensor_and_sequence_parallel():
    assert run_distributed(_tensor_parallel_ranks, 2) == [[True, True], [True, True]]


MICROBATCHES = 4


def _pipeline_ranks():
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    tokens = torch.randint(0, VOCAB, (MICROBATCHES, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    results, in_flight = [], []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        loss = model(batch[:, :-1], torch.arange(SEQ).expand(BATCH, SEQ), None, labels=batch[:, 1:])
        stats = activation_offload.stats
        in_flight.append(sum(stats.offloaded.values()) - stats.reloaded)
        return loss, lambda out: (out.mean(), {"lm loss": out.mean().detach()})

    for offload in ((), ("attn_norm", "core_attn", "attn_proj", "mlp")):
        config = make_config(offload=offload, num_layers=4, pipeline_model_parallel_size=2,
                             deallocate_pipeline_outputs=True, **NO_DROPOUT)
        model = build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        activation_offload.stats.reset()
        in_flight.clear()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(tokens), model=[model],
                                    num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=BATCH)
        stats = activation_offload.stats
        results.append(({n: p.grad for n, p in model.named_parameters()}, max(in_flight),
                        sum(stats.offloaded.values()), stats.reloaded))
    (reference, *_), (grads, most, offloaded, reloaded) = results
    identical = reference.keys() == grads.keys() and all(torch.equal(reference[n], g) for n, g in grads.items())
    return identical, most / offloaded * MICROBATCHES, offloaded == reloaded


def test_pipeline_1f1b_with_microbatches_in_flight():
    first, last = run_distributed(_pipeline_ranks, 2)
    # The first stage holds two micro-batches' offloaded activations at once under 1F1B, the last one.
    assert first == (True, 2.0, True) and last == (True, 1.0, True)


def test_config_and_flag_errors(capsys):
    with pytest.raises(ValueError, match=r"unknown entries \['attn'\]; choose from \['attn_norm'"):
        make_config(offload=["attn"])
    with pytest.raises(ValueError, match="needs offload_modules"):
        make_config(fine_grained_activation_offloading=True)
    with pytest.raises(ValueError, match="fine_grained_activation_offloading is False"):
        make_config(offload_modules=["mlp"])
    tiny = ["train", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--num-layers", "1",
            "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-3"]
    for flags, phrase in [(["--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "mlpp"],
                           "invalid choice: 'mlpp' (choose from 'attn_norm', 'qkv_linear'"),
                          (["--offload-modules", "mlp"], "is set but --fine-grained-activation-offloading is False"),
                          (["--fine-grained-activation-offloading"], "--fine-grained-activation-offloading needs --offload-modules")]:
        assert cli.main(tiny + flags) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("teratron: error: ") and phrase in err, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_memory_drops_and_gradients_equal():
    # The reference attention path: SDPA's flash backward is not deterministic, so two runs would
    # differ with or without offloading.
    shape = dict(num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=16, ffn_hidden_size=4096,
                 hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=False, attention_backend="unfused")
    seq, batch = 1024, 2
    ids = torch.randint(0, VOCAB, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    results = []
    for offload in ((), ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp")):
        config = make_config(torch.bfloat16, offload=offload, **shape)
        config.min_offloaded_tensor_size = 1024 * 1024
        torch.manual_seed(0)
        model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, seq, position_embedding_type="rope",
                         pg_collection=ProcessGroupCollection()).cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        activation_offload.stats.reset()
        loss = model(ids, torch.arange(seq, device="cuda").expand(batch, seq), None, labels=ids).sum()
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
        results.append((after_forward, torch.cuda.max_memory_allocated() - before, loss.detach(),
                        {n: p.grad for n, p in model.named_parameters()},
                        sum(activation_offload.stats.offloaded.values())))
        del model, loss
    (ref_fwd, ref_peak, ref_loss, ref_grads, _), (fwd, peak, loss, grads, offloaded) = results
    assert offloaded > 0.6 * ref_fwd  # most of what the layers keep
    assert fwd <= ref_fwd - 0.9 * offloaded  # it left the device after the forward
    assert peak < 0.7 * ref_peak
    assert torch.equal(loss, ref_loss)
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), name
