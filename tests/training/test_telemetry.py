"""--otel-enabled (teratron.training.telemetry): a tiny run's spans nest as documented (job > step >
forward_backward > data/forward, step > optimizer, evaluate, checkpoint), one per iteration,
micro-batch, evaluation and save; the gauges carry the metrics file's values; --otel-span-groups
picks the groups; without the flag opentelemetry is not even imported."""

import json
import subprocess
import sys

import pytest
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from teratron.training import telemetry
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.training import pretrain

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "1",
        "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--lr", "1e-3", "--log-interval", "2", "--num-workers", "0",
        "--no-progress-bar", "--train-iters", "4"]


class CollectedMetrics(MetricExporter):
    def __init__(self):
        super().__init__()
        self.batches = []

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        self.batches.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        pass

    def points(self, name):
        """(iteration, value) of every exported point of metric `name`."""
        return [(dict(p.attributes)["iteration"], p.value) for batch in self.batches
                for resource in batch.resource_metrics for scope in resource.scope_metrics
                for metric in scope.metrics if metric.name == name for p in metric.data.data_points]


@pytest.fixture
def exported(monkeypatch):
    spans, metrics = InMemorySpanExporter(), CollectedMetrics()
    monkeypatch.setattr(telemetry, "otlp_exporters", lambda: (spans, PeriodicExportingMetricReader(metrics)))
    return spans, metrics


def test_spans_nest_and_count_one_per_iteration_micro_batch_evaluation_and_save(exported, tmp_path):
    spans, metrics = exported
    metrics_file = tmp_path / "metrics.jsonl"
    pretrain(build_run_config(parse_train_args(TINY + [
        "--otel-enabled", "--otel-service-name", "tiny", "--otel-span-groups", "per_step,microbatch",
        "--eval-interval", "2", "--eval-iters", "1", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
        "--metrics-file", str(metrics_file)]), 1))
    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}

    def named(name):
        return [s for s in finished if s.name == name]

    def parent(s):
        return by_id[s.parent.span_id].name if s.parent is not None else None

    assert {s.resource.attributes["service.name"] for s in finished} == {"tiny"}
    assert [parent(s) for s in named("job")] == [None]
    assert [parent(s) for s in named("model_init")] == [None]
    assert [s.attributes["iteration"] for s in named("step")] == [1, 2, 3, 4]
    assert {parent(s) for s in named("step")} == {"job"}
    assert [parent(s) for s in named("forward_backward")] == ["step"] * 4
    assert [parent(s) for s in named("optimizer")] == ["step"] * 4
    # validation at iterations 2 and 4 (none again at the end), the test split once at the end
    assert [s.attributes["iteration"] for s in named("evaluate")] == [2, 4, 4]
    assert [s.attributes["iteration"] for s in named("checkpoint")] == [2, 4]
    # 2 micro-batches per step and per evaluation batch (global batch 2, micro-batch 1)
    expected_parents = sorted(["forward_backward"] * 8 + ["evaluate"] * 6)
    assert sorted(parent(s) for s in named("forward")) == expected_parents
    assert sorted(parent(s) for s in named("data")) == expected_parents
    assert named("load_checkpoint") == []  # no --load

    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    logged = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in logged] == [2, 4]
    for key in ("lm_loss", "grad_norm", "tokens_per_sec", "lr"):
        assert metrics.points(f"teratron.training.{key}")[-1] == (4, logged[-1][key])
    assert sum(value for _, value in metrics.points("teratron.training.skipped_iterations")) == 0


def test_resume_has_a_load_span_and_the_default_groups_only_coarse_spans(exported, tmp_path):
    spans, _ = exported
    save = str(tmp_path / "ckpt")
    pretrain(build_run_config(parse_train_args(TINY + ["--eval-iters", "0", "--save", save]), 1))
    assert spans.get_finished_spans() == ()  # telemetry off
    pretrain(build_run_config(parse_train_args(TINY + [
        "--eval-iters", "0", "--load", save, "--save", save, "--train-iters", "6", "--override-opt_param-scheduler",
        "--otel-enabled",
        "--otel-span-groups", "load_checkpoint,default"]), 1))
    assert sorted(s.name for s in spans.get_finished_spans()) == ["checkpoint", "job", "load_checkpoint"]


def test_span_groups_expand_presets_and_refuse_unknown_names():
    assert telemetry.span_groups(None) == {"job", "checkpoint", "evaluate"}
    assert telemetry.span_groups("default,step") == {"job", "checkpoint", "evaluate", "step"}
    assert telemetry.span_groups("all") == set(telemetry.GROUPS)
    with pytest.raises(ValueError, match=r"^--otel-span-groups step,layers: unknown group 'layers'; use presets"):
        build_run_config(parse_train_args(TINY + ["--otel-span-groups", "step,layers"]), 1)


def test_the_otlp_exporters_are_the_maintained_packages():
    span_exporter, reader = telemetry.otlp_exporters()
    assert type(span_exporter).__module__ == "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    assert type(reader._exporter).__module__ == "opentelemetry.exporter.otlp.proto.http.metric_exporter"
    reader.shutdown()


def test_a_run_without_the_flag_does_not_import_opentelemetry(tmp_path):
    code = ("import sys\nfrom teratron.training.arguments import parse_train_args\n"
            "from teratron.training.config import build_run_config\nfrom teratron.training.training import pretrain\n"
            f"pretrain(build_run_config(parse_train_args({TINY + ['--eval-iters', '0']!r}), 1))\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.splitlines()[-1] == "[]"
