"""Helpers for the router tests: fake units that speak docs/api.md, served on loopback.

A fake unit streams N NDJSON frames slowly and counts what the router cares about:
streams started, finished, cancelled (client went away), in flight. It can drain,
refuse with 429, or die after k frames, so the tests can check the router's promises
(affinity, drain, load bound, no duplicate starts) against what the units saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdunit.bench.scaler_bench import fake_load_document
from pdunit.engine.edge import EdgeLimits, server_config
from pdunit.engine.router.app import create_app
from pdunit.engine.router.config import RouterConfig
from pdunit.engine.router.discovery import StaticDiscovery, parse_static_units
from pdunit.engine.router.table import LoadPoller, RoutingTable


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # tests run many servers in one process: no signal handlers


@dataclass
class Served:
    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        if not self.task.done():
            self.server.should_exit = True
            await asyncio.wait_for(self.task, timeout=10)


@contextlib.asynccontextmanager
async def serve(app: Any, grace_s: int = 2, limits: EdgeLimits | None = None) -> AsyncIterator[Served]:
    """Run an ASGI app on 127.0.0.1:<free port> inside the test's event loop; with
    `limits`, behind the edge's protocol as `pdunit router` serves (engine/edge.py)."""
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says
    # TCP; with proto 0, Nagle + delayed ACK add ~40 ms to every keep-alive response.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if limits is not None:
        config = server_config(app, limits, lifespan="on", timeout_graceful_shutdown=grace_s)
    else:
        config = uvicorn.Config(
            app, http="httptools", log_config=None, lifespan="on", timeout_graceful_shutdown=grace_s
        )
    server = _QuietServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(1000):
            if server.started or task.done():
                break
            await asyncio.sleep(0.005)
        if task.done():
            task.result()
        assert server.started, "test server did not start"
        served = Served(f"http://127.0.0.1:{port}", server, task)
        yield served
        await served.stop()
    finally:
        if not task.done():
            server.force_exit = server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=5)
        sock.close()


