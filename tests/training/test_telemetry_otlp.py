"""--otel-enabled against a real OTLP/HTTP endpoint: a `teratron train` subprocess, with the maintained
exporters and their flush at the end of the run, posts to a tiny collector in the test; the bodies
decode as the OTLP protobuf requests and carry the run's spans, service name and losses. An
unreachable collector costs the run at most the exporters' timeout and fails nothing."""

import json
import math
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (ExportMetricsServiceRequest,
                                                                          ExportMetricsServiceResponse)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)

from tests.training.test_telemetry import TINY

RESPONSES = {"/v1/traces": ExportTraceServiceResponse(), "/v1/metrics": ExportMetricsServiceResponse()}


class CollectorHandler(BaseHTTPRequestHandler):
    """Records (path, body) of each POST, then answers 200 with the signal's empty protobuf response."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        # recorded before the answer: once the exporter has its 200, the request is in `received`
        self.server.received.append((self.path, body))
        answer = RESPONSES[self.path].SerializeToString() if self.path in RESPONSES else b""
        self.send_response(200 if self.path in RESPONSES else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def collector():
    server = ThreadingHTTPServer(("127.0.0.1", 0), CollectorHandler)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(tmp_path, endpoint: str, flags: list, timeout: float = 120, **environment) -> subprocess.CompletedProcess:
    """`teratron train TINY flags` in a subprocess exporting to `endpoint`; OTEL_* of the outer shell dropped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MEGATRON_OTEL_"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OMP_NUM_THREADS="1", **environment)
    return subprocess.run([sys.executable, "-m", "teratron", "train", *TINY, "--eval-iters", "0", "--otel-enabled",
                           *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def attributes(key_values) -> dict:
    """OTLP KeyValue list -> {key: value}."""
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in key_values}


def test_a_run_posts_its_spans_and_metrics_to_an_otlp_http_collector(collector, tmp_path):
    metrics_file = tmp_path / "metrics.jsonl"
    run = train(tmp_path, f"http://127.0.0.1:{collector.server_port}",
                ["--otel-service-name", "tiny-otlp", "--otel-span-groups", "per_step,microbatch",
                 "--metrics-file", str(metrics_file)])
    assert run.returncode == 0, run.stderr
    assert {path for path, _ in collector.received} == {"/v1/traces", "/v1/metrics"}

    spans, span_resources = [], []
    for path, body in collector.received:
        if path == "/v1/traces":
            for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
                span_resources.append(attributes(resource_spans.resource.attributes))
                spans += [s for scope in resource_spans.scope_spans for s in scope.spans]
    assert {(r["service.name"], r["teratron.rank"]) for r in span_resources} == {("tiny-otlp", 0)}
    names = [s.name for s in spans]
    # --train-iters 4, micro-batch 1 of global batch 2: 2 micro-batches a step; no --save, --eval-iters 0
    assert sorted(names) == sorted(["job", "model_init"] + ["step", "forward_backward", "optimizer"] * 4
                                   + ["data", "forward"] * 8)
    (job,) = [s for s in spans if s.name == "job"]
    steps = [s for s in spans if s.name == "step"]
    assert sorted(attributes(s.attributes)["iteration"] for s in steps) == [1, 2, 3, 4]
    assert {s.parent_span_id for s in steps} == {job.span_id}
    assert {s.trace_id for s in steps} == {job.trace_id}

    *_, last_metrics = [body for path, body in collector.received if path == "/v1/metrics"]
    (resource_metrics,) = ExportMetricsServiceRequest.FromString(last_metrics).resource_metrics
    assert attributes(resource_metrics.resource.attributes)["service.name"] == "tiny-otlp"
    gauges = {m.name: m.gauge for scope in resource_metrics.scope_metrics for m in scope.metrics
              if m.WhichOneof("data") == "gauge"}
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    last = [r for r in records if "lm_loss" in r][-1]
    assert last["iteration"] == 4  # --log-interval 2
    for key in ("lm_loss", "grad_norm", "lr"):
        points = gauges[f"teratron.training.{key}"].data_points
        assert {attributes(p.attributes)["iteration"]: p.as_double for p in points}[4] == last[key]


def test_an_unreachable_collector_fails_nothing_and_costs_the_run_only_the_export_timeout(tmp_path):
    # OTEL_EXPORTER_OTLP_TIMEOUT=1 (default 10 s: the end of the run would wait ~7 s a signal retrying):
    # each exporter gives up after its timeout, so the subprocess' timeout is the hang guard
    metrics_file = tmp_path / "metrics.jsonl"
    run = train(tmp_path, f"http://127.0.0.1:{closed_port()}", ["--metrics-file", str(metrics_file)],
                timeout=60, OTEL_EXPORTER_OTLP_TIMEOUT="1")
    assert run.returncode == 0, run.stderr
    logged = [r for r in map(json.loads, metrics_file.read_text().splitlines()) if "lm_loss" in r]
    assert [r["iteration"] for r in logged] == [2, 4]
    assert all(math.isfinite(r["lm_loss"]) for r in logged)
    # both exporters tried, failed and said so, without failing the run
    assert "Failed to export spans batch" in run.stderr
    assert "Failed to export metrics batch" in run.stderr
