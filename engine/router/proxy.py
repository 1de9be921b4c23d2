"""Forwarding one `POST /v1/tts/stream` or `/v1/audio/speech` to a unit and relaying it back.

Owns the attempt loop (pick a unit, send, retry elsewhere on a refusal), the affinity key
(the session header, else a speech body's voice), the header policy (`to_unit`,
`to_client`), and the relay that copies the unit's body to the client chunk by chunk.

The one rule this module must never break: a retry happens only when the unit cannot
have started the stream (`RETRIED_STATUS`, or a refused / timed-out connection). Once a
unit answered 200, that unit owns the request: a later failure ends the client's stream
with an error trailer (NDJSON) or a broken connection (binary frames, audio).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from pdunit.engine.edge import request_id_problem
from pdunit.engine.http_body import BadContentLength, BodyTooLarge, read_limited
from pdunit.engine.observability import now_ns
from pdunit.engine.router.table import RoutingTable, Unit
from pdunit.engine.security import security_event
from pdunit.engine.tracing import TRACE_HEADERS, Span, Tracing

# The header policy: hop-by-hop headers (RFC 9110 7.6.1: those Connection names,
# Keep-Alive, TE, Trailer, Transfer-Encoding, Upgrade, Proxy-*) and credentials
# (Authorization, Cookie) never cross the router in either direction (but Authorization
# towards a unit on the voice routes, voices.py: the voice store's token), nor Set-Cookie or
# the unit's internal X-Pdunit-* headers towards the client; a client's X-Forwarded-For
# / Forwarded are kept only from --trusted-proxies. The body is read up to
# --max-body-bytes and refused (413, connection closed) the moment it passes it.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"})
CREDENTIALS = frozenset({"authorization", "cookie", "proxy-authorization"})
FORWARDED = frozenset(
    {"forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip"}
)
# The router sets these itself on the way to a unit.
SET_BY_ROUTER = frozenset({"host", "content-length", "x-request-id"})
# The unit's response headers a client may see; the router adds X-Pdunit-Unit. Every other
# X-Pdunit-* header is internal to the unit.
UNIT_HEADERS_FOR_CLIENT = frozenset(
    {"x-pdunit-request-id", "x-pdunit-sample-rate", "x-pdunit-prompt-rows", "x-pdunit-cached-rows"}
)
NOT_TO_CLIENT = frozenset({"set-cookie", "content-length", "date", "server", "x-request-id"})
NDJSON = "application/x-ndjson"
STREAM_PATH, SPEECH_PATH = "/v1/tts/stream", "/v1/audio/speech"
# A speech body is parsed for its voice only up to the LB's own limit for it (a larger one
# is refused there, 413): the router reads whole bodies up to --max-body-bytes anyway.
SPEECH_PEEK_BYTES = 64 << 10
VOICE_NAME_CHARS = 64  # a stored voice's name is 1-64 characters (engine/audio/voices.py)
# A unit's answers that prove it did not start the stream and that another unit may not
# give: draining/unready, full, and P or D failing the start.
# The LB answers 200 only with the first frame, so any status it sends is before the
# first byte; 502 is P or D failing the start, which another unit may not. A request
# that reached a unit and then failed before any answer (read timeout, reset) is not
# retried either: the unit may be running it.
RETRIED_STATUS = frozenset({503, 429, 502})


class RouterMetrics:
    """The router's Prometheus series (units by state are collected from the table)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pdunit_router_requests_total",
            "Streams by the unit that served them and how they ended",
            ["unit", "outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "pdunit_router_retries_total",
            "Attempts refused by a unit before streaming, then tried elsewhere",
            ["unit", "reason"],
            registry=registry,
        )
        self.decision_seconds = Histogram(
            "pdunit_router_decision_latency_seconds",
            "Time to pick a unit (one call of the routing decision)",
            buckets=(1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2),
            registry=registry,
        )
        self.decisions = Counter(
            "pdunit_router_decisions_total",
            "Routing decisions by how the unit was chosen: affinity (the key's owner), "
            "walked (owner at its load bound), least_loaded (no key), over_bound",
            ["how"],
            registry=registry,
        )
        self.affinity_keys = Counter(
            "pdunit_router_affinity_keys_total",
            "Requests by where their affinity key came from: header (the session header), "
            "voice (a speech body's voice), none (least loaded)",
            ["source"],
            registry=registry,
        )
        self.first_byte_seconds = Histogram(
            "pdunit_router_upstream_first_byte_seconds",
            "From the request's arrival to the first body byte from the unit",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )
        self.session_moves = Counter(
            "pdunit_router_session_moves_total",
            "Session keys whose stream went to another unit than their previous one",
            registry=registry,
        )
        self.poll_failures = Counter(
            "pdunit_router_unit_poll_failures_total",
            "Failed /v1/load polls by unit",
            ["unit"],
            registry=registry,
        )
        self.by_unit = (self.requests, self.retries, self.poll_failures)

    def forget_unit(self, name: str) -> None:
        """Remove every series labelled `unit=name`: unit names change at every scale
        event and rollout, so series of departed units would otherwise grow without
        bound (called by the table once the unit left and no stream to it is open)."""
        for metric in self.by_unit:
            metric.remove_by_labels({"unit": name})


