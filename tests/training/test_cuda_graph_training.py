"""CUDA graphs in `teratron train`: flags, validation, the warm-up steps, and (GPU only) the
full-iteration and per-layer graphs giving the eager run's losses through the training loop."""

import json

import pytest
import torch

from teratron import cli
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.pipeline_parallel.schedules import forward_backward_no_pipelining
from teratron.training.arguments import parse_train_args
from teratron.training.config import run_config_from_args
from teratron.training.full_iteration_graph import (FullIterationCudaGraph, LayerCudaGraphSteps, cuda_graph_phase,
                                                    training_forward_backward_func)
from teratron.transformer.cuda_graphs import NEED_CUDA
from teratron.transformer.transformer_config import TransformerConfig
from test_cli import NO_DROPOUT, TINY

def needs_cuda(test):
    """A GPU test: skipped without CUDA, and marked `gpu` so conftest.py leaves CUDA visible."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")(test))

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


def _run(argv):
    """The run description on a CUDA machine (with CPU-only runs refused in one line, below)."""
    return run_config_from_args(parse_train_args(BASE + argv), world_size=1, vocab_size=64, cuda=True)


def _config(argv):
    return _run(argv).transformer


def test_flags_reach_the_config():
    default = _config([])
    assert (default.cuda_graph_impl, default.cuda_graph_scope, default.cuda_graph_warmup_steps) == ("none", "full", 3)
    config = _config(NO_DROPOUT + ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration",
                                   "--cuda-graph-warmup-steps", "5"])
    assert (config.cuda_graph_impl, config.cuda_graph_scope, config.cuda_graph_warmup_steps) == (
        "local", "full_iteration", 5)
    with pytest.warns(UserWarning, match="enable_cuda_graph is deprecated"):
        assert _config(NO_DROPOUT + ["--enable-cuda-graph"]).cuda_graph_impl == "local"


@pytest.mark.parametrize("argv, message", [
    (NO_DROPOUT + ["--cuda-graph-impl", "local", "--use-distributed-optimizer", "--overlap-param-gather"],
     "--overlap-param-gather with --cuda-graph-impl local"),
    (NO_DROPOUT + ["--enable-cuda-graph", "--use-distributed-optimizer", "--overlap-param-gather"],
     "--overlap-param-gather with --cuda-graph-impl local"),
    (NO_DROPOUT + ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--overlap-grad-reduce"],
     "--overlap-grad-reduce with --cuda-graph-scope full_iteration"),
    (NO_DROPOUT + ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--rampup-batch-size", "2", "2", "8",
      "--global-batch-size", "8"], "--rampup-batch-size with --cuda-graph-scope full_iteration"),
    (["--cuda-graph-impl", "local"], "needs --attention-dropout=0"),
    (["--cuda-graph-impl", "transformer_engine"], "Transformer Engine, which teratron does not use"),
    (["--external-cuda-graph"], "--external-cuda-graph is deprecated"),
])
def test_flag_combinations_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        _config(argv)


@pytest.mark.parametrize("argv, scope, ddp_field", [
    (["--cuda-graph-impl", "local", "--overlap-grad-reduce"], "full", "overlap_grad_reduce"),  # hooks run after each layer
    (["--cuda-graph-scope", "full_iteration", "--cuda-graph-impl", "local", "--use-distributed-optimizer"],
     "full_iteration", "use_distributed_optimizer"),
])
def test_overlap_flags_stay_allowed_where_sound(argv, scope, ddp_field):
    run = _run(NO_DROPOUT + argv)
    assert (run.transformer.cuda_graph_impl, run.transformer.cuda_graph_scope) == ("local", scope)
    assert getattr(run.ddp, ddp_field)  # the data-parallel flag still reaches DDP


@pytest.mark.parametrize("flag", [["--cuda-graph-impl", "local"], ["--enable-cuda-graph"]])
def test_cpu_run_is_refused_in_one_line(flag, capsys):
    assert cli.main(["train"] + TINY + ["--train-iters", "3"] + flag) == 2
    assert capsys.readouterr().err == f"teratron: error: {NEED_CUDA}\n"


def test_warmup_steps_then_capture_then_replay():
    assert [cuda_graph_phase(n, 2) for n in range(5)] == ["eager", "eager", "capture", "replay", "replay"]
    assert [cuda_graph_phase(n, 0) for n in range(2)] == ["capture", "replay"]


def _tiny_gpt(**overrides):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True, **overrides)
    return GPTModel(config, get_gpt_layer_local_spec(), 64, 16)


def test_layer_graphs_are_switched_on_after_the_warmup_steps():
    model = _tiny_gpt(cuda_graph_impl="local")
    seen = []

    def schedule(*, model, **kwargs):
        seen.append((model[0].decoder.cuda_graphs.enabled, kwargs["num_microbatches"]))
        return []

    steps = LayerCudaGraphSteps(schedule, warmup_steps=2)
    for _ in range(4):
        steps(model=[model], num_microbatches=3)
    assert seen == [(False, 3), (False, 3), (True, 3), (True, 3)]


def test_the_training_step_function_follows_the_config():
    assert training_forward_backward_func([_tiny_gpt()]) is forward_backward_no_pipelining
    layer = training_forward_backward_func([_tiny_gpt(cuda_graph_impl="local", cuda_graph_warmup_steps=4)])
    assert isinstance(layer, LayerCudaGraphSteps) and layer.warmup_steps == 4
    assert layer.forward_backward_func is forward_backward_no_pipelining
    full = training_forward_backward_func([_tiny_gpt(cuda_graph_impl="local", cuda_graph_scope="full_iteration")])
    assert isinstance(full, FullIterationCudaGraph) and full.warmup_steps == 3


def test_full_iteration_graph_refuses_cpu_models_and_evaluation():
    graph = FullIterationCudaGraph(forward_backward_no_pipelining, warmup_steps=1)
    model = _tiny_gpt(cuda_graph_impl="local", cuda_graph_scope="full_iteration")
    kwargs = dict(forward_step_func=None, data_iterator=iter([]), model=[model], num_microbatches=1,
                  seq_length=16, micro_batch_size=2)
    with pytest.raises(ValueError, match=f"^{NEED_CUDA}$"):
        graph(**kwargs)
    with pytest.raises(ValueError, match="evaluate with the schedule"):
        graph(**kwargs, forward_only=True)


# ----- GPU: through the training loop ------------------------------------------------------------

def _train_losses(tmp_path, name, extra):
    path = tmp_path / f"{name}.jsonl"
    # Eager layers in every run (the CUDA default compiles them; graphs replay eager layers).
    argv = TINY + NO_DROPOUT + ["--attention-backend", "unfused", "--train-iters", "5", "--eval-iters", "0",
                                "--no-torch-compile", "--no-gradient-accumulation-fusion",
                                "--metrics-file", str(path)] + extra
    assert cli.main(["train"] + argv) == 0, name
    with open(path) as f:
        records = [json.loads(line) for line in f]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
    return [value for r in records for value in (r["lm_loss"], r["grad_norm"])]


@needs_cuda
def test_full_iteration_graph_trains_like_eager(tmp_path):
    eager = _train_losses(tmp_path, "eager", [])
    graphed = _train_losses(tmp_path, "full-iteration", ["--cuda-graph-impl", "local", "--cuda-graph-scope",
                                                         "full_iteration", "--cuda-graph-warmup-steps", "2"])
    assert graphed == pytest.approx(eager, rel=1e-6, abs=1e-6)


@needs_cuda
def test_layer_graphs_train_like_eager_in_bf16(tmp_path):
    bf16 = ["--bf16", "--accumulate-allreduce-grads-in-fp32"]
    eager = _train_losses(tmp_path, "eager-bf16", bf16)
    graphed = _train_losses(tmp_path, "layer-graphs-bf16", bf16 + ["--cuda-graph-impl", "local",
                                                                   "--cuda-graph-warmup-steps", "2"])
    assert graphed == pytest.approx(eager, rel=1e-6, abs=1e-6)
