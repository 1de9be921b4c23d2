"""`pdunit proxy`: start the nvlink-proxy sidecar (config, logs, metrics, SIGTERM).

Owns process wiring only: config, which backends start (host always; cuda when a GPU
is visible or when required), the gRPC server on the unix socket, the auth socket, the
copy lane (`<socket>.copy`), and a graceful stop (no new jobs, running jobs finish,
mappings released).
Must never hold copy logic (server.py, backend_*.py).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Literal

from pydantic import BaseModel, Field

from pdunit.engine.observability import log_config, serve_metrics, set_on_signals, setup_logging
from pdunit.engine.settings import parse_config
from pdunit.engine.unit_layout import pod_socket


class ProxyConfig(BaseModel):
    """nvlink-proxy sidecar: KV copy service for one unit (gRPC over a unix socket)."""

    socket: str = Field(pod_socket("proxy"), description="gRPC unix socket path")
    auth_socket: str = Field("", description="auth socket path (default: <socket>.auth)")
    allow_uids: list[int] = Field(default_factory=list,
                                  description="uids admitted (SO_PEERCRED); empty = the proxy's own uid")
    allow_gids: list[int] = Field(default_factory=list, description="gids admitted in addition")
    cuda: Literal["auto", "on", "off"] = Field(
        "auto", description="CUDA backend: auto = start it when a GPU is visible; on = fail without one")
    workers: int = Field(4, ge=1, le=64, description="concurrent copy jobs")
    staged_chunks: int = Field(8, ge=1, le=64, description="pipeline chunks of the staged fallback")
    # The row-copy kernel's launch configuration (kernels/cuda_rows.CopyConfig) and where
    # it runs; `pdunit bench transfer --tune-kernel` measures them and prints these flags.
    copy_rows: int = Field(8, ge=1, le=64, description="copy kernel: rows per block")
    copy_threads: int = Field(128, ge=32, le=1024, multiple_of=32, description="copy kernel: threads per block")
    copy_unroll: int = Field(8, ge=1, le=16, description="copy kernel: loads in flight per thread before the stores")
    copy_hint: Literal["none", "cs", "cg"] = Field(
        "none", description="copy kernel: cache operator of loads/stores (cs = streaming, cg = L2 only)")
    copy_blocks_per_sm: int = Field(
        0, ge=0, le=64, description="copy kernel: persistent grid of this many blocks per SM (0 = one block per row group)")
    copy_device: Literal["dst", "src", "split"] = Field(
        "dst", description="GPU that runs the copy kernel: dst = pull over NVLink, src = push, "
                           "split = both at once (copy_split of the tokens pulled by dst)")
    copy_split: float = Field(0.5, gt=0, lt=1, description="copy_device=split: share of tokens the destination GPU pulls")
    cancel_retention_s: float = Field(600.0, gt=0, description="how long cancelled request ids are refused")
    metrics_port: int = Field(0, ge=0, description="Prometheus port (0 = off)")
    log_level: str = Field("info", description="log level")
    grace_s: float = Field(10.0, ge=0, description="SIGTERM: time running jobs get to finish")


def _cuda_backend(config: ProxyConfig, log: Any) -> Any:
    if config.cuda == "off":
        return None
    try:
        from pdunit.kernels.cuda_rows import CopyConfig
        from pdunit.sidecars.nvlink_proxy.backend_cuda import CudaBackend

        kernel = CopyConfig(rows=config.copy_rows, threads=config.copy_threads, unroll=config.copy_unroll,
                            hint=config.copy_hint, blocks_per_sm=config.copy_blocks_per_sm)
        backend = CudaBackend(staged_chunks=config.staged_chunks, copy_config=kernel,
                              copy_device=config.copy_device, copy_split=config.copy_split)
    except Exception as e:  # no driver / no GPU: only fatal when asked for
        if config.cuda == "on":
            raise SystemExit(f"pdunit proxy: --cuda on but the CUDA backend cannot start: {e}") from e
        log.warning("CUDA backend not started: only host regions are served", extra={"error": str(e)})
        return None
    log.info("CUDA backend ready", extra={"gpus": sorted(backend.devices), "copy_kernel": str(backend.copy_config),
                                          "copy_device": backend.copy_device})
    return backend


def main(argv: list[str] | None = None) -> int:
    config = parse_config(ProxyConfig, argv, prog="pdunit proxy")
    log = setup_logging("proxy", config.log_level)
    log_config(log, config)
    from pdunit.sidecars.nvlink_proxy.backend_host import HostBackend
    from pdunit.sidecars.nvlink_proxy.regions import AllowList
    from pdunit.sidecars.nvlink_proxy.server import (
        AuthListener,
        CopyLane,
        ProxyService,
        build_server,
    )

    backends: dict[str, Any] = {"host": HostBackend()}
    cuda = _cuda_backend(config, log)
    if cuda is not None:
        backends["cuda"] = cuda
    allow = AllowList(uids=frozenset(config.allow_uids or [os.getuid()]),
                      gids=frozenset(config.allow_gids))
    os.makedirs(os.path.dirname(os.path.abspath(config.socket)), exist_ok=True)
    service = ProxyService(backends, allow, config.cancel_retention_s, max_jobs=config.workers)
    server = build_server(config.socket, service, config.workers)
    auth = AuthListener(config.auth_socket or config.socket + ".auth", service)
    lane = CopyLane(config.socket + ".copy", service)
    stop = threading.Event()
    set_on_signals(stop, log)
    serve_metrics(config.metrics_port)
    server.start()
    lane.start()
    auth.start()
    log.info("proxy serving", extra={"socket": config.socket, "auth_socket": auth.path,
                                     "copy_lane": lane.path, "instance_id": service.instance_id,
                                     "backends": sorted(backends)})
    stop.wait()
    auth.stop()
    # No new RPCs or lane jobs; jobs already running get grace_s to finish.
    stopping = server.stop(config.grace_s)
    lane.stop(config.grace_s)
    stopping.wait()
    service.close()
    try:
        os.unlink(config.socket)
    except FileNotFoundError:
        pass
    log.info("proxy stopped", extra={"jobs_left": len(service.jobs.running())})
    return 0
