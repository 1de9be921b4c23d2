"""`pdunit proxy`: start the nvlink-proxy sidecar (config, logs, metrics, SIGTERM).

Owns process wiring only: config, which backends start (host always; cuda when a GPU
is visible or when required), the gRPC server on the unix socket, the auth socket,
and a graceful stop (no new jobs, running jobs finish, mappings released).
Must never hold copy logic (server.py, backend_*.py).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Literal

from pydantic import BaseModel, Field

from pdunit.engine.observability import log_config, serve_metrics, setup_logging
from pdunit.engine.settings import parse_config


class ProxyConfig(BaseModel):
    """nvlink-proxy sidecar: KV copy service for one unit (gRPC over a unix socket)."""

    socket: str = Field("/run/pdunit/proxy.sock", description="gRPC unix socket path")
    auth_socket: str = Field("", description="auth socket path (default: <socket>.auth)")
    allow_uids: list[int] = Field(default_factory=list,
                                  description="uids admitted (SO_PEERCRED); empty = the proxy's own uid")
    allow_gids: list[int] = Field(default_factory=list, description="gids admitted in addition")
    cuda: Literal["auto", "on", "off"] = Field(
        "auto", description="CUDA backend: auto = start it when a GPU is visible; on = fail without one")
    workers: int = Field(4, ge=1, le=64, description="concurrent copy jobs")
    staged_chunks: int = Field(8, ge=1, le=64, description="pipeline chunks of the staged fallback")
    cancel_retention_s: float = Field(600.0, gt=0, description="how long cancelled request ids are refused")
    metrics_port: int = Field(0, ge=0, description="Prometheus port (0 = off)")
    log_level: str = Field("info", description="log level")
    grace_s: float = Field(10.0, ge=0, description="SIGTERM: time running jobs get to finish")


def _cuda_backend(config: ProxyConfig, log: Any) -> Any:
    if config.cuda == "off":
        return None
    try:
        from pdunit.sidecars.nvlink_proxy.backend_cuda import CudaBackend

        backend = CudaBackend(staged_chunks=config.staged_chunks)
    except Exception as e:  # no driver / no GPU: only fatal when asked for
        if config.cuda == "on":
            raise SystemExit(f"pdunit proxy: --cuda on but the CUDA backend cannot start: {e}") from e
        log.warning("CUDA backend not started: only host regions are served", extra={"error": str(e)})
        return None
    log.info("CUDA backend ready", extra={"gpus": sorted(backend.devices)})
    return backend


def main(argv: list[str] | None = None) -> int:
    config = parse_config(ProxyConfig, argv, prog="pdunit proxy")
    log = setup_logging("proxy", config.log_level)
    log_config(log, config)
    from pdunit.sidecars.nvlink_proxy.backend_host import HostBackend
    from pdunit.sidecars.nvlink_proxy.regions import AllowList
    from pdunit.sidecars.nvlink_proxy.server import AuthListener, ProxyService, build_server

    backends: dict[str, Any] = {"host": HostBackend()}
    cuda = _cuda_backend(config, log)
    if cuda is not None:
        backends["cuda"] = cuda
    allow = AllowList(uids=frozenset(config.allow_uids or [os.getuid()]),
                      gids=frozenset(config.allow_gids))
    os.makedirs(os.path.dirname(os.path.abspath(config.socket)), exist_ok=True)
    service = ProxyService(backends, allow, config.cancel_retention_s)
    server = build_server(config.socket, service, config.workers)
    auth = AuthListener(config.auth_socket or config.socket + ".auth", service)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        log.info("shutdown requested", extra={"signal": signal.Signals(signum).name})
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    serve_metrics(config.metrics_port)
    server.start()
    auth.start()
    log.info("proxy serving", extra={"socket": config.socket, "auth_socket": auth.path,
                                     "instance_id": service.instance_id, "backends": sorted(backends)})
    stop.wait()
    auth.stop()
    # No new RPCs; jobs already running get grace_s to finish.
    server.stop(config.grace_s).wait()
    service.close()
    try:
        os.unlink(config.socket)
    except FileNotFoundError:
        pass
    log.info("proxy stopped", extra={"jobs_left": len(service.jobs.running())})
    return 0
