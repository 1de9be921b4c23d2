"""One trace per request across router -> LB -> P -> D (issue 28.2): a real PD unit
(`pdunit local`, its LB, P and D as processes) and the router, each with
`--otlp-endpoint` pointing at a fake OTLP/gRPC collector in this test. One request with
the client's own `traceparent` must come back as one tree: the client's span -> the
router's -> the LB's -> P's -> D's, each process under its own service name, each with
its stage spans built from the waterfall's stamps."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from pdunit.engine.local import LocalConfig, LocalUnit
from tests.router.routerkit import run_router

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector(otlp_grpc.TraceServiceServicer):
    """Keeps every exported span as (service, name, trace id, span id, parent id, attributes)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def Export(self, request: otlp.ExportTraceServiceRequest, context: Any) -> otlp.ExportTraceServiceResponse:  # noqa: N802
        with self.lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                for scope in rs.scope_spans:
                    for s in scope.spans:
                        self.spans.append({
                            "service": service, "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "attrs": {a.key: a.value.string_value or a.value.int_value for a in s.attributes},
                        })
        return otlp.ExportTraceServiceResponse()

    def of_trace(self, trace: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace]


@pytest.fixture
def collector():
    sink = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    otlp_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, f"127.0.0.1:{port}"
    server.stop(None)


def test_one_request_is_one_trace_across_router_lb_p_and_d(collector, short_dir) -> None:
    sink, endpoint = collector
    otlp_args = ["--otlp-endpoint", endpoint]
    cfg = LocalConfig(mode="pd", model="random:tiny:0", lb_port=0, guard=False, log_level="warning",
                      pool_tokens=4096, cache_tokens=2048, extra_prefill_args=otlp_args,
                      extra_decode_args=otlp_args, extra_lb_args=otlp_args, run_dir=short_dir)
    with LocalUnit(cfg) as unit:

        async def through_router() -> httpx.Response:
            async with run_router({"u": unit.url}, otlp_endpoint=endpoint) as router, httpx.AsyncClient() as c:
                return await c.post(router.url + "/v1/tts/stream", timeout=60,
                                    json={"prompt": [[1] * 11] * 20, "max_frames": 6, "min_frames": 6},
                                    headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"})

        resp = asyncio.run(through_router())
        assert resp.status_code == 200 and resp.text.strip().splitlines()[-1].find('"done"') >= 0
        wanted = {"router.request", "lb.stream", "prefill.request", "decode.stream"}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not wanted <= {s["name"] for s in sink.of_trace(TRACE)}:
            time.sleep(0.1)
    spans = sink.of_trace(TRACE)
    by_name = {s["name"]: s for s in spans}
    assert wanted <= set(by_name), sorted(by_name)
    chain = [("router.request", CLIENT_SPAN, "pdunit-router"), ("lb.stream", "router.request", "pdunit-lb"),
             ("prefill.request", "lb.stream", "pdunit-prefill"), ("decode.stream", "prefill.request", "pdunit-decode")]
    for name, parent, service in chain:
        span = by_name[name]
        want_parent = parent if parent == CLIENT_SPAN else by_name[parent]["id"]
        assert span["parent"] == want_parent, (name, span, want_parent)
        assert span["service"] == service and span["start"] <= span["end"]
    # the stage spans, children of their process's span, from its stamps
    stages = {"lb.validate": "lb.stream", "lb.first_frame": "lb.stream", "lb.stream_out": "lb.stream",
              "prefill.queue": "prefill.request", "prefill.forward": "prefill.request",
              "prefill.transfer": "prefill.request", "decode.await_commit": "decode.stream",
              "decode.first_frame": "decode.stream", "decode.frames": "decode.stream"}
    for name, parent in stages.items():
        assert name in by_name, (name, sorted(by_name))
        assert by_name[name]["parent"] == by_name[parent]["id"], name
    assert by_name["decode.stream"]["attrs"]["pdunit.frames"] == 6
    assert by_name["lb.stream"]["attrs"]["pdunit.outcome"] == "length"  # its max_frames
