"""`pdunit lb`: run the unit's HTTP API (app.py) under uvicorn until SIGTERM.

Owns the process: config, JSON logs, the two HTTP servers and graceful shutdown. The
stream port (--host/--port) serves the API; the admin port (--admin-host/--admin-port,
loopback by default, a bearer token from --admin-token-file when it is not) serves only
the admin routes; both behind the edge's limits (engine/edge.py). On SIGTERM or SIGINT
the LB stops taking streams (503 + Retry-After, /readyz 503), lets the streams in flight
finish for up to --shutdown-timeout-s, cuts the rest with an error record, then exits.
Never holds request state of its own, never logs a token (only whether one is set).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from pdunit.engine.edge import (
    bind_socket,
    bind_sockets,
    listen_hosts,
    read_token_file,
    server_config,
)
from pdunit.engine.lb.app import create_admin_app, create_app
from pdunit.engine.lb.balancer import LoadBalancer
from pdunit.engine.lb.config import LBConfig
from pdunit.engine.observability import (
    log_config,
    settle_gc_for_serving,
    setup_logging,
    shutdown_event,
)
from pdunit.engine.security import SecretFileError
from pdunit.engine.settings import ConfigError, parse_config


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: shutdown_event() owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def admin_token(config: LBConfig) -> bytes | None:
    """The admin bearer token of --admin-token-file (None when unset)."""
    return read_token_file(config.admin_token_file, "--admin-token-file")


@dataclass
class Servers:
    """The stream and admin servers of one LB, bound and not yet serving."""

    stream: _Server
    stream_sockets: list[socket.socket]
    admin: _Server
    admin_socket: socket.socket

    @property
    def port(self) -> int:
        return int(self.stream_sockets[0].getsockname()[1])

    @property
    def hosts(self) -> list[str]:
        return [str(s.getsockname()[0]) for s in self.stream_sockets]

    @property
    def admin_port(self) -> int:
        return int(self.admin_socket.getsockname()[1])

    async def run(self) -> tuple[asyncio.Task[None], asyncio.Task[None]]:
        """Starts the stream server (its lifespan starts the LB), then the admin one: an
        admin call never reaches an LB that has not started."""
        stream = asyncio.ensure_future(self.stream.serve(sockets=self.stream_sockets))
        while not self.stream.started and not stream.done():
            await asyncio.sleep(0.01)
        admin = asyncio.ensure_future(self.admin.serve(sockets=[self.admin_socket]))
        while not self.admin.started and not admin.done() and not stream.done():
            await asyncio.sleep(0.01)
        return stream, admin

def build_servers(config: LBConfig, lb: LoadBalancer, token: bytes | None) -> Servers:
    stream_sockets = bind_sockets(listen_hosts(config.host), config.port)
    try:
        admin_socket = bind_socket(config.admin_host, config.admin_port)
    except OSError:
        for sock in stream_sockets:
            sock.close()
        raise
    stream = _Server(
        server_config(create_app(lb), config, lifespan="on", timeout_graceful_shutdown=5)
    )
    admin = _Server(
        server_config(create_admin_app(lb, token), config, lifespan="off", timeout_graceful_shutdown=1)
    )
    return Servers(stream, stream_sockets, admin, admin_socket)


async def serve(config: LBConfig, token: bytes | None) -> int:
    logger = setup_logging("lb", config.log_level)
    log_config(logger, config)
    try:
        lb = LoadBalancer(config)  # loads what --model, --codec and --voices name
    except ValueError as exc:
        logger.error("cannot start", extra={"reason": str(exc)})
        print(f"pdunit lb: {exc}", file=sys.stderr)
        return 2
    try:
        servers = build_servers(config, lb, token)
    except OSError as exc:
        logger.error("cannot listen", extra={"reason": str(exc)})
        print(f"pdunit lb: cannot listen: {exc}", file=sys.stderr)
        return 1
    settle_gc_for_serving(logger)
    logger.info(
        "listening",
        extra={
            "hosts": servers.hosts,
            "port": servers.port,
            "admin_host": config.admin_host,
            "admin_port": servers.admin_port,
            "admin_token": bool(token),
            "voices_token": lb.speech.voices_token is not None,  # whether the store takes writes
            "http": "httptools",
        },
    )
    stop = shutdown_event(logger)
    serving, admin = await servers.run()
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({serving, admin, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done() or admin.done():
        stopping.cancel()
        done = serving if serving.done() else admin
        logger.error(
            "HTTP server stopped on its own",
            extra={"server": "stream" if done is serving else "admin", "error": repr(done.exception())},
        )
        servers.stream.should_exit = servers.admin.should_exit = True
        await asyncio.gather(serving, admin, return_exceptions=True)
        return 1
    cut = await lb.shutdown(config.shutdown_timeout_s)
    servers.admin.should_exit = True
    servers.stream.should_exit = True
    await asyncio.gather(admin, serving)
    logger.info("stopped", extra={"streams_cut": cut})
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(LBConfig, argv, prog="pdunit lb")
    except ConfigError:
        return 2
    try:
        token = admin_token(config)
    except SecretFileError as exc:
        print(f"pdunit lb: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config, token))


if __name__ == "__main__":
    sys.exit(main())
