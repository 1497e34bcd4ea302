"""Per-layer CUDA graphs (cuda_graph_impl='local', scope 'full') and the config rules of local graphs.

CPU: validation, which blocks hold layer graphs, switching them on, evaluation staying eager.
GPU (skipped without CUDA): a tiny DDP-wrapped GPT trained 3 steps (2 micro-batches each, one
eager warm-up step, then capture and replay) gives the eager run's losses and every main_grad,
in fp32 and bf16; micro-batches in flight together get captures of their own.
"""

import dataclasses
import warnings
from functools import partial

import pytest
import torch

from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.pipeline_parallel.schedules import forward_backward_no_pipelining
from teratron.training.full_iteration_graph import LayerCudaGraphSteps
from teratron.training.gpt_step import forward_step, reduce_log_dicts
from teratron.transformer.cuda_graphs import NEED_CUDA, LayerCudaGraphs, enable_layer_cuda_graphs
from teratron.transformer.enums import AttnBackend
from teratron.transformer.transformer_config import TransformerConfig

def needs_cuda(test):
    """A GPU test: skipped without CUDA, and marked `gpu` so conftest.py leaves CUDA visible."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")(test))

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
            hidden_dropout=0.0, attention_dropout=0.0)
LOCAL = dict(cuda_graph_impl="local")
VOCAB, SEQ, MBS = 64, 16, 2


def _config(**overrides):
    return TransformerConfig(**{**BASE, **overrides})


# ----- config rules -----------------------------------------------------------------------------

ERRORS = [
    (dict(cuda_graph_impl="bogus"), r"^cuda_graph_impl='bogus' is not valid"),
    (dict(cuda_graph_scope="layer"), r"^cuda_graph_scope='layer' is not valid"),
    (dict(cuda_graph_impl="transformer_engine"), "Transformer Engine, which teratron does not use"),
    (dict(external_cuda_graph=True), "external_cuda_graph is deprecated"),
    (dict(enable_cuda_graph=True, cuda_graph_impl="local"), "set only cuda_graph_impl"),
    (dict(cuda_graph_scope="full_iteration"), r"full_iteration' needs cuda_graph_impl='local'"),
    (dict(LOCAL, cuda_graph_scope="attn"), "Transformer Engine's attention-only capture"),
    (dict(cuda_graph_warmup_steps=-1), "cuda_graph_warmup_steps must be >= 0"),
    (dict(LOCAL, recompute_granularity="selective"), "does not support activation recompute"),
    (dict(LOCAL, attention_dropout=0.1), "needs attention_dropout=0"),
    (dict(LOCAL, hidden_dropout=0.1, sequence_parallel=True, tensor_model_parallel_size=2),
     "with sequence_parallel needs hidden_dropout=0"),
    (dict(LOCAL, num_moe_experts=4), "does not support MoE layers"),
    (dict(LOCAL, fp8="hybrid", bf16=True, params_dtype=torch.bfloat16), "is not combined with fp8"),
    (dict(LOCAL, fine_grained_activation_offloading=True, offload_modules=["mlp"]),
     "does not support fine_grained_activation_offloading"),
    (dict(LOCAL, gradient_accumulation_fusion=True), "does not support gradient_accumulation_fusion"),
    (dict(LOCAL, cuda_graph_scope="full_iteration", pipeline_model_parallel_size=2),
     "full_iteration' needs pipeline_model_parallel_size=1"),
    (dict(LOCAL, cuda_graph_scope="full_iteration", cuda_graph_warmup_steps=0),
     "full_iteration' needs cuda_graph_warmup_steps >= 1"),
    (dict(LOCAL, enable_autocast=True), "does not support enable_autocast"),
    (dict(LOCAL, cuda_graph_use_single_mempool=True, pipeline_model_parallel_size=2),
     "cuda_graph_use_single_mempool=True with pipeline parallelism"),
]


@pytest.mark.parametrize("overrides, message", ERRORS)
def test_unsound_settings_raise(overrides, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation / SP notices are not what is tested
        with pytest.raises(ValueError, match=message):
            _config(**overrides)


SOUND = [  # (settings, whether the GPT's decoder then holds per-layer graphs)
    (dict(LOCAL, hidden_dropout=0.1), True),  # the default generator is graph-safe
    (dict(LOCAL, cuda_graph_scope="full_iteration", enable_autocast=True), False),  # the step is captured whole
    (dict(LOCAL, cuda_graph_use_single_mempool=True, cuda_graph_warmup_steps=0), True),
    (dict(LOCAL, pipeline_model_parallel_size=2), True),
    (dict(cuda_graph_scope="attn"), False),  # impl 'none': nothing is captured, so nothing is refused
    (dict(attention_dropout=0.1), False),
]


@pytest.mark.parametrize("overrides, layer_graphs", SOUND)
def test_sound_settings_build(overrides, layer_graphs):
    config = _config(**overrides, use_cpu_initialization=True)
    assert {name: getattr(config, name) for name in overrides} == overrides  # kept as asked, not rewritten
    # One process has no pipeline group of 2 to build a stage with (GPTModel checks the sizes
    # against its groups); which layers hold graphs does not depend on the stage count.
    stage_config = dataclasses.replace(config, pipeline_model_parallel_size=1)
    assert isinstance(_gpt(stage_config).decoder.cuda_graphs, LayerCudaGraphs) == layer_graphs


def test_enable_cuda_graph_is_the_deprecated_local_switch():
    with pytest.warns(UserWarning, match="enable_cuda_graph is deprecated"):
        config = _config(enable_cuda_graph=True)
    assert (config.cuda_graph_impl, config.enable_cuda_graph) == ("local", False)


# ----- which blocks hold graphs ------------------------------------------------------------------

def _gpt(config, seed=0):
    torch.manual_seed(seed)
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")


def test_only_local_full_scope_blocks_hold_layer_graphs():
    graphed = _gpt(_config(**LOCAL, use_cpu_initialization=True))
    assert isinstance(graphed.decoder.cuda_graphs, LayerCudaGraphs)
    assert list(graphed.decoder.cuda_graphs.layers) == list(graphed.decoder.layers)
    plain = _gpt(_config(use_cpu_initialization=True))
    iteration = _gpt(_config(**LOCAL, cuda_graph_scope="full_iteration", use_cpu_initialization=True))
    assert plain.decoder.cuda_graphs is None and iteration.decoder.cuda_graphs is None
    # The graphs are no module: names, parameters and weights are those of the plain model.
    assert graphed.state_dict().keys() == plain.state_dict().keys()
    for a, b in zip(graphed.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_graphs_are_off_until_enabled_and_only_in_training():
    models = [_gpt(_config(**LOCAL, use_cpu_initialization=True)), _gpt(_config(use_cpu_initialization=True))]
    graphs = models[0].decoder.cuda_graphs
    assert not graphs.active(training=True)
    assert enable_layer_cuda_graphs(models) == 1
    assert graphs.active(training=True) and not graphs.active(training=False)
    with torch.no_grad():
        assert not graphs.active(training=True)


def test_eager_until_enabled_then_cpu_tensors_are_refused():
    graphed, plain = _gpt(_config(**LOCAL, use_cpu_initialization=True)), _gpt(_config(use_cpu_initialization=True))
    ids = torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(SEQ).expand(MBS, SEQ)
    assert torch.equal(graphed(ids, pos, labels=ids), plain(ids, pos, labels=ids))
    enable_layer_cuda_graphs([graphed])
    graphed.eval()
    assert torch.equal(graphed(ids, pos, labels=ids), plain.eval()(ids, pos, labels=ids))
    graphed.train()
    with pytest.raises(ValueError, match=f"^{NEED_CUDA}$"):
        graphed(ids, pos, labels=ids)


# ----- GPU: graphs against eager ----------------------------------------------------------------

def _ddp_gpt(dtype, **overrides):
    """A tiny GPT on the GPU in DDP (fp32 main grads), with the hooks the schedule calls."""
    config = _config(bf16=dtype == torch.bfloat16, params_dtype=dtype,
                     attention_backend=AttnBackend.unfused, **overrides)  # a deterministic kernel
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                    _gpt(config).cuda())
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model


def _batches(steps, microbatches):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (steps, microbatches, MBS, SEQ + 1), generator=g)
    return [[dict(tokens=t[:, :-1], labels=t[:, 1:], loss_mask=torch.ones(MBS, SEQ),
                  position_ids=torch.arange(SEQ).expand(MBS, SEQ)) for t in step] for step in tokens]


def _train(model, batches, forward_backward, lr=0.1):
    """Steps of gradient accumulation and plain SGD; (losses, main grads) per step."""
    losses, grads = [], []
    for step in batches:
        model.zero_grad_buffer()
        logs = forward_backward(forward_step_func=partial(forward_step, device="cuda"),
                                data_iterator=iter(step), model=model, num_microbatches=len(step),
                                seq_length=SEQ, micro_batch_size=MBS)
        losses.append(reduce_log_dicts(logs, "cuda")["lm loss"])
        grads.append([p.main_grad.clone() for p in model.module.parameters()])
        with torch.no_grad():
            for p in model.module.parameters():
                p.sub_(lr * p.main_grad.to(p.dtype))  # in place: the graphs hold the addresses
    return losses, grads


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_graphs_equal_eager_over_three_steps(dtype):
    batches = _batches(steps=3, microbatches=2)
    eager = _train(_ddp_gpt(dtype), batches, forward_backward_no_pipelining)
    model = _ddp_gpt(dtype, **LOCAL, cuda_graph_warmup_steps=1)
    graphed = _train(model, batches, LayerCudaGraphSteps(forward_backward_no_pipelining, warmup_steps=1))
    # Steps 2 and 3 replayed one capture, reused by both micro-batches of each step.
    captures = model.module.decoder.cuda_graphs.captures
    assert [len(c) for c in captures.values()] == [1]
    if dtype == torch.float32:
        assert graphed[0] == pytest.approx(eager[0], rel=1e-6, abs=1e-6)
    else:  # the same kernels on the same inputs: bitwise
        assert graphed[0] == eager[0]
    for step_grads, eager_grads in zip(graphed[1], eager[1]):
        for g, e in zip(step_grads, eager_grads):
            if dtype == torch.float32:
                torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(g, e)


@needs_cuda
def test_micro_batches_in_flight_get_captures_of_their_own():
    """Two forwards before their backwards (what a pipeline schedule does) must not share graphs."""
    (step,) = _batches(steps=1, microbatches=2)

    def run(model):
        model.zero_grad_buffer()
        losses = [model(b["tokens"].cuda(), b["position_ids"].cuda(), labels=b["labels"].cuda()).sum()
                  for b in step]
        for loss in reversed(losses):
            loss.backward()
        return [p.main_grad.clone() for p in model.module.parameters()]

    eager = run(_ddp_gpt(torch.float32))
    model = _ddp_gpt(torch.float32, **LOCAL)
    enable_layer_cuda_graphs([model])
    run(model)  # captures
    graphed = run(model)  # replays
    assert [len(c) for c in model.module.decoder.cuda_graphs.captures.values()] == [2]
    for g, e in zip(graphed, eager):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
