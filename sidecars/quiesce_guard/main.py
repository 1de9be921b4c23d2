"""`pdunit guard`: the quiesce-guard sidecar. Polls P's and D's Info over their unix
sockets, applies sidecars/quiesce_guard/policy.py, writes an Event-worthy JSON log line
for every action, enforces P's exit, and serves /status, /healthz and /metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import asdict

import grpc
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest
from pydantic import BaseModel, Field

from pdunit.engine.grpc_server import channel
from pdunit.engine.observability import log_config, setup_logging, shutdown_event
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.settings import parse_config, parse_decode_sockets
from pdunit.engine.unit_layout import decode_names, pod_socket
from pdunit.sidecars.quiesce_guard.policy import (
    Action,
    DecodeObservation,
    GuardState,
    Observation,
    evaluate,
)

ACTIONS = Counter("pdunit_guard_actions_total", "Guard decisions, by kind", ["kind"])
P_HELD = Gauge("pdunit_guard_prefill_held_aborts", "P's unanswered aborts as the guard last saw them")
D_HELD = Gauge("pdunit_guard_decode_held_fraction", "A D's held pages / pool pages as the guard last saw them",
               ["decode"])


class GuardConfig(BaseModel):
    """quiesce-guard: watches held ACKs in P and held pages in D and enforces their limits."""

    prefill_socket: str = Field(pod_socket("prefill"), description="P's socket")
    decode_socket: str = Field(pod_socket("decode"), description="D's socket, or a comma list: every D of "
                               "the unit (1PnD), in the unit's order (decode-0, decode-1, ...)")
    interval_ms: int = Field(250, gt=0, description="poll period")
    max_held_aborts: int = Field(3, gt=0, description="P's unanswered aborts at which P must exit")
    held_drain_fraction: float = Field(0.25, gt=0, le=1, description="D's held fraction above which it drains")
    enforce: bool = Field(True, description="kill P if it stays over the limit past the grace")
    enforce_grace_s: float = Field(3.0, ge=0, description="how long P may stay over the limit")
    port: int = Field(8091, ge=0, description="HTTP port for /status, /healthz, /metrics (0 = off)")
    host: str = Field("0.0.0.0", description="HTTP bind address")
    log_level: str = Field("info", description="log level")


async def observe(p: pbg.PrefillStub, decoders: list[tuple[str, pbg.DecodeStub]]) -> Observation:
    obs: dict = {"at": time.monotonic(), "p_reachable": False}
    try:
        pi = await p.Info(pb.Empty(), timeout=1.0)
        obs.update(p_reachable=True, p_instance=pi.instance_id, p_pid=pi.pid, p_held_aborts=pi.held_aborts)
    except grpc.aio.AioRpcError:
        pass
    seen = []
    for name, d in decoders:
        try:
            di = await d.Info(pb.Empty(), timeout=1.0)
            seen.append(DecodeObservation(name, True, di.held_pages, di.pool_pages, di.draining))
        except grpc.aio.AioRpcError:
            seen.append(DecodeObservation(name))
    return Observation(**obs, decoders=tuple(seen))


def status_app(status: dict) -> FastAPI:
    app = FastAPI(title="pdunit quiesce-guard")

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/status")
    def get_status() -> dict:
        return status

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


async def serve(cfg: GuardConfig) -> int:
    log = setup_logging("guard", cfg.log_level)
    log_config(log, cfg)
    stop = shutdown_event(log)
    p = pbg.PrefillStub(channel(cfg.prefill_socket))
    sockets = parse_decode_sockets(cfg.decode_socket)
    decoders = [(name, pbg.DecodeStub(channel(sock)))
                for name, sock in zip(decode_names(len(sockets)), sockets, strict=True)]
    state = GuardState()
    status: dict = {"observation": None, "recent_actions": [], "actions_total": state.actions_total}
    server = None
    if cfg.port:
        server = uvicorn.Server(uvicorn.Config(status_app(status), http="httptools", host=cfg.host,
                                               port=cfg.port, log_config=None, lifespan="off"))
        server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]  # our shutdown_event handles signals
        asyncio.create_task(server.serve())
    log.info("guard watching", extra={"prefill": cfg.prefill_socket, "decode": cfg.decode_socket})
    while not stop.is_set():
        obs = await observe(p, decoders)
        P_HELD.set(obs.p_held_aborts)
        for d in obs.decoders:
            D_HELD.labels(decode=d.name).set(d.held_pages / d.pool_pages if d.pool_pages else 0)
        status["observation"] = asdict(obs)
        for action in evaluate(obs, state, cfg.max_held_aborts, cfg.held_drain_fraction, cfg.enforce_grace_s):
            act(action, cfg, log)
            status["recent_actions"] = (status["recent_actions"] + [asdict(action) | {"at": time.time()}])[-50:]
        try:
            await asyncio.wait_for(stop.wait(), cfg.interval_ms / 1000)
        except TimeoutError:
            pass
    if server is not None:
        server.should_exit = True
    log.info("guard stopped")
    return 0


def act(action: Action, cfg: GuardConfig, log) -> None:
    ACTIONS.labels(kind=action.kind).inc()
    level = log.error if action.kind in ("kill_p", "d_not_draining", "p_over_limit") else log.warning
    level(action.message, extra={"event": f"Guard{action.kind.title().replace('_', '')}", "action": action.kind,
                                 "pid": action.pid or None, "decode": action.decode or None})
    if action.kind == "kill_p" and cfg.enforce and action.pid:
        try:
            os.kill(action.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            log.error("cannot signal prefill: is the pod's process namespace shared?", extra={"error": str(exc)})


def main(argv: list[str]) -> int:
    cfg = parse_config(GuardConfig, argv, "pdunit guard")
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
