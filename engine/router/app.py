"""The router's HTTP surface (FastAPI): the proxied stream, voices, table, health, metrics.

Owns the endpoints and the life cycle of the background work (discovery, /v1/load
polling) and of the HTTP clients. Routing lives in table.py, forwarding in proxy.py
(streams) and voices.py (/v1/voices); this module only wires them. It never serves audio
itself, and never shows the table
(/v1/units: unit URLs, errors, sessions) to a caller without the --admin-token-file
token, or, with no token configured, to anyone but a loopback peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdunit.engine.edge import bearer_matches, is_loopback
from pdunit.engine.router.config import RouterConfig
from pdunit.engine.router.proxy import SPEECH_PATH, Forwarder, ForwardPolicy, RouterMetrics
from pdunit.engine.router.table import LoadPoller, RoutingTable
from pdunit.engine.router.voices import VOICES_PATH, VoiceForwarder, VoiceMetrics
from pdunit.engine.security import security_event
from pdunit.engine.tracing import Tracing


class Discovery(Protocol):
    async def run(self, table: RoutingTable) -> None: ...


class TableCollector(Collector):
    """Units by state, in-flight streams, headroom and the load bound, read from the table
    at scrape (so a unit's gauges leave with it)."""

    def __init__(self, table: RoutingTable) -> None:
        self.table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        units = GaugeMetricFamily(
            "pdunit_router_units", "Units known to the router, by state", labels=["state"]
        )
        for state, count in self.table.counts_by_state().items():
            units.add_metric([state], count)
        yield units
        streams = GaugeMetricFamily(
            "pdunit_router_streams_in_flight",
            "Streams this router is proxying now, by unit",
            labels=["unit"],
        )
        load = GaugeMetricFamily(
            "pdunit_router_unit_load_streams",
            "Estimated streams in flight on the unit (its report corrected by ours)",
            labels=["unit"],
        )
        headroom = GaugeMetricFamily(
            "pdunit_router_unit_headroom_streams",
            "Streams the unit would still admit at its rate floor: its last report less the "
            "streams this router opened there since (-1: the unit has no rate-floor admission)",
            labels=["unit"],
        )
        for unit in self.table.units.values():
            streams.add_metric([unit.name], unit.router_in_flight)
            load.add_metric([unit.name], unit.load)
            headroom.add_metric([unit.name], unit.headroom)
        yield streams
        yield load
        yield headroom
        yield GaugeMetricFamily(
            "pdunit_router_load_bound_streams",
            "Current bound ceil(c * (total + 1) / routable units)",
            value=self.table.current_bound(),
        )


class RouterState:
    """What the endpoints share; built in the lifespan."""

    def __init__(self, table: RoutingTable, forwarder: Forwarder, voices: VoiceForwarder,
                 registry: CollectorRegistry):
        self.table = table
        self.forwarder = forwarder
        self.voices = voices
        self.registry = registry
        self.shutting_down = False
        self.failed = ""  # set when background work crashed: the router is then unhealthy


def create_app(
    config: RouterConfig,
    discovery: Discovery,
    logger: logging.Logger | None = None,
    registry: CollectorRegistry | None = None,
    admin_token: bytes | None = None,
) -> FastAPI:
    """The router app. Its lifespan starts discovery and polling and stops them.
    `admin_token`: the bearer token /v1/units needs (main reads --admin-token-file)."""
    log = logger or logging.getLogger("pdunit.router")
    registry = registry if registry is not None else CollectorRegistry()
    metrics = RouterMetrics(registry)
    voice_metrics = VoiceMetrics(registry)
    table = RoutingTable(
        load_bound_factor=config.load_bound_factor,
        vnodes=config.vnodes,
        max_tracked_sessions=config.max_tracked_sessions,
        logger=log,
        on_unit_gone=metrics.forget_unit,
    )
    registry.register(TableCollector(table))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Streams are long-lived: no pool cap (each open stream holds a connection),
        # a short connect timeout (refusal -> retry elsewhere fast), a read timeout
        # that bounds silence between chunks, not the whole stream.
        stream_client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=config.connect_timeout_s,
                read=config.stream_read_timeout_s,
                write=config.stream_read_timeout_s,
                pool=None,
            ),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        poll_client = httpx.AsyncClient(
            timeout=config.poll_timeout_s,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        policy = ForwardPolicy(
            session_header=config.session_header,
            max_attempts=config.max_attempts,
            retry_after_s=config.retry_after_s,
            max_body_bytes=config.max_body_bytes,
            trusted_proxies=tuple(ipaddress.ip_network(n) for n in config.trusted_proxies),
        )
        tracing = Tracing("router", config.otlp_endpoint)
        forwarder = Forwarder(table, stream_client, metrics, policy, log, tracing)
        state = RouterState(table, forwarder, VoiceForwarder(forwarder, voice_metrics), registry)
        app.state.router = state
        poller = LoadPoller(
            table,
            poll_client,
            config.poll_interval_s,
            config.poll_timeout_s,
            on_failure=lambda name: metrics.poll_failures.labels(unit=name).inc(),
        )
        tasks = [
            asyncio.create_task(_supervised(discovery.run(table), "discovery", log, state)),
            asyncio.create_task(_supervised(poller.run(), "poller", log, state)),
        ]
        try:
            yield
        finally:
            state.shutting_down = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await stream_client.aclose()
            await poll_client.aclose()
            tracing.shutdown()

    app = FastAPI(title="pdunit router", lifespan=lifespan)

    def _state(request: Request) -> RouterState:
        return request.app.state.router  # type: ignore[no-any-return]

    @app.post("/v1/tts/stream")
    async def tts_stream(request: Request) -> Response:
        state = _state(request)
        return await state.forwarder.forward(request)

    @app.post(SPEECH_PATH)
    async def speech(request: Request) -> Response:
        return await _state(request).forwarder.forward(request, SPEECH_PATH)

    # The set's shared voice store, through any unit (voices.py); the only routes that
    # pass the client's Authorization header on (the LB checks the voices token).
    @app.api_route(VOICES_PATH, methods=["GET", "POST"])
    async def voices(request: Request) -> Response:
        return await _state(request).voices.forward(request, VOICES_PATH)

    @app.api_route(VOICES_PATH + "/{name}", methods=["GET", "DELETE"])
    async def voice(name: str, request: Request) -> Response:
        # quoted again: a name's %2F never becomes a path separator towards the unit
        return await _state(request).voices.forward(request, f"{VOICES_PATH}/{quote(name, safe='')}")

    @app.get("/v1/units", response_model=None)
    async def units(request: Request) -> dict[str, Any] | JSONResponse:
        peer = request.client.host if request.client is not None else ""
        if admin_token is not None:
            if not bearer_matches(request.headers, admin_token):
                security_event("units_unauthorized", client=peer)
                return JSONResponse(
                    {"error": {"code": "unauthorized", "field": "Authorization",
                               "message": "/v1/units needs 'Authorization: Bearer <token>', the "
                               "token of the router's --admin-token-file"}},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        elif not is_loopback(peer):
            security_event("units_unauthorized", client=peer)
            return JSONResponse(
                {"error": {"code": "forbidden",
                           "message": "/v1/units answers loopback clients only while the router "
                           "has no --admin-token-file; configure one to read it remotely"}},
                status_code=403,
            )
        return _state(request).table.snapshot()

    @app.get("/healthz")
    async def healthz(request: Request) -> JSONResponse:
        state = _state(request)
        if state.failed:
            return JSONResponse({"ok": False, "reason": state.failed}, status_code=503)
        return JSONResponse({"ok": True})

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        state = _state(request)
        if state.failed:
            return JSONResponse({"ready": False, "reason": state.failed}, status_code=503)
        if state.shutting_down:
            return JSONResponse({"ready": False, "reason": "shutting down"}, status_code=503)
        n = state.table.routable_count()
        if n == 0:
            counts = {k: v for k, v in state.table.counts_by_state().items() if v}
            return JSONResponse(
                {
                    "ready": False,
                    "reason": f"no routable unit (units by state: {counts or 'none'})",
                },
                status_code=503,
            )
        return JSONResponse({"ready": True, "routable_units": n})

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        return Response(generate_latest(_state(request).registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _supervised(work: Any, name: str, log: logging.Logger, state: RouterState) -> None:
    """Background work must not die silently: a crash is logged and turns /healthz and
    /readyz to 503 (a router with a frozen table must be restarted, not trusted)."""
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("router background task crashed", extra={"task": name})
        state.failed = f"{name} crashed: {exc!r}"
