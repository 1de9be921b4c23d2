"""`pdunit operator`: the kopf operator for PDUnit/PDUnitSet plus the KEDA external scaler.

Owns the process: config (flags / PDUNIT_* env via engine/settings.py), JSON logs,
Prometheus metrics, leadership (leader.py's Lease: kopf runs only while this replica
holds it, so of N replicas one acts; standbys serve /healthz and the read-only scaler),
the kopf run, kopf's liveness endpoint, and the lifetime of the API/HTTP clients and of
the scaler's gRPC server. Never reconciles anything itself (handlers.py does); never
runs kopf without holding the Lease when leader election is on.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import kopf
from aiohttp import web

from pdunit.engine.observability import log_config, serve_metrics, setup_logging
from pdunit.engine.settings import parse_config
from pdunit.operator import handlers
from pdunit.operator import models as m
from pdunit.operator.config import OperatorConfig
from pdunit.operator.kube import Kube, NoCluster
from pdunit.operator.lbapi import LbApi
from pdunit.operator.leader import LeaderElector

EVENT_SOURCE = "pdunit-operator"  # the Events' reportingComponent, `From` in kubectl describe
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def lease_namespace(cfg: OperatorConfig) -> str:
    if cfg.lease_namespace:
        return cfg.lease_namespace
    try:
        return SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


class StandbyHealth:
    """/healthz while this replica waits for the Lease (kopf serves it once it runs)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        if not self.port:
            return
        app = web.Application()

        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"standby": True})

        app.router.add_get("/healthz", healthz)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "0.0.0.0", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def _load_scaler() -> tuple[Any, str | None]:
    """The scaler's `serve_scaler`, or why it cannot be imported."""
    try:
        from pdunit.operator.scaler import serve_scaler
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return serve_scaler, None


