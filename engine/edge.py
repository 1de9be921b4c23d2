"""The HTTP edge of `pdunit lb` and `pdunit router`: what every byte from outside meets
before an app sees it.

Owns the limits of the uvicorn servers both run (`EdgeLimits`) and the rules both apply
at the door: which `X-Request-Id` may be echoed, which addresses a server listens on by
default, and the bearer-token check of admin endpoints and voice writes.

Every refusal here is a security event (engine/security.py). This module never routes,
parses bodies or holds request state; it must never let an app see a request that broke
a limit.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import re
import socket
from collections.abc import Mapping
from typing import Any, ClassVar

import httptools
import uvicorn
from pydantic import BaseModel, Field
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdunit.engine.security import SecretFileError, read_secret_file, same_bytes, security_event

log = logging.getLogger("pdunit.edge")

REQUEST_ID_MAX = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:+/=-]{1,%d}" % REQUEST_ID_MAX)  # noqa: UP031
REQUEST_ID_RULE = f"1-{REQUEST_ID_MAX} characters of A-Z a-z 0-9 . _ : + / = -"
POD_IP_ENV = "PDUNIT_POD_IP"


# The size of a request's line and headers (431), the time they may take to arrive
# (408, or a silent close for a connection that sent nothing), the time a body may take
# once its headers are in (408), idle keep-alive, and the number of open connections
# (503): flags of both the LB and the router.
class EdgeLimits(BaseModel):
    """The limits of one HTTP server; a base of LBConfig and RouterConfig (their flags)."""

    max_header_bytes: int = Field(
        16384, ge=1024, description="largest request line + headers of one request (431 above)"
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a request's line and headers must arrive within this, counted from the "
        "connection's opening or the request's first byte (408, or closed if nothing came)",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body must arrive whole within this after its headers (408)"
    )
    keep_alive_timeout_s: float = Field(
        30.0, gt=0, description="an idle keep-alive connection is closed after this"
    )
    max_connections: int = Field(
        1024,
        ge=1,
        le=65536,
        description="open connections at most; one more is answered 503 and closed",
    )


def listen_hosts(host: str) -> list[str]:
    """The addresses a server binds for its --host. Given: that one. Empty (the default):
    in a unit's pod ($PDUNIT_POD_IP, which the operator sets in every container) the pod
    IP, for the router, the operator and the kubelet, and 127.0.0.1, for the pod's own
    hooks; in another pod (the kubelet sets $KUBERNETES_SERVICE_HOST) 0.0.0.0, which
    in a pod's network namespace means its IP and loopback; anywhere else 127.0.0.1.
    Never every interface of a host unless asked (`--host 0.0.0.0`)."""
    if host:
        return [host]
    pod_ip = os.environ.get(POD_IP_ENV, "")
    if pod_ip:
        return list(dict.fromkeys([pod_ip, "127.0.0.1"]))
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return ["0.0.0.0"]
    return ["127.0.0.1"]


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def bind_sockets(hosts: list[str], port: int) -> list[socket.socket]:
    """One listening socket per address, all on one port (port 0: the first one's)."""
    socks: list[socket.socket] = []
    try:
        for host in hosts:
            socks.append(bind_socket(host, port))
            port = socks[0].getsockname()[1]
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def request_id_problem(value: str) -> str | None:
    """Why a client's X-Request-Id may not be used (and so never echoed), or None."""
    if _REQUEST_ID.fullmatch(value):
        return None
    return f"X-Request-Id has {len(value)} characters; it must be {REQUEST_ID_RULE}"


def read_token_file(path: str, flag: str) -> bytes | None:
    """The bearer token in `path` (None when no file is configured); SecretFileError
    names the flag, the file and the fix."""
    if not path:
        return None
    try:
        return read_secret_file(path)
    except SecretFileError as exc:
        raise SecretFileError(f"{flag}: {exc}") from None


def bearer_of(headers: Mapping[str, str]) -> bytes | None:
    """The token of `Authorization: Bearer <token>`; None when the header is absent, of
    another scheme, or carries no token (a caller tells "no credential" from "a wrong one")."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return None
    return given.strip().encode("latin-1", "replace")


def bearer_matches(headers: Mapping[str, str], token: bytes) -> bool:
    """`Authorization: Bearer <token>`, compared in constant time."""
    given = bearer_of(headers)
    return given is not None and same_bytes(given, token)


class _HeadTooLarge(Exception):
    pass


def _response(status: int, reason: str, code: str, message: str, **extra: Any) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message, **extra}}).encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, reason.encode(), len(body))
    ) + body


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of `EdgeLimits` (set per server by
    `guarded_protocol`). httptools buffers a header value of any length and uvicorn arms
    no timer before the first request nor while a body arrives: this adds both."""

    limits: ClassVar[EdgeLimits] = EdgeLimits.model_validate({})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # waiting for (or reading) a request line and headers
        self._head_bytes = 0  # request line + headers seen by the parser callbacks
        self._head_fed = 0  # bytes fed while the head stayed incomplete
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.limits.max_connections
        if len(self.connections) > limit:
            self._refuse(
                "too_many_connections", 503, "Service Unavailable",
                f"the server holds {limit} connections, its limit (--max-connections); retry later",
                limit=limit,
            )
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._head_too_large()
            else:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        if self._in_head and not self.transport.is_closing():
            # httptools keeps an unfinished header value in its own buffer, out of the
            # callbacks' sight: count what it was fed
            self._head_fed += len(data)
            if self._head_fed > self.limits.max_header_bytes:
                self._head_too_large()

    # ------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = self._head_fed = 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_fed = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # ------------------------------------------------------------ refusals

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.limits.max_header_bytes:
            raise _HeadTooLarge

    def _head_too_large(self) -> None:
        limit = self.limits.max_header_bytes
        self._refuse(
            "header_too_large", 431, "Request Header Fields Too Large",
            f"the request line and headers exceed {limit} bytes (--max-header-bytes)",
            limit=limit,
        )

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        seen = self._head_bytes + self._head_fed
        timeout = self.limits.header_timeout_s
        if not seen:
            security_event("header_timeout", client=self._client(), bytes=0, timeout_s=timeout)
            self.transport.close()  # nothing was asked: nothing to answer
            return
        self._refuse(
            "header_timeout", 408, "Request Timeout",
            f"the request line and headers did not arrive within {timeout:g} s "
            f"(--header-timeout-s)",
            limit=timeout,
        )

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        timeout = self.limits.body_timeout_s
        if cycle.response_started and not cycle.response_complete:
            return  # the app answered while the body still comes: its answer stands
        if not cycle.response_started:
            cycle.disconnected = True  # the app reads a disconnect and writes nothing more
            cycle.message_event.set()
        self._refuse(
            "body_timeout", 408, "Request Timeout",
            f"the request body did not arrive whole within {timeout:g} s of its headers "
            f"(--body-timeout-s)",
            limit=timeout,
            written=not cycle.response_started,
        )

    def _refuse(
        self, code: str, status: int, reason: str, message: str, written: bool = True,
        **extra: Any,
    ) -> None:
        security_event(code, client=self._client(), status=status, **extra)
        if written:
            self.transport.write(_response(status, reason, code, message, **extra))
        self.transport.close()
        self._cancel_timers()

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _client(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else ""


def guarded_protocol(limits: EdgeLimits) -> type[GuardedHttpTools]:
    """The protocol class of one server with these limits."""
    return type("GuardedHttpTools", (GuardedHttpTools,), {"limits": limits})


def server_config(app: Any, limits: EdgeLimits, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn config every pdunit HTTP server runs: httptools behind the guards
    (named: uvicorn's "auto" falls back to the pure-Python h11 without a word), no
    websockets, no Server header, no uvicorn log config or access log, and no
    proxy-headers rewrite: uvicorn's default takes the client's address from
    X-Forwarded-For whenever the peer is 127.0.0.1, so anyone on loopback (or any
    sidecar) could claim any address. The router honours forwarded headers itself, only
    from --trusted-proxies."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(limits),
        ws="none",
        proxy_headers=False,
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
        server_header=False,
        log_config=None,
        access_log=False,
        **kwargs,
    )
