"""Serving gRPC on a unix socket in the pod's shared emptyDir (/run/pdunit), the same way
for P, D and the monolith: stale socket removed, graceful stop on SIGTERM; and the options
of the channels to such sockets (a peer that starts late or restarts is reached again
within a reconnect backoff of half a second)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import grpc

# Prompts of 2k x 11 int64 are ~180 KB; step messages grow with the batch.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A peer in the pod that is not serving yet (at the pod's start) or again (after its
# restart) is reached within half a second of serving, not after gRPC's default backoff
# (1 s growing to 120 s: a D up 3 s after P was reached ~2.8 s later). A refused connect
# on a unix socket costs next to nothing; the connect timeout stays gRPC's.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def unix_target(path: str) -> str:
    return f"unix://{os.path.abspath(path)}"


async def start_unix_server(path: str, register, logger: logging.Logger) -> grpc.aio.Server:
    """`register(server)` adds the servicers. Returns the started server."""
    sock = Path(path)
    sock.parent.mkdir(parents=True, exist_ok=True)
    if sock.exists() or sock.is_symlink():
        sock.unlink()  # left by a previous instance of this container: we own this path
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    register(server)
    server.add_insecure_port(unix_target(path))
    await server.start()
    logger.info("serving gRPC", extra={"socket": str(sock)})
    return server


def channel(path: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(unix_target(path), options=[*CHANNEL_OPTIONS, *RECONNECT_OPTIONS])


def sync_channel(path: str) -> grpc.Channel:
    return grpc.insecure_channel(unix_target(path), options=[*CHANNEL_OPTIONS, *RECONNECT_OPTIONS])