class ScalerThread:
    """The KEDA scaler's gRPC server on an event loop of its own, in a thread.

    Why not the operator's loop: when kopf stops (SIGTERM) it cancels every task created
    while it ran, which includes grpc.aio's serving tasks, so the scaler could not stop
    gracefully. Its own loop keeps the two lifetimes apart.
    """

    def __init__(self, serve: Any, port: int, logger: logging.Logger) -> None:
        self.serve, self.port, self.logger = serve, port, logger
        self.loop = asyncio.new_event_loop()
        self.server: Any = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="keda-scaler", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.server = self.loop.run_until_complete(self.serve(self.port, self.logger))
        except BaseException as exc:  # reported to start() in the main thread
            self.error = exc
            self.ready.set()
            self.loop.close()
            return
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def start(self) -> None:
        self.thread.start()
        self.ready.wait()
        if self.error is not None:
            raise RuntimeError(f"KEDA scaler failed to start on port {self.port}: {self.error}")

    def stop(self, grace_s: float = 2.0) -> None:
        if self.server is not None:
            done = asyncio.run_coroutine_threadsafe(self.server.stop(grace=grace_s), self.loop)
            done.result(timeout=grace_s + 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def run(cfg: OperatorConfig, logger: logging.Logger) -> int:
    serve_scaler, scaler_error = _load_scaler()
    if cfg.scaler_port and serve_scaler is None:
        logger.error(
            "KEDA scaler unavailable; run with --scaler-port 0 to start the operator without it",
            extra={"error": scaler_error},
        )
        return 2

    identity = cfg.leader_identity or f"{socket.gethostname()}_{secrets.token_hex(4)}"
    registry = kopf.OperatorRegistry()
    holder: dict[str, handlers.Context] = {}
    handlers.register(registry, holder, cfg)

    # A registry of our own carries none of kopf's default login handlers: the same two
    # sources as kube.py (service account in a pod, else kubeconfig), in that order.
    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = m.FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix="kopf.pdunit.dev"
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="kopf.pdunit.dev", key="last-handled-configuration"
        )
        # Events are posted explicitly (kopf.info/warn) for every decision; kopf's own
        # log lines ("timer succeeded" every tick) must not become Events.
        settings.posting.level = logging.INFO
        settings.posting.loggers = False
        settings.posting.reporting_component = EVENT_SOURCE
        settings.posting.reporting_instance = identity
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 30

    try:
        kube = await Kube.connect()
    except NoCluster as exc:  # one line, no traceback: the message has the fix
        print(f"pdunit operator: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    elector = None
    if cfg.leader_election:
        try:
            elector = LeaderElector(
                kube,
                lease_namespace(cfg),
                cfg.lease_name,
                identity,
                lease_s=cfg.lease_seconds,
                renew_deadline_s=cfg.renew_deadline_seconds,
                retry_s=cfg.lease_retry_seconds,
            )
        except ValueError as exc:
            print(f"pdunit operator: {exc}", file=sys.stderr)
            await kube.close()
            return 2
    lb = LbApi(cfg.load_timeout_seconds)
    holder["ctx"] = handlers.Context(cfg=cfg, kube=kube, lb=lb)
    scaler = None
    lost: str | None = None
    try:
        if cfg.scaler_port:
            scaler = ScalerThread(serve_scaler, cfg.scaler_port, logger)
            try:
                await asyncio.to_thread(scaler.start)
            except RuntimeError as exc:
                logger.error(f"{exc}; pick a free --scaler-port, or 0 to run without the scaler")
                scaler = None
                return 2
            logger.info("KEDA external scaler serving", extra={"port": cfg.scaler_port})
        if elector is not None and not await _wait_for_leadership(elector, cfg.liveness_port):
            logger.info("operator stopped before it led")
            return 0
        liveness = f"http://0.0.0.0:{cfg.liveness_port}/healthz" if cfg.liveness_port else None
        stop_kopf = asyncio.Event()
        holding = None
        if elector is not None:

            async def hold() -> None:
                nonlocal lost
                lost = await elector.hold()
                logger.error("leadership lost: stopping at once", extra={"why": lost})
                stop_kopf.set()

            holding = asyncio.get_running_loop().create_task(hold(), name="lease-renewal")
        # kopf owns SIGTERM/SIGINT: it stops the watchers and waits for handlers. Standalone:
        # one acting replica is the Lease's job, not kopf's peering.
        try:
            await kopf.operator(
                registry=registry,
                standalone=True,
                clusterwide=not cfg.namespaces,
                namespaces=cfg.namespaces,
                liveness_endpoint=liveness,
                stop_flag=stop_kopf,
            )
        finally:
            if holding is not None:
                holding.cancel()
                await asyncio.gather(holding, return_exceptions=True)
        if elector is not None and lost is None:
            await elector.release()
    finally:
        try:
            if scaler is not None:
                await asyncio.to_thread(scaler.stop)
        finally:
            await lb.close()
            await kube.close()
    if lost is not None:
        logger.error("operator stopped: leadership lost", extra={"why": lost})
        return 1  # restarted by its Deployment, it comes back as a standby
    logger.info("operator stopped")
    return 0


async def _wait_for_leadership(elector: LeaderElector, liveness_port: int) -> bool:
    """Block until this replica holds the Lease (True) or SIGTERM/SIGINT came first (False),
    serving /healthz meanwhile. The signal handlers are removed before kopf installs its own."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    health = StandbyHealth(liveness_port)
    try:
        await health.start()
        return await elector.acquire(stop)
    finally:
        await health.stop()
        for sig in signals:
            loop.remove_signal_handler(sig)


def _quiet_libraries() -> None:
    """kopf logs every timer run at INFO ("Timer ... succeeded") and attaches its whole
    settings object to each record, httpx logs every /v1/load call: keep their warnings,
    drop the per-tick chatter and the blob."""
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)

    def drop_settings(record: logging.LogRecord) -> bool:
        record.__dict__.pop("settings", None)
        # kopf logs each retry of a TemporaryError at ERROR; the drain handler retries on
        # purpose every tick until the unit is empty (its progress is logged by handlers.py).
        return handlers.DRAIN_RETRY not in record.getMessage()

    for handler in logging.getLogger().handlers:
        handler.addFilter(drop_settings)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(OperatorConfig, argv, "pdunit operator")
    logger = setup_logging("operator", cfg.log_level)
    _quiet_libraries()
    log_config(logger, cfg)
    serve_metrics(cfg.metrics_port)
    return asyncio.run(run(cfg, logger))
