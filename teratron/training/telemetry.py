"""OpenTelemetry traces and metrics of a training run (Megatron's --otel-enabled, --otel-service-name,
--otel-span-groups), exported over OTLP/HTTP by the maintained OpenTelemetry packages
(`pip install teratron[otel]`). Where they send is the standard OTEL_EXPORTER_OTLP_* environment.

Spans, each in a span group (--otel-span-groups: a comma list of groups and presets):

    job              the whole training run (Trainer.train)
    model_init       building model, optimizer and scheduler
    load_checkpoint  --load
    checkpoint       each save
    evaluate         each validation / test evaluation
    step             one training iteration
    forward_backward the pipeline schedule of one step (every micro-batch's forward and backward)
    optimizer        the optimizer step (gradient clipping and the parameter update)
    microbatch       per micro-batch: `data` (fetching the batch) and `forward` (the forward pass);
                     its backward is the forward_backward span less the micro-batches' forwards

Metrics (the logging rank, every --log-interval): gauges `teratron.training.<key>` of the
metrics-file record (lm_loss, grad_norm, lr, tokens_per_sec, tflops_per_gpu, ...) and a counter of
skipped iterations. Off (the default) costs nothing: opentelemetry is not imported, `span` returns
one shared null context and `wrap` returns the function itself.
"""

import contextlib
import os
from typing import Optional

PRESETS = {
    "default": ("job", "checkpoint", "evaluate"),
    "per_step": ("job", "checkpoint", "evaluate", "model_init", "load_checkpoint", "step", "forward_backward",
                 "optimizer"),
}
GROUPS = PRESETS["per_step"] + ("microbatch",)
PRESETS["full"] = PRESETS["all"] = GROUPS
_SPAN_GROUP = {"data": "microbatch", "forward": "microbatch"}  # spans whose group is not their name


def span_groups(spec: Optional[str]) -> frozenset:
    """--otel-span-groups 'per_step,microbatch' -> the groups; None -> the default preset."""
    groups = set()
    for name in (spec or "default").split(","):
        name = name.strip()
        if name in PRESETS:
            groups.update(PRESETS[name])
        elif name in GROUPS:
            groups.add(name)
        else:
            raise ValueError(f"--otel-span-groups {spec}: unknown group {name!r}; use presets "
                             f"{', '.join(sorted(PRESETS))} or groups {', '.join(GROUPS)}")
    return frozenset(groups)


class NoTelemetry:
    """Telemetry off: every call is a no-op."""
    _NULL = contextlib.nullcontext()

    def span(self, name: str, **attributes):
        return self._NULL

    def wrap(self, name: str, function):
        return function

    def record_iteration(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


NO_TELEMETRY = NoTelemetry()


def otlp_exporters():
    """(span exporter, metric reader) over OTLP/HTTP (tests replace this with in-memory ones)."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    return OTLPSpanExporter(), PeriodicExportingMetricReader(OTLPMetricExporter())


class Telemetry:
    """Spans of the enabled groups and the iteration metrics, under one resource (service name,
    rank). Built by `build_telemetry`."""

    def __init__(self, service_name: str, groups: frozenset, rank: int):
        try:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise ImportError(f"--otel-enabled needs the OpenTelemetry packages ({e}); "
                              "pip install 'teratron[otel]'") from e
        self.groups = groups
        span_exporter, metric_reader = otlp_exporters()
        resource = Resource.create({"service.name": service_name, "teratron.rank": rank})
        self.tracer_provider = TracerProvider(resource=resource)
        self.tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        self.tracer = self.tracer_provider.get_tracer("teratron.training")
        self.meter_provider = MeterProvider(resource=resource, metric_readers=[metric_reader])
        self.meter = self.meter_provider.get_meter("teratron.training")
        self.gauges = {}
        self.skipped = self.meter.create_counter("teratron.training.skipped_iterations")

    def span(self, name: str, **attributes):
        if _SPAN_GROUP.get(name, name) not in self.groups:
            return NoTelemetry._NULL
        return self.tracer.start_as_current_span(name, attributes=attributes)

    def wrap(self, name: str, function):
        """`function` inside a span `name` (the function itself when its group is off)."""
        if _SPAN_GROUP.get(name, name) not in self.groups:
            return function

        def spanned(*args, **kwargs):
            with self.tracer.start_as_current_span(name):
                return function(*args, **kwargs)
        return spanned

    def record_iteration(self, record: dict) -> None:
        """A metrics-file record: each number a gauge, the skipped iterations a counter."""
        attributes = {"iteration": record["iteration"]}
        for key, value in record.items():
            if key in ("iteration", "skipped") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if key not in self.gauges:
                self.gauges[key] = self.meter.create_gauge(f"teratron.training.{key}")
            self.gauges[key].set(value, attributes)
        self.skipped.add(record.get("skipped", 0), attributes)

    def close(self) -> None:
        """Flush and stop both exporters (the end of the run)."""
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def build_telemetry(logging, rank: int):
    """Telemetry for a LoggingConfig: NO_TELEMETRY unless --otel-enabled (or MEGATRON_OTEL_ENABLED=1)."""
    enabled = logging.otel_enabled or os.environ.get("MEGATRON_OTEL_ENABLED", "") in ("1", "true", "True")
    if not enabled:
        return NO_TELEMETRY
    service = logging.otel_service_name or os.environ.get("OTEL_SERVICE_NAME") or "teratron"
    groups = span_groups(logging.otel_span_groups or os.environ.get("MEGATRON_OTEL_SPAN_GROUPS"))
    return Telemetry(service, groups, rank)
