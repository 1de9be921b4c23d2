"""`pdunit lb`: run the unit's HTTP API (app.py) under uvicorn until SIGTERM.

Owns the process: config, JSON logs, the HTTP server and graceful shutdown. On SIGTERM
or SIGINT the LB stops taking streams (503 + Retry-After, /readyz 503), lets the
streams in flight finish for up to --shutdown-timeout-s, cuts the rest with an error
record, then exits. Never holds request state of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Iterator

import uvicorn

from pdunit.engine.lb.app import LoadBalancer, create_app
from pdunit.engine.lb.config import LBConfig
from pdunit.engine.observability import (
    log_config,
    settle_gc_for_serving,
    setup_logging,
    shutdown_event,
)
from pdunit.engine.settings import ConfigError, parse_config


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: shutdown_event() owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(config: LBConfig) -> int:
    logger = setup_logging("lb", config.log_level)
    log_config(logger, config)
    lb = LoadBalancer(config)
    app = create_app(lb)
    sock = bind_socket(config.host, config.port)
    settle_gc_for_serving(logger)
    logger.info("listening", extra={"host": config.host, "port": sock.getsockname()[1], "http": "httptools"})
    server = _Server(
        uvicorn.Config(
            # httptools, named: uvicorn's "auto" would fall back to the pure-Python h11
            # without a word when the C parser is missing
            app, http="httptools", log_config=None, access_log=False, lifespan="on",
            timeout_graceful_shutdown=5,
        )
    )
    stop = shutdown_event(logger)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        stopping.cancel()
        exc = serving.exception()
        logger.error("HTTP server stopped on its own", extra={"error": repr(exc)})
        return 1
    cut = await lb.shutdown(config.shutdown_timeout_s)
    server.should_exit = True
    await serving
    logger.info("stopped", extra={"streams_cut": cut})
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(LBConfig, argv, prog="pdunit lb")
    except ConfigError:
        return 2
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