@dataclass
class ForwardPolicy:
    session_header: str = "X-Session-Id"
    max_attempts: int = 3
    retry_after_s: int = 1
    max_body_bytes: int = 4 << 20
    trusted_proxies: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    def trusts(self, peer: str | None) -> bool:
        """Whether `peer` (the TCP peer's address) is a proxy whose forwarded headers count."""
        if not peer or not self.trusted_proxies:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in net for net in self.trusted_proxies)


def _hop_by_hop(headers: list[tuple[str, str]]) -> set[str]:
    """The fixed hop-by-hop names plus every header a Connection header names."""
    names = set(HOP_BY_HOP)
    for key, value in headers:
        if key.lower() == "connection":
            names.update(t.strip().lower() for t in value.split(",") if t.strip())
    return names


def to_unit(
    headers: list[tuple[str, str]], peer: str | None, policy: ForwardPolicy, request_id: str,
    credentials: frozenset[str] = frozenset(),
) -> list[tuple[str, str]]:
    """The request headers a unit gets: no hop-by-hop, no credentials (but those named in
    `credentials`: the voice routes pass Authorization), forwarded headers only from a
    trusted proxy, and X-Forwarded-For ending with the TCP peer."""
    drop = _hop_by_hop(headers) | (CREDENTIALS - credentials) | SET_BY_ROUTER
    trusted = policy.trusts(peer)
    if not trusted:
        drop |= FORWARDED
    out: list[tuple[str, str]] = []
    prior: list[str] = []
    for key, value in headers:
        name = key.lower()
        if name in drop or name.startswith("proxy-"):
            continue
        if name == "x-forwarded-for":
            prior.append(value)
            continue
        out.append((name, value))
    out.append(("x-request-id", request_id))
    if peer:
        out.append(("x-forwarded-for", ", ".join([*prior, peer])))
    return out


def to_client(headers: httpx.Headers) -> dict[str, str]:
    """The unit's response headers a client gets: no hop-by-hop, no Set-Cookie, no
    internal X-Pdunit-* header; the router sets X-Request-Id and X-Pdunit-Unit."""
    items = list(headers.multi_items())
    drop = _hop_by_hop(items) | NOT_TO_CLIENT | CREDENTIALS
    out: dict[str, str] = {}
    for key, value in items:
        name = key.lower()
        if name in drop or name.startswith("proxy-"):
            continue
        if name.startswith("x-pdunit-") and name not in UNIT_HEADERS_FOR_CLIENT:
            continue
        out[name] = value
    return out


def voice_key(body: bytes) -> str | None:
    """The affinity key of a speech body: `voice:<name>` from its JSON `voice` (a name or
    OpenAI's `{"id": name}`), so a voice's requests reach the unit whose P caches its
    prefix. None for anything else (too large, not JSON, nested past the parser, no
    voice, not a voice name): the body still goes to a unit, whose LB refuses it."""
    if len(body) > SPEECH_PEEK_BYTES:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    voice = doc.get("voice") if isinstance(doc, dict) else None
    if isinstance(voice, dict):
        voice = voice.get("id")
    if not isinstance(voice, str) or not 1 <= len(voice) <= VOICE_NAME_CHARS:
        return None
    return f"voice:{voice}"


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message, **extra}}, status_code=status, headers=headers
    )


def checked_request_id(request: Request) -> str | Response:
    """The client's X-Request-Id (the LB's rule), a new one when it gave none, or the 400."""
    given = request.headers.get("x-request-id")
    problem = request_id_problem(given) if given is not None else None
    if problem:
        security_event("bad_request_id", length=len(given or ""))
        return error_response(400, "bad_header", problem, field="X-Request-Id")
    return given or uuid.uuid4().hex


