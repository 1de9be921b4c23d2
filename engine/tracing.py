"""Distributed traces: one OpenTelemetry trace per request across router -> LB -> P -> D.

Owns the `--otlp-endpoint` flags, each process's tracer (OTLP/gRPC behind a batch
processor, flushed at shutdown), W3C trace context in and out of HTTP headers and gRPC
metadata, and a process's request span: opened when the request arrives (its id travels
on), closed with one child per stage stamp pair when its part ends (docs/tracing.md).
Never: costs anything when off (no endpoint: no SDK import, every call returns at once),
blocks a request on the collector (the batch queue drops), or trusts a trace context for
more than parentage (it is client input).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, Field

log = logging.getLogger("pdunit.tracing")

TRACE_HEADERS = ("traceparent", "tracestate")

# Spans a process builds from its stamps: (span name, start stamp, end stamp). A stage
# whose two stamps are not both present (the request failed before it) has no span.
LB_STAGES: tuple[tuple[str, str, str], ...] = (
    ("lb.validate", "lb_received", "lb_validated"),
    ("lb.first_frame", "lb_submitted", "lb_first_frame_out"),
    ("lb.stream_out", "lb_first_frame_out", "lb_last_frame_out"),
)
PREFILL_STAGES: tuple[tuple[str, str, str], ...] = (
    ("prefill.queue", "p_admitted", "prefill_start"),
    ("prefill.forward", "prefill_start", "prefill_end"),
    ("prefill.transfer", "transfer_start", "transfer_end"),
)
DECODE_STAGES: tuple[tuple[str, str, str], ...] = (
    ("decode.await_commit", "d_reserved", "d_committed"),
    ("decode.first_frame", "d_committed", "first_frame_step"),
    ("decode.frames", "first_frame_step", "last_frame_step"),
)


class TracingFields(BaseModel):
    """The flags of every process that traces (router, LB, P, D, the monolith)."""

    otlp_endpoint: str = Field(
        "", description="OTLP/gRPC collector to send traces to (host:port or http://host:port); '' = no traces"
    )


class Span:
    """A process's span of one request: its context travels on; `end` closes it."""

    def __init__(self, span: Any, tracing: Tracing) -> None:
        self._span = span
        self._tracing = tracing

    def headers(self) -> dict[str, str]:
        """W3C trace context naming this span as the parent (HTTP headers)."""
        from opentelemetry import trace
        from opentelemetry.propagate import inject

        carrier: dict[str, str] = {}
        inject(carrier, context=trace.set_span_in_context(self._span))
        return carrier

    def metadata(self) -> list[tuple[str, str]]:
        """The same as gRPC metadata."""
        return list(self.headers().items())

    def end(self, stamps: Mapping[str, int], stages: Sequence[tuple[str, str, str]],
            end_ns: int, error: str = "", **attributes: Any) -> None:
        """Close the span at `end_ns` with one child per stamped stage."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        ctx = trace.set_span_in_context(self._span)
        for name, start, stop in stages:
            if start in stamps and stop in stamps and stamps[stop] >= stamps[start]:
                child = self._tracing.tracer.start_span(name, context=ctx, start_time=int(stamps[start]))
                child.end(end_time=int(stamps[stop]))
        for key, value in attributes.items():
            self._span.set_attribute(f"pdunit.{key}", value)
        if error:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end(end_time=int(end_ns))


class Tracing:
    """One process's tracer; `enabled` False (no endpoint) makes every call a no-op."""

    def __init__(self, service: str, endpoint: str, instance: str = "", exporter: Any = None) -> None:
        """`exporter`: a span exporter to use instead of OTLP (tests)."""
        self.enabled = bool(endpoint) or exporter is not None
        self.tracer: Any = None
        self._provider: Any = None
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            target = endpoint if "://" in endpoint else f"http://{endpoint}"
            exporter = OTLPSpanExporter(endpoint=target, insecure=target.startswith("http://"))
        attrs = {"service.name": f"pdunit-{service}", "service.namespace": "pdunit"}
        if instance:
            attrs["service.instance.id"] = instance
        self._provider = TracerProvider(resource=Resource.create(attrs))
        # a short delay: a request's spans reach the collector about when it ends
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer = self._provider.get_tracer("pdunit")
        log.info("tracing on", extra={"service": attrs["service.name"], "otlp_endpoint": endpoint or "(in memory)"})

    def start(self, name: str, start_ns: int, parent: Iterable[tuple[str, str]] | Mapping[str, str] | None,
              **attributes: Any) -> Span | None:
        """A request span starting at `start_ns`, a child of the W3C context in `parent`
        (HTTP headers or gRPC metadata; a new trace without one); None when off."""
        if not self.enabled:
            return None
        from opentelemetry.propagate import extract

        carrier = {k.lower(): v for k, v in (parent.items() if isinstance(parent, Mapping) else parent or ())
                   if k.lower() in TRACE_HEADERS and isinstance(v, str)}
        span = self.tracer.start_span(name, context=extract(carrier), start_time=int(start_ns),
                                      attributes={f"pdunit.{k}": v for k, v in attributes.items()})
        return Span(span, self)

    def shutdown(self) -> None:
        """Flush what is queued (SIGTERM: the last requests' spans are not lost)."""
        if self._provider is not None:
            self._provider.shutdown()


class SpanTable:
    """The open request spans of a process whose requests end on many paths (D: a last
    frame, a cancel, a failed transfer), by request id; thread-safe. Bounded: past
    `max_open` the oldest is ended as `abandoned` (a path that missed its close costs a
    span, never memory)."""

    def __init__(self, tracing: Tracing, max_open: int = 65536) -> None:
        self.tracing = tracing
        self.max_open = max_open
        self._open: dict[int, Span] = {}
        self._lock = threading.Lock()

    def open(self, request_id: int, name: str, start_ns: int,
             parent: Iterable[tuple[str, str]] | Mapping[str, str] | None, **attributes: Any) -> None:
        if not self.tracing.enabled:
            return
        span = self.tracing.start(name, start_ns, parent, request_id=f"{request_id:016x}", **attributes)
        assert span is not None
        with self._lock:
            old = self._open.pop(request_id, None)
            self._open[request_id] = span
            oldest = None
            if len(self._open) > self.max_open:
                oldest = self._open.pop(next(iter(self._open)))
        for gone in (old, oldest):
            if gone is not None:
                gone.end({}, (), time.time_ns(), "abandoned")

    def close(self, request_id: int, stamps: Mapping[str, int], stages: Sequence[tuple[str, str, str]],
              error: str = "", **attributes: Any) -> None:
        if not self.tracing.enabled:
            return
        with self._lock:
            span = self._open.pop(request_id, None)
        if span is not None:
            span.end(stamps, stages, time.time_ns(), error, **attributes)

    def __len__(self) -> int:
        return len(self._open)
