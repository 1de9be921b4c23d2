"""`pdunit router`: parse config, log it, serve the router until SIGTERM, drain, exit.

Owns the process: config, logging, the uvicorn server (behind engine/edge.py's limits)
and the shutdown sequence
(SIGTERM -> /readyz 503 -> stop accepting -> open streams finish, up to
--shutdown-grace-s -> exit 0). It holds no routing logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Iterator

import uvicorn
from prometheus_client import REGISTRY

from pdunit.engine.edge import bind_sockets, listen_hosts, read_token_file, server_config
from pdunit.engine.observability import log_config, setup_logging, shutdown_event
from pdunit.engine.router.app import Discovery, create_app
from pdunit.engine.router.config import RouterConfig, check_discovery
from pdunit.engine.router.discovery import (
    KubernetesDiscovery,
    StaticDiscovery,
    parse_static_units,
    read_incluster_namespace,
)
from pdunit.engine.security import SecretFileError
from pdunit.engine.settings import ConfigError, parse_config


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: SIGTERM goes through shutdown_event,
    like every pdunit process, and we decide the order of the drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_discovery(config: RouterConfig, log: logging.Logger) -> Discovery | str:
    """The configured discovery, or an error message naming the flag to fix."""
    if config.discovery == "static":
        return StaticDiscovery(parse_static_units(config.units))
    namespace = config.namespace or read_incluster_namespace()
    if not namespace:
        return (
            "pdunit router: --namespace (PDUNIT_NAMESPACE) is empty and the router is not in "
            "a pod; give the namespace of the PDUnits"
        )
    return KubernetesDiscovery(namespace, config.unit_set, log)


async def _serve(
    config: RouterConfig, discovery: Discovery, log: logging.Logger, admin_token: bytes | None
) -> int:
    app = create_app(config, discovery, log, registry=REGISTRY, admin_token=admin_token)
    try:
        sockets = bind_sockets(listen_hosts(config.host), config.port)
    except OSError as exc:
        log.error("router failed to start", extra={"reason": str(exc)})
        print(f"pdunit router: cannot listen: {exc}", file=sys.stderr)
        return 1
    server = _Server(
        server_config(  # the LB's edge: httptools behind the header, body and connection limits
            app, config, lifespan="on", timeout_graceful_shutdown=config.shutdown_grace_s
        )
    )
    stop = shutdown_event(log)
    serving = asyncio.create_task(server.serve(sockets=sockets))
    stopping = asyncio.create_task(stop.wait())
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if server.started:
        hosts = [s.getsockname()[0] for s in sockets]
        log.info("router listening", extra={"hosts": hosts, "port": sockets[0].getsockname()[1]})
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stopping.done() and not serving.done():
        state = app.state.router
        state.shutting_down = True  # /readyz 503 for whoever still asks
        log.info(
            "draining: no new connections, waiting for open streams",
            extra={
                "streams_in_flight": sum(u.router_in_flight for u in state.table.units.values()),
                "grace_s": config.shutdown_grace_s,
            },
        )
        server.should_exit = True
    stopping.cancel()
    try:
        await serving
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        log.error("router failed to start", extra={"code": exc.code})
        return int(exc.code or 1)
    log.info("router stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(RouterConfig, argv, prog="pdunit router")
    except ConfigError:
        return 2  # parse_config printed the field, the flag and the problem
    problem = check_discovery(config)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    try:
        admin_token = read_token_file(config.admin_token_file, "--admin-token-file")
    except SecretFileError as exc:
        print(f"pdunit router: {exc}", file=sys.stderr)
        return 2
    log = setup_logging("router", config.log_level)
    log_config(log, config)
    discovery = build_discovery(config, log)
    if isinstance(discovery, str):
        print(discovery, file=sys.stderr)
        return 2
    return asyncio.run(_serve(config, discovery, log, admin_token))


if __name__ == "__main__":
    sys.exit(main())
