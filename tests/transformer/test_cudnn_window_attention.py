"""cuDNN's native sliding window (teratron/transformer/cudnn_window_attention.py) without a GPU:
Megatron's window as cuDNN's band bound, which inputs it accepts, that DotProductAttention routes
a causal window there when it can run (available() stood in for on the CPU), and that nothing
imports the frontend (`cudnn`) on the CPU. The kernels themselves: test_cudnn_window_attention_gpu.py."""

import os
import subprocess
import sys
import types

import pytest
import torch

from teratron.tensor_parallel.random import model_parallel_cuda_manual_seed
from teratron.transformer import cudnn_window_attention
from teratron.transformer.attention_masks import allowed_keys
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.enums import AttnMaskType
from teratron.transformer.transformer_config import TransformerConfig

HOPPER, AMPERE = (9, 0), (8, 0)


@pytest.mark.parametrize("s, window", [(16, 0), (16, 3), (16, 14), (16, 15), (16, 40), (16, -1), (1, 0)])
def test_the_band_bound_keeps_exactly_the_window(s, window):
    """cuDNN's band (top-left diagonal, right bound 0, left bound L masking the keys at or before
    column i - L, none when L is None, as its documentation defines it) equals Megatron's causal
    window (keys i - W .. i) for every (query, key) pair."""
    bound = cudnn_window_attention.left_bound(window, s)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    band = j <= i
    if bound is not None:
        band &= j > i - bound
    torch.testing.assert_close(band, allowed_keys(i, j, True, (window, 0)))


def test_band_bound_values():
    assert cudnn_window_attention.left_bound(1024, 16384) == 1025
    assert cudnn_window_attention.left_bound(0, 10) == 1  # the query alone: cuDNN's smallest bound
    assert cudnn_window_attention.left_bound(8, 10) == 9
    assert cudnn_window_attention.left_bound(9, 10) is None  # every causal key: plain causal
    assert cudnn_window_attention.left_bound(-1, 10) is None


def _qkv(n=8, g=2, s=64, hq=128, hv=None, dtype=torch.bfloat16, sk=None):
    return (torch.empty(1, n, s, hq, dtype=dtype), torch.empty(1, g, sk or s, hq, dtype=dtype),
            torch.empty(1, g, sk or s, hv or hq, dtype=dtype))


@pytest.mark.parametrize("inputs, capability, expected", [
    (dict(), HOPPER, True),
    (dict(dtype=torch.float16), AMPERE, True),
    (dict(hq=64, g=1), AMPERE, True),                # multi-query
    (dict(hq=256), HOPPER, True),
    (dict(hq=256), AMPERE, False),                   # backward up to 128 before Hopper
    (dict(hq=192, hv=128), HOPPER, True),            # MLA's heads
    (dict(hq=192, hv=128), AMPERE, False),
    (dict(hq=128, hv=64), HOPPER, False),
    (dict(hq=100), HOPPER, False),                   # not a multiple of 8
    (dict(hq=264), HOPPER, False),
    (dict(dtype=torch.float32), HOPPER, False),
    (dict(g=3), HOPPER, False),                      # groups must divide the heads
    (dict(sk=32), HOPPER, False),                    # cross-attention lengths
    (dict(), (7, 5), False),
])
def test_fits(inputs, capability, expected):
    assert cudnn_window_attention.fits(*_qkv(**inputs), (128, 0), True, 0.0, None, capability) is expected


def test_fits_needs_a_causal_window_without_dropout_or_sink():
    q, k, v = _qkv()
    fits = cudnn_window_attention.fits
    assert fits(q, k, v, (128, 0), True, 0.0, None, HOPPER)
    assert fits(q, k, v, (128, -1), True, 0.0, None, HOPPER)  # the right side: hidden by causality
    assert not fits(q, k, v, None, True, 0.0, None, HOPPER)
    assert not fits(q, k, v, (128, 0), False, 0.0, None, HOPPER)
    assert not fits(q, k, v, (128, 0), True, 0.1, None, HOPPER)
    assert not fits(q, k, v, (128, 0), True, 0.0, torch.zeros(8), HOPPER)


def test_not_available_on_the_cpu():
    assert not cudnn_window_attention.available(*_qkv(), (128, 0), True, 0.0, None)