class FakeUnit:
    """A unit as the router sees it: docs/api.md's stream, load, readiness and drain."""

    def __init__(self, name: str, frames: int = 5, frame_delay_s: float = 0.01) -> None:
        self.name = name
        self.frames = frames
        self.frame_delay_s = frame_delay_s
        self.draining = False
        self.ready = True
        self.refuse_with: int | None = None  # e.g. 429: refuse every stream with it
        self.response_headers: dict[str, str] = {}  # added to every answer of the stream route
        self.headers: list[dict[str, str]] = []  # every stream request's headers, as received
        self.fail_after_frames: int | None = None  # die after sending this many frames
        self.binary = False  # answer application/x-pdunit-frames instead of NDJSON
        self.hold: asyncio.Event | None = None  # when set: streams wait for it before ending
        self.starts = 0
        self.completed = 0
        self.cancelled = 0
        self.in_flight = 0
        self.sessions: list[str | None] = []
        self.request_ids: list[str | None] = []
        self.load_polls = 0
        self.app = Starlette(
            routes=[
                Route("/v1/tts/stream", self._stream, methods=["POST"]),
                Route("/v1/load", self._load),
                Route("/readyz", self._readyz),
                Route("/healthz", lambda r: JSONResponse({"ok": True})),
                Route("/v1/admin/drain", self._drain, methods=["POST"]),
            ]
        )

    def load_doc(self) -> dict[str, Any]:
        return fake_load_document(
            self.name,
            ready=self.ready and not self.draining,
            draining=self.draining,
            streams_in_flight=self.in_flight,
            empty=self.in_flight == 0,
        )

    async def _load(self, request: Request) -> Response:
        self.load_polls += 1
        return JSONResponse(self.load_doc())

    async def _readyz(self, request: Request) -> Response:
        if self.draining or not self.ready:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        return JSONResponse({"ready": True})

    async def _drain(self, request: Request) -> Response:
        body = await request.body()
        self.draining = bool(json.loads(body).get("draining", True)) if body else True
        return JSONResponse(self.load_doc())

    async def _stream(self, request: Request) -> Response:
        self.headers.append(dict(request.headers.items()))
        response = await self._answer(request)
        response.headers.update(self.response_headers)
        return response

    async def _answer(self, request: Request) -> Response:
        if self.draining or not self.ready:
            return JSONResponse(
                {"error": {"code": "draining", "message": f"unit {self.name} is draining"}},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        if self.refuse_with is not None:
            return JSONResponse(
                {"error": {"code": "no_capacity", "message": "D has no capacity"}},
                status_code=self.refuse_with,
            )
        doc = json.loads(await request.body())
        if not doc.get("prompt"):
            return JSONResponse(
                {
                    "error": {
                        "code": "empty_prompt",
                        "message": "prompt is empty",
                        "field": "prompt",
                    }
                },
                status_code=400,
            )
        self.starts += 1
        self.sessions.append(request.headers.get("x-session-id"))
        self.request_ids.append(request.headers.get("x-request-id"))
        if self.binary:
            return StreamingResponse(self._frames(), media_type="application/x-pdunit-frames")
        return StreamingResponse(self._frames(), media_type="application/x-ndjson")

    async def _frames(self) -> AsyncIterator[bytes]:
        self.in_flight += 1
        sent = 0
        try:
            for i in range(self.frames):
                if self.fail_after_frames is not None and i == self.fail_after_frames:
                    raise RuntimeError(f"fake unit {self.name} dies after {i} frames")
                if self.binary:
                    yield struct.pack("<11i", *([i] * 11))
                else:
                    yield (
                        json.dumps({"i": i, "frame": [i] * 11, "unit": self.name}) + "\n"
                    ).encode()
                sent += 1
                await asyncio.sleep(self.frame_delay_s)
            if self.hold is not None:
                await self.hold.wait()
            yield (json.dumps({"done": True, "reason": "length", "frames": sent}) + "\n").encode()
            self.completed += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


@dataclass
class RouterHandle:
    url: str
    app: Any
    served: Served

    @property
    def table(self) -> RoutingTable:
        return self.app.state.router.table  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def run_router(
    units: dict[str, str],
    wait_routable: int | None = None,
    admin_token: bytes | None = None,
    **overrides: Any,
) -> AsyncIterator[RouterHandle]:
    """A router over a static list, served on loopback, once `wait_routable` units are."""
    fields: dict[str, Any] = {"poll_interval_s": 0.05, "poll_timeout_s": 0.5, **overrides}
    config = RouterConfig(units=[f"{n}={u}" for n, u in units.items()], **fields)
    app = create_app(
        config,
        StaticDiscovery(parse_static_units(config.units)),
        registry=CollectorRegistry(),
        admin_token=admin_token,
    )
    async with serve(app, limits=config) as served:
        handle = RouterHandle(served.url, app, served)
        want = len(units) if wait_routable is None else wait_routable
        for _ in range(400):
            if handle.table.routable_count() >= want:
                break
            await asyncio.sleep(0.01)
        assert handle.table.routable_count() >= want, handle.table.snapshot()
        yield handle


@contextlib.asynccontextmanager
async def run_units(*units: FakeUnit) -> AsyncIterator[dict[str, Served]]:
    """Serve every fake unit; stop them all at once at the end (stops take ~0.2 s each)."""
    async with contextlib.AsyncExitStack() as stack:
        served = {}
        for unit in units:
            served[unit.name] = await stack.enter_async_context(serve(unit.app))
        try:
            yield served
        finally:
            await asyncio.gather(*(s.stop() for s in served.values()), return_exceptions=True)


PROMPT = {"prompt": [[1] * 11, [2] * 11], "max_frames": 5}


async def read_stream(
    client: httpx.AsyncClient, url: str, session: str | None = None, **headers: str
) -> tuple[int, list[dict[str, Any]], httpx.Headers]:
    """POST a stream through the router; the status, every NDJSON line, the headers."""
    hdrs = dict(headers)
    if session is not None:
        hdrs["X-Session-Id"] = session
    async with client.stream("POST", url + "/v1/tts/stream", json=PROMPT, headers=hdrs) as resp:
        lines = [json.loads(line) async for line in resp.aiter_lines() if line]
        return resp.status_code, lines, resp.headers


def key_owned_by(table: RoutingTable, unit: str, prefix: str = "voice") -> str:
    """A session key whose ring owner is `unit`."""
    for i in range(100_000):
        key = f"{prefix}-{i}"
        if table.ring.owner(key) == unit:
            return key
    raise AssertionError(f"no key maps to {unit}")


async def poll_answer(table: RoutingTable, name: str, answer: dict[str, Any]) -> None:
    """One poll of unit `name` (at its table URL) whose `/v1/load` answers `answer`."""
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    async with httpx.AsyncClient(transport=transport) as client:
        await LoadPoller(table, client, interval_s=1.0, timeout_s=1.0).poll_unit(
            name, table.units[name].url
        )