def _unit_error_message(body: bytes) -> str:
    try:
        doc = json.loads(body)
        return str(doc["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


@dataclass
class _Request:
    request_id: str
    session: str | None
    started: float
    attempts: list[dict[str, Any]] = field(default_factory=list)
    span: Span | None = None  # the request's trace span (engine/tracing.py), None when off


class Forwarder:
    """The attempt loop for one request; one instance per router."""

    def __init__(
        self,
        table: RoutingTable,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        policy: ForwardPolicy,
        logger: logging.Logger,
        tracing: Tracing | None = None,
    ) -> None:
        self.table = table
        self.client = client
        self.metrics = metrics
        self.policy = policy
        self.log = logger
        self.tracing = tracing or Tracing("router", "")

    async def read_body(self, request: Request) -> bytes | Response:
        """The whole body, or a 413 past --max-body-bytes (nothing is forwarded; the
        connection closes after a bounded rest is read, engine/http_body.py)."""
        limit = self.policy.max_body_bytes
        close = {"connection": "close"}
        try:
            return await read_limited(request, limit)
        except BadContentLength as exc:
            return error_response(400, "bad_header", str(exc), headers=close, field="Content-Length")
        except BodyTooLarge as exc:
            said = "is" if exc.declared else "exceeds"
            return error_response(
                413,
                "body_too_large",
                f"request body {said} {exc.size} bytes; the router forwards at most {limit} "
                "(--max-body-bytes)",
                headers=close,
                field="body",
                limit=limit,
            )

    async def forward(self, request: Request, path: str = STREAM_PATH) -> Response:
        """One request to `path` on a unit: /v1/tts/stream, or /v1/audio/speech whose
        body's voice is the affinity key when no session header is given."""
        request_id = checked_request_id(request)
        if isinstance(request_id, Response):
            self.metrics.requests.labels(unit="", outcome="client_error").inc()
            return request_id
        ctx = _Request(
            request_id=request_id,
            session=request.headers.get(self.policy.session_header) or None,
            started=time.perf_counter(),
        )
        ctx.span = self.tracing.start("router.request", now_ns(), request.headers.items(),
                                      request_id=ctx.request_id, path=path)
        try:
            response = await self._forward(request, path, ctx)
        except BaseException as exc:
            self._end_span(ctx, "internal_error", 500, repr(exc))
            raise
        if not isinstance(response, RelayResponse):  # a stream ends the span when it ends
            self._end_span(ctx, "answered", response.status_code)
        return response

    def _end_span(self, ctx: _Request, outcome: str, status: int, error: str = "") -> None:
        if ctx.span is not None:
            ctx.span.end({}, (), now_ns(), error or ("" if status < 500 else outcome), outcome=outcome,
                         status=status, attempts=len(ctx.attempts))
            ctx.span = None

    async def _forward(self, request: Request, path: str, ctx: _Request) -> Response:
        try:
            body = await self.read_body(request)
        except ClientDisconnect:
            # gone before its body arrived (or cut by --body-timeout-s, already answered)
            self.metrics.requests.labels(unit="", outcome="client_disconnected").inc()
            return Response(status_code=499)
        if isinstance(body, Response):
            body.headers["x-request-id"] = ctx.request_id
            self.metrics.requests.labels(unit="", outcome="client_error").inc()
            return body
        source = "header" if ctx.session is not None else "none"
        if ctx.session is None and path == SPEECH_PATH:
            ctx.session = voice_key(body)
            source = "voice" if ctx.session is not None else source
        self.metrics.affinity_keys.labels(source=source).inc()
        peer = request.client.host if request.client is not None else None
        headers = to_unit(request.headers.items(), peer, self.policy, ctx.request_id)
        if ctx.span is not None:  # the unit's spans are children of this request's
            headers = [h for h in headers if h[0] not in TRACE_HEADERS] + list(ctx.span.headers().items())
        tried: list[str] = []
        for _ in range(self.policy.max_attempts):
            t0 = time.perf_counter()
            decision = self.table.pick(ctx.session, frozenset(tried))
            self.metrics.decision_seconds.observe(time.perf_counter() - t0)
            if decision is None:
                break
            self.metrics.decisions.labels(how=decision.how).inc()
            unit = decision.unit
            tried.append(unit.name)
            outcome = await self._attempt(unit, path, body, headers, ctx, decision.how)
            if outcome is not None:
                return outcome
        return self._no_unit(ctx)

    async def _attempt(
        self, unit: Unit, path: str, body: bytes, headers: list[tuple[str, str]], ctx: _Request, how: str
    ) -> Response | None:
        """Send to `unit`: a Response to return, or None to try the next unit."""
        self.table.acquire(unit)
        request = self.client.build_request(
            "POST", unit.url + path, content=body, headers=headers
        )
        try:
            upstream = await self.client.send(request, stream=True)
        # Every outcome is counted before `release`: the release may remove the series of
        # a unit that has left the table (RoutingTable.on_unit_gone).
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # Nothing reached the unit: safe to go elsewhere.
            reason = f"connect to {unit.url} failed: {exc!r}"
            self._refused(unit, ctx, "connect_error", reason)
            self.table.release(unit)
            self.table.mark_unreachable(unit.name, reason)
            return None
        except httpx.TimeoutException as exc:
            answer = self._failed_before_answer(unit, ctx, 504, "unit_timeout", exc)
            self.table.release(unit)
            return answer
        except httpx.HTTPError as exc:
            answer = self._failed_before_answer(unit, ctx, 502, "unit_error", exc)
            self.table.release(unit)
            return answer
        except BaseException:
            self.table.release(unit)
            raise

        status = upstream.status_code
        if status in RETRIED_STATUS:
            text = await self._read_refusal(unit, upstream)
            message = _unit_error_message(text)
            self._refused(unit, ctx, f"unit_{status}", f"HTTP {status}: {message}")
            self.table.release(unit)
            self.table.mark_rejected(unit.name, status, message)
            return None

        if status != 200:
            # The unit judged the request (400/413/422) or failed it (5xx): its answer is
            # the answer; another unit would judge the same body the same way.
            text = await self._read_refusal(unit, upstream)
            outcome = "client_error" if status < 500 else "unit_error"
            self.metrics.requests.labels(unit=unit.name, outcome=outcome).inc()
            self.table.release(unit)
            self._log_done(unit, ctx, outcome, status, 0)
            passthrough = to_client(upstream.headers)
            passthrough["x-request-id"] = ctx.request_id
            passthrough["x-pdunit-unit"] = unit.name
            return Response(text, status_code=status, headers=passthrough)

        # 200: the stream has started on this unit. No retry from here on.
        if ctx.session is not None and self.table.record_session(ctx.session, unit):
            self.metrics.session_moves.inc()
        out_headers = to_client(upstream.headers)
        out_headers["x-request-id"] = ctx.request_id
        out_headers["x-pdunit-unit"] = unit.name
        ctx.attempts.append({"unit": unit.name, "result": "streaming", "how": how})

        def done(outcome: str, sent: int) -> None:
            self.metrics.requests.labels(unit=unit.name, outcome=outcome).inc()
            self.table.release(unit)
            self._log_done(unit, ctx, outcome, 200, sent)
            if ctx.span is not None:
                ctx.span.end({}, (), now_ns(), "" if outcome == "ok" else outcome, outcome=outcome,
                             status=200, unit=unit.name, bytes=sent)
                ctx.span = None

        def first_byte() -> None:
            self.metrics.first_byte_seconds.observe(time.perf_counter() - ctx.started)

        return RelayResponse(upstream, out_headers, done, first_byte, self.log, ctx.request_id)

    async def _read_refusal(self, unit: Unit, upstream: httpx.Response) -> bytes:
        """The body of an answer that is not a stream; on a failure reading it the stream
        is released here (the caller releases it otherwise, after counting)."""
        try:
            return await upstream.aread()
        except httpx.HTTPError:
            return b""
        except BaseException:
            self.table.release(unit)
            raise
        finally:
            await upstream.aclose()

    def _refused(self, unit: Unit, ctx: _Request, reason: str, detail: str) -> None:
        self.metrics.retries.labels(unit=unit.name, reason=reason).inc()
        ctx.attempts.append({"unit": unit.name, "result": detail})
        self.log.warning(
            "unit refused the stream before it started; trying another unit",
            extra={"request_id": ctx.request_id, "unit": unit.name, "reason": detail},
        )

    def _failed_before_answer(
        self, unit: Unit, ctx: _Request, status: int, code: str, exc: Exception
    ) -> Response:
        message = (
            f"unit {unit.name} ({unit.url}) failed before answering: {exc!r}; not retried "
            "because the unit may have started the stream"
        )
        self.metrics.requests.labels(unit=unit.name, outcome=code).inc()
        self.log.warning(message, extra={"request_id": ctx.request_id, "unit": unit.name})
        return error_response(
            status, code, message, headers={"x-request-id": ctx.request_id}, unit=unit.name
        )

    def _no_unit(self, ctx: _Request) -> Response:
        headers = {
            "retry-after": str(self.policy.retry_after_s),
            "x-request-id": ctx.request_id,
        }
        self.metrics.requests.labels(unit="", outcome="no_unit").inc()
        if ctx.attempts:
            detail = "; ".join(f"{a['unit']}: {a['result']}" for a in ctx.attempts)
            message = f"every unit tried refused the stream ({detail})"
            code = "no_unit_available"
        else:
            known = self.table.units.values()
            states = ", ".join(f"{u.name}: {u.state}" for u in known) or "none discovered"
            message = f"no unit is routable ({states})"
            code = "no_routable_unit"
        self.log.warning(message, extra={"request_id": ctx.request_id, "session": ctx.session})
        return error_response(503, code, message, headers=headers, attempts=ctx.attempts)

    def _log_done(self, unit: Unit, ctx: _Request, outcome: str, status: int, sent: int) -> None:
        self.log.info(
            "stream done",
            extra={
                "request_id": ctx.request_id,
                "unit": unit.name,
                "session": ctx.session,
                "outcome": outcome,
                "status": status,
                "bytes": sent,
                "attempts": len(ctx.attempts),
                "duration_s": round(time.perf_counter() - ctx.started, 6),
            },
        )


class RelayResponse(Response):
    """Copies the unit's body to the client as it arrives, and cleans up exactly once.

    Unlike a StreamingResponse over a generator, this closes the upstream stream and
    releases the unit on every path, including a client that leaves before the first
    chunk: a unit must see the disconnect (and cancel) instead of decoding for nobody.
    """

    def __init__(
        self,
        upstream: httpx.Response,
        headers: dict[str, str],
        on_done: Callable[[str, int], None],
        on_first_byte: Callable[[], None],
        logger: logging.Logger,
        request_id: str,
    ) -> None:
        self.upstream = upstream
        self.status_code = upstream.status_code
        self.background = None
        self.init_headers(headers)
        self.on_done = on_done
        self.on_first_byte = on_first_byte
        self.log = logger
        self.request_id = request_id
        # only NDJSON has room for an error trailer; binary frames and audio (PCM, WAV,
        # SSE) are cut instead
        self.binary = NDJSON not in upstream.headers.get("content-type", "")
        self.sent = 0
        self.finished = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "relay_error"  # replaced by the relay's own result or a disconnect
        abort: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    nonlocal outcome
                    while True:
                        message = await receive()
                        # The server also says "disconnect" once the response is complete.
                        if message["type"] == "http.disconnect":
                            if not self.finished:
                                outcome = "client_disconnected"
                                tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch_disconnect)
                try:
                    outcome, abort = await self._relay(send)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.on_done(outcome, self.sent)
        if abort is not None:
            # Binary frames and audio have no room for an error trailer: break the
            # connection so the client cannot take a cut stream for a whole one.
            raise abort

    async def _relay(self, send: Send) -> tuple[str, BaseException | None]:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        last = b"\n"
        try:
            async for chunk in self.upstream.aiter_raw():
                if not chunk:
                    continue
                if not self.sent:
                    self.on_first_byte()
                self.sent += len(chunk)
                last = chunk[-1:]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            outcome = (
                "unit_stalled" if isinstance(exc, httpx.TimeoutException) else "failed_mid_stream"
            )
            message = (
                f"the unit's stream broke after {self.sent} bytes: {exc!r}; not retried "
                "because the stream had started"
            )
            self.log.warning(message, extra={"request_id": self.request_id, "outcome": outcome})
            if self.binary:
                self.finished = True
                return outcome, UpstreamBroken(message)
            trailer = json.dumps({"error": {"code": outcome, "message": message}}).encode()
            prefix = b"" if last == b"\n" else b"\n"
            await send(
                {"type": "http.response.body", "body": prefix + trailer + b"\n", "more_body": True}
            )
            outcome_done = outcome
        else:
            outcome_done = "ok"
        self.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return outcome_done, None


class UpstreamBroken(Exception):
    """The unit broke a binary-frames or audio stream after it started."""