def test_nothing_imports_the_frontend_on_the_cpu():
    """A windowed layer's forward and backward on the CPU (banded and reference paths) leave
    `cudnn` unimported, whether or not the frontend is installed."""
    script = """
import sys
import types
import torch
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.transformer_config import TransformerConfig
for window in ((256, 0), (8, 0)):
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, window_size=window, attention_dropout=0.0,
                               use_cpu_initialization=True)
    q = torch.randn(300, 1, 4, 16, requires_grad=True)
    k, v = (torch.randn(300, 1, 2, 16, requires_grad=True) for _ in range(2))
    DotProductAttention(config, layer_number=1)(q, k, v).sum().backward()
assert "cudnn" not in sys.modules, sorted(m for m in sys.modules if m.startswith("cudnn"))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.fixture
def cudnn_calls(monkeypatch):
    """DotProductAttention on the CPU as on a Hopper GPU with the frontend: `available` is `fits`
    at capability 9.0, and the kernel records its window and scale (and returns zeros)."""
    calls = []

    def kernel(q, k, v, window_left, scale):
        calls.append((window_left, scale))
        return torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, requires_grad=True)
    monkeypatch.setattr(cudnn_window_attention, "available",
                        lambda *args: cudnn_window_attention.fits(*args, HOPPER))
    monkeypatch.setattr(cudnn_window_attention, "cudnn_window_attention", kernel)
    return calls


def _run(backend="auto", window=(300, 0), softmax_type="vanilla", mask_type=AttnMaskType.causal,
         dtype=torch.bfloat16, attention_dropout=0.0, attention_mask=None):
    config = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=4, num_query_groups=2,
                               kv_channels=128, window_size=window, softmax_type=softmax_type,
                               attention_backend=backend, attention_dropout=attention_dropout, hidden_dropout=0.0,
                               params_dtype=dtype, use_cpu_initialization=True)
    attention = DotProductAttention(config, layer_number=1, attn_mask_type=mask_type)
    model_parallel_cuda_manual_seed(0)  # attention dropout draws from the tensor-parallel tracker
    q = torch.randn(40, 2, 4, 128, dtype=dtype)
    k, v = (torch.randn(40, 2, 2, 128, dtype=dtype) for _ in range(2))
    attention(q, k, v, attention_mask=attention_mask)
    return attention


@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_a_causal_window_runs_on_cudnn_where_available(cudnn_calls, backend):
    attention = _run(backend, window=(300, 0))
    assert cudnn_calls == [(300, attention.softmax_scale)]
    _run(backend, window=(7, -1))
    assert cudnn_calls[-1][0] == 7


@pytest.mark.parametrize("case", ["flash", "unfused", "local", "sink", "off-by-one sink", "dropout", "not causal",
                                  "explicit mask", "no window", "fp32"])
def test_other_layers_do_not_run_on_cudnn(cudnn_calls, case):
    kwargs = {
        "flash": dict(backend="flash"), "unfused": dict(backend="unfused"), "local": dict(backend="local"),
        "sink": dict(softmax_type="learnable"), "off-by-one sink": dict(softmax_type="off-by-one"),
        "dropout": dict(attention_dropout=0.1), "not causal": dict(mask_type=AttnMaskType.no_mask),
        "explicit mask": dict(mask_type=AttnMaskType.padding_causal,
                              attention_mask=torch.zeros(2, 1, 40, 40, dtype=torch.bool)),
        "no window": dict(window=None), "fp32": dict(dtype=torch.float32),
    }[case]
    attention = _run(**kwargs)
    assert cudnn_calls == []
    if case == "dropout":  # not in training: no dropout, cuDNN
        attention.eval()
        q = torch.randn(40, 2, 4, 128, dtype=torch.bfloat16)
        attention(q, q[:, :, :2], q[:, :, :2])
        assert cudnn_calls == [(300, attention.softmax_scale)]


def test_the_fastest_plan_that_runs_is_chosen():
    times = {0: 1.2, 1: RuntimeError("not supported"), 2: 0.9, 3: 1.0}

    def time_plan(index):
        if isinstance(times[index], Exception):
            raise times[index]
        return times[index]

    assert cudnn_window_attention.fastest_plan(4, time_plan) == 2
    assert cudnn_window_attention.fastest_plan(2, lambda index: [0.5, 0.4][index]) == 1
    assert cudnn_window_attention.fastest_plan(0, time_plan) is None


class _StandInGraph:
    """What `_build` calls of a cuDNN graph, recorded."""

    def __init__(self, plans):
        self.calls, self.plans = [], plans

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            return self.plans if name == "get_execution_plan_count" else None
        return call


@pytest.fixture
def stand_in_cudnn(monkeypatch):
    """`_build` on the CPU: a stand-in frontend and graph, plan i timed at [3, 1, 2][i] ms."""
    graphs = []

    def operation_graph(*args):
        graphs.append(_StandInGraph(3))
        return graphs[-1], {"q": "q"}

    frontend = types.SimpleNamespace(heur_mode=types.SimpleNamespace(A="A", B="B", FALLBACK="F"),
                                     build_plan_policy=types.SimpleNamespace(ALL="all"))
    monkeypatch.setattr(cudnn_window_attention, "_cudnn", lambda: frontend)
    monkeypatch.setattr(cudnn_window_attention, "_operation_graph", operation_graph)
    monkeypatch.setattr(cudnn_window_attention, "_time_plan", lambda graph, pack, index, device: [3, 1, 2][index])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CUDA query
    return graphs


def test_the_band_runs_its_fastest_plan_unless_runs_must_not_depend_on_timing(stand_in_cudnn, monkeypatch):
    tensors = {"q": torch.zeros(1)}
    graph, _, plan = cudnn_window_attention._build("forward", 9, 0.1, False, tensors)
    assert plan == 1 and "build_plans" in graph.calls and "build" not in graph.calls
    graph, _, plan = cudnn_window_attention._build("backward", 9, 0.1, True, tensors)  # deterministic
    assert plan is None and graph.calls == ["build"]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # no timing in a capture
    graph, _, plan = cudnn_window_attention._build("forward", 9, 0.1, False, tensors)
    assert plan is None and graph.calls == ["build"]


def test_a_failed_timing_falls_back_to_the_heuristics_plan(stand_in_cudnn, monkeypatch):
    def broken(graph, pack, index, device):
        raise RuntimeError("cudnn says no")

    monkeypatch.setattr(cudnn_window_attention, "_time_plan", broken)
    monkeypatch.setattr(cudnn_window_attention, "fastest_plan", lambda count, time_plan: time_plan(0))
    with pytest.warns(UserWarning, match="timing its plans failed .*cudnn says no.*heuristic's plan"):
        graph, _, plan = cudnn_window_attention._build("forward", 9, 0.1, False, {"q": torch.zeros(1)})
    assert plan is None and graph.calls == ["build"] and len(stand_in_cudnn) == 2  # a fresh graph
