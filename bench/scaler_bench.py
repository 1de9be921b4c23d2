"""KEDA scaler edge benchmark: GetMetrics latency over N units, plus the fake LB fleet.

Owns `FakeLBFleet` (small loopback HTTP servers, each one unit LB's `GET /v1/load`, with
knobs for slow, failing and garbage answers; the scaler tests use it too) and
`bench_scaler(n_units)`, which `pdunit bench edges` reports: a real grpcio client calling
the real scaler, which scrapes every fake over loopback. All share one process and event
loop, so the figure is an upper bound for the scaler itself. Must never talk to anything
but 127.0.0.1. Standalone: `python -m pdunit.bench.scaler_bench --units 100 --requests 200`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdunit.engine.loadgen.summary import percentile


def fake_load_document(unit: str, **fields: Any) -> dict[str, Any]:
    """A `/v1/load` answer of a ready unit that holds nothing, with `fields` changed (None
    leaves a field out): every field a LoadDocument has, so readers parse it as a real one."""
    doc: dict[str, Any] = {
        "unit": unit, "ready": True, "reason": "ready", "draining": False, "transfer_mode": "",
        "streams_in_flight": 0, "prefill_queue": 0, "transfers_in_flight": 0,
        "decode_reserved": 0, "decode_in_flight": 0, "held_pages": 0, "held_aborts": 0,
        "pool_pages": 0, "free_pages": 0, "kv_checks_total": 0, "kv_mismatch_total": 0,
        "headroom_streams": -1, "requests": {"lb": [], "prefill": [], "decode": [], "proxy": []},
        "empty": True, "prefill_instance": "", "decode_instance": "", "decoders": [],
        "lb_instance": "", "probe_age_ms": 0.0, "errors": {},
    }
    doc.update(fields)
    return {k: v for k, v in doc.items() if v is not None}


@dataclass
class FakeUnit:
    """One unit's LB as the scaler sees it. `behavior`: ok | hang | http_500 | garbage."""

    name: str
    port: int
    decode_in_flight: int = 0
    headroom_streams: int | None = None  # None: the field is absent (a unit without admission)
    ready: bool = True
    draining: bool = False
    behavior: str = "ok"
    hits: int = 0

    def endpoint(self, **status: Any) -> dict[str, Any]:
        """The unit as a unit source returns it; `status` overrides (ready, draining, ...)."""
        out: dict[str, Any] = {
            "name": self.name,
            "podIP": "127.0.0.1",
            "lbPort": self.port,
            "ready": True,
            "draining": False,
        }
        out.update(status)
        return out


class FakeLBFleet:
    """N unit LBs on 127.0.0.1, one listening socket each, served by one aiohttp app."""

    def __init__(self) -> None:
        self.units: dict[str, FakeUnit] = {}
        self._by_port: dict[int, FakeUnit] = {}
        self._runner: web.AppRunner | None = None
        self._release = asyncio.Event()
        self.concurrent = 0
        self.peak_concurrent = 0

    async def start(self, names: list[str]) -> FakeLBFleet:
        app = web.Application()
        app.router.add_get("/v1/load", self._load)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        for name in names:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            site = web.SockSite(self._runner, sock)
            await site.start()
            unit = FakeUnit(name=name, port=sock.getsockname()[1])
            self.units[name] = unit
            self._by_port[unit.port] = unit
        return self

    async def stop(self) -> None:
        self._release.set()  # hanging handlers return now
        if self._runner is not None:
            await self._runner.cleanup()

    def reset_hits(self) -> None:
        for unit in self.units.values():
            unit.hits = 0
        self.peak_concurrent = 0

    async def _load(self, request: web.Request) -> web.StreamResponse:
        port = request.transport.get_extra_info("sockname")[1] if request.transport else 0
        unit = self._by_port[port]
        unit.hits += 1
        self.concurrent += 1
        self.peak_concurrent = max(self.peak_concurrent, self.concurrent)
        try:
            if unit.behavior == "hang":
                # Longer than any scrape timeout; released at stop().
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._release.wait(), timeout=30)
                return web.json_response({"decode_in_flight": unit.decode_in_flight})
            if unit.behavior == "http_500":
                return web.json_response({"error": {"code": "internal"}}, status=500)
            if unit.behavior == "garbage":
                return web.Response(text="not json", content_type="text/plain")
            doc = fake_load_document(
                unit.name,
                ready=unit.ready,
                draining=unit.draining,
                decode_in_flight=unit.decode_in_flight,
                streams_in_flight=unit.decode_in_flight,
                empty=unit.decode_in_flight == 0,
                headroom_streams=unit.headroom_streams,
            )
            return web.json_response(doc)
        finally:
            self.concurrent -= 1


