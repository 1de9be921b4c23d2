"""engine/tracing.py on its own: W3C parentage, spans from stamps, the open-span table,
and the off switch. The same spans across router, LB, P and D processes:
tests/engine/test_tracing_unit.py."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pdunit.engine.tracing import PREFILL_STAGES, SpanTable, Tracing

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    tracing = Tracing("prefill", "", instance="p-1", exporter=exporter)
    yield tracing, exporter
    tracing.shutdown()


def spans(tracing: Tracing, exporter: InMemorySpanExporter) -> dict:
    tracing._provider.force_flush()
    return {s.name: s for s in exporter.get_finished_spans()}


def test_off_without_an_endpoint_every_call_is_a_no_op() -> None:
    tracing = Tracing("lb", "")
    assert not tracing.enabled and tracing.tracer is None
    assert tracing.start("lb.stream", 1, {"traceparent": f"00-{TRACE}-{PARENT}-01"}) is None
    table = SpanTable(tracing)
    table.open(7, "decode.stream", 1, None)
    table.close(7, {}, ())
    assert len(table) == 0
    tracing.shutdown()


def test_a_span_is_the_child_of_the_w3c_parent_with_one_child_per_stamped_stage(traced) -> None:
    tracing, exporter = traced
    stamps = {"p_admitted": 1_000, "prefill_start": 2_000, "prefill_end": 5_000}  # no transfer stamps
    span = tracing.start("prefill.request", 900, [("traceparent", f"00-{TRACE}-{PARENT}-01"), ("x-other", "1")],
                         request_id="00ab")
    assert span is not None
    span.end(stamps, PREFILL_STAGES, 6_000, prefill_tokens=48)
    got = spans(tracing, exporter)
    assert set(got) == {"prefill.request", "prefill.queue", "prefill.forward"}
    root = got["prefill.request"]
    assert f"{root.context.trace_id:032x}" == TRACE and f"{root.parent.span_id:016x}" == PARENT
    assert (root.start_time, root.end_time) == (900, 6_000)
    assert root.attributes["pdunit.request_id"] == "00ab" and root.attributes["pdunit.prefill_tokens"] == 48
    assert root.resource.attributes["service.name"] == "pdunit-prefill"
    assert root.resource.attributes["service.instance.id"] == "p-1"
    for name, (start, end) in {"prefill.queue": (1_000, 2_000), "prefill.forward": (2_000, 5_000)}.items():
        child = got[name]
        assert child.parent.span_id == root.context.span_id and child.context.trace_id == root.context.trace_id
        assert (child.start_time, child.end_time) == (start, end)


def test_its_context_travels_on_as_headers_and_grpc_metadata(traced) -> None:
    tracing, _ = traced
    span = tracing.start("lb.stream", 1, None)  # no parent: a new trace
    assert span is not None
    headers = span.headers()
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1 and trace_id != "0" * 32  # sampled
    assert span.metadata() == list(headers.items())
    child = tracing.start("prefill.request", 2, span.metadata())
    assert child is not None
    child.end({}, (), 3)
    span.end({}, (), 4, "rate_floor")
    got = spans(*traced)
    assert f"{got['prefill.request'].parent.span_id:016x}" == span_id
    assert got["lb.stream"].status.status_code == StatusCode.ERROR
    assert got["lb.stream"].status.description == "rate_floor"


def test_a_malformed_traceparent_starts_a_new_trace(traced) -> None:
    tracing, exporter = traced
    span = tracing.start("router.request", 1, {"traceparent": "00-zz-not-a-context"})
    assert span is not None
    span.end({}, (), 2)
    root = spans(tracing, exporter)["router.request"]
    assert root.parent is None


def test_the_open_span_table_closes_each_span_once_and_never_grows_past_its_bound(traced) -> None:
    tracing, exporter = traced
    table = SpanTable(tracing, max_open=2)
    for rid in (1, 2, 3):  # the third open ends the oldest (1) as abandoned
        table.open(rid, f"decode.stream.{rid}", rid, None)
    assert len(table) == 2
    table.close(2, {"d_reserved": 10, "d_committed": 20}, (("decode.await_commit", "d_reserved", "d_committed"),))
    table.close(2, {}, ())  # closed already: nothing
    table.close(3, {}, (), "cancelled")
    got = spans(tracing, exporter)
    assert set(got) == {"decode.stream.1", "decode.stream.2", "decode.stream.3", "decode.await_commit"}
    assert got["decode.stream.1"].status.description == "abandoned"
    assert got["decode.stream.3"].status.description == "cancelled"
    assert len(table) == 0