def _percentile(values: list[float], q: float) -> float:
    """q in 0..1."""
    return float(percentile(values, 100 * q) or 0.0)


async def _bench(n_units: int, requests: int, in_flight_per_unit: int) -> dict[str, Any]:
    import grpc

    from pdunit.operator.proto import externalscaler_pb2 as pb
    from pdunit.operator.proto import externalscaler_pb2_grpc as pb_grpc
    from pdunit.operator.scaler import start_scaler

    fleet = await FakeLBFleet().start([f"unit-{i}" for i in range(n_units)])
    for unit in fleet.units.values():
        unit.decode_in_flight = in_flight_per_unit

    async def source(namespace: str, unit_set: str) -> list[dict[str, Any]]:
        return [u.endpoint() for u in fleet.units.values()]

    logger = logging.getLogger("pdunit.bench.scaler")
    rows = []
    try:
        for label, ttl in (("scrape every call", 0.0), ("cached", 3600.0)):
            server, port = await start_scaler(0, logger, source, host="127.0.0.1", cache_ttl_s=ttl)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = pb_grpc.ExternalScalerStub(channel)
                    ref = pb.ScaledObjectRef(
                        name="bench",
                        namespace="bench",
                        scalerMetadata={
                            "unitSet": "bench",
                            "targetInFlightPerUnit": "8",
                            "scrapeTimeoutMs": "2000",
                        },
                    )
                    request = pb.GetMetricsRequest(scaledObjectRef=ref, metricName="m")
                    first = await stub.GetMetrics(request)  # warm-up; also checks the sum
                    expected = n_units * in_flight_per_unit
                    if first.metricValues[0].metricValue != expected:
                        raise RuntimeError(
                            f"bench: metric {first.metricValues[0].metricValue}, expected {expected}"
                        )
                    latencies = []
                    for _ in range(requests):
                        start = time.perf_counter()
                        await stub.GetMetrics(request)
                        latencies.append((time.perf_counter() - start) * 1000.0)
            finally:
                await server.stop(grace=None)
            rows.append(
                {
                    "case": label,
                    "units": n_units,
                    "requests": requests,
                    "p50_ms": round(statistics.median(latencies), 3),
                    "p99_ms": round(_percentile(latencies, 0.99), 3),
                    "max_ms": round(max(latencies), 3),
                }
            )
    finally:
        await fleet.stop()
    uncached = rows[0]
    return {
        "bench": "scaler",
        "units": n_units,
        "requests": requests,
        "p50_ms": uncached["p50_ms"],
        "p99_ms": uncached["p99_ms"],
        "rows": rows,
    }


def bench_scaler(
    n_units: int = 100, requests: int = 200, in_flight_per_unit: int = 3
) -> dict[str, Any]:
    """GetMetrics latency with `n_units` fake units; `p50_ms`/`p99_ms` are for the uncached
    path (every call scrapes all units), `rows` also has the cached path."""
    if n_units < 1 or requests < 1:
        raise ValueError(
            f"bench_scaler: n_units and requests must be >= 1, got {n_units}, {requests}"
        )
    return asyncio.run(_bench(n_units, requests, in_flight_per_unit))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdunit.bench.scaler_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--units", type=int, default=100)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = bench_scaler(args.units, args.requests)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"KEDA GetMetrics latency, {args.units} fake units, {args.requests} requests, "
        f"cpus={os.cpu_count()}"
    )
    print(f"{'case':<20} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for row in result["rows"]:
        print(
            f"{row['case']:<20} {row['p50_ms']:>9.3f} {row['p99_ms']:>9.3f} {row['max_ms']:>9.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
