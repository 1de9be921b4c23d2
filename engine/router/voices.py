"""Forwarding `/v1/voices` (list, get, create, delete) to one unit of the set.

The units of a set share one voice store (docs/operator.md), so any unit answers for all:
the least loaded routable one (a unit that refuses streams with 429 still serves voices),
another only when the connection to it failed (nothing reached it: a create is never sent
twice). Unlike the stream routes, the client's Authorization header reaches the unit: the
LB checks the voice store's token itself. Must never pass it on any other route. Traced
as the stream routes are: a `router.request` span whose W3C context the unit gets.
"""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, Counter
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pdunit.engine.observability import now_ns
from pdunit.engine.router.proxy import (
    Forwarder,
    checked_request_id,
    error_response,
    to_client,
    to_unit,
)
from pdunit.engine.router.table import RoutingTable, Unit
from pdunit.engine.tracing import TRACE_HEADERS, Span

VOICES_PATH = "/v1/voices"
# The only credential the voice routes pass to a unit (the LB's --voices-token-file token).
VOICE_CREDENTIALS = frozenset({"authorization"})
# A unit's answer is JSON: one voice, or the list of them (a few hundred bytes a voice).
ANSWER_MAX_BYTES = 16 << 20


class VoiceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pdunit_router_voice_requests_total",
            "Requests to /v1/voices by method and the status the client got",
            ["method", "status"],
            registry=registry,
        )


def voice_unit(table: RoutingTable, exclude: frozenset[str]) -> Unit | None:
    """The least loaded routable unit not in `exclude`, else one that only refuses streams
    for now (full: its voice routes still answer), else None."""
    decision = table.pick(None, exclude)
    if decision is not None:
        return decision.unit
    return next((u for u in table.units.values() if u.state == "full" and u.name not in exclude), None)


class VoiceForwarder:
    """One /v1/voices request to one unit, its answer relayed whole."""

    def __init__(self, streams: Forwarder, metrics: VoiceMetrics) -> None:
        self.streams, self.metrics = streams, metrics  # the stream forwarder's table, client, policy

    async def forward(self, request: Request, path: str) -> Response:
        request_id = checked_request_id(request)
        if isinstance(request_id, Response):
            answer = request_id
        else:
            answer = await self._traced(request, path, request_id)
        self.metrics.requests.labels(method=request.method, status=str(answer.status_code)).inc()
        return answer

    async def _traced(self, request: Request, path: str, request_id: str) -> Response:
        """`_forward` inside the request's span (engine/tracing.py; None when off), ended
        when the answer is whole (a voice answer is never streamed)."""
        span = self.streams.tracing.start("router.request", now_ns(), request.headers.items(),
                                          request_id=request_id, path=path, method=request.method)
        tried: list[str] = []
        try:
            answer = await self._forward(request, path, request_id, span, tried)
        except BaseException as exc:
            if span is not None:
                span.end({}, (), now_ns(), repr(exc), outcome="internal_error", status=500, attempts=len(tried))
            raise
        if span is not None:
            status = answer.status_code
            span.end({}, (), now_ns(), "" if status < 500 else f"answered {status}", outcome="answered",
                     status=status, unit=tried[-1] if tried else "", attempts=len(tried))
        return answer

    async def _forward(
        self, request: Request, path: str, request_id: str, span: Span | None, tried: list[str]
    ) -> Response:
        fwd = self.streams
        try:
            body = await fwd.read_body(request)
        except ClientDisconnect:
            return Response(status_code=499)
        if isinstance(body, Response):
            body.headers["x-request-id"] = request_id
            return body
        peer = request.client.host if request.client is not None else None
        headers = to_unit(request.headers.items(), peer, fwd.policy, request_id, VOICE_CREDENTIALS)
        if span is not None:  # the unit's spans (if it traces these routes) are children of this one
            headers = [h for h in headers if h[0] not in TRACE_HEADERS] + list(span.headers().items())
        if request.url.query:
            path += "?" + request.url.query
        failures: list[dict[str, str]] = []
        for _ in range(fwd.policy.max_attempts):
            unit = voice_unit(fwd.table, frozenset(tried))
            if unit is None:
                break
            tried.append(unit.name)
            try:
                return await self._send(unit, request.method, path, body, headers, request_id)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing reached it
                reason = f"connect to {unit.url} failed: {exc!r}"
                failures.append({"unit": unit.name, "result": reason})
                fwd.table.mark_unreachable(unit.name, reason)
                fwd.log.warning("voice request: unit unreachable; trying another unit",
                                extra={"request_id": request_id, "unit": unit.name, "reason": reason})
            except httpx.TimeoutException as exc:
                return error_response(504, "unit_timeout", f"unit {unit.name} ({unit.url}) did not answer the "
                                      f"voice request in time: {exc!r}; not retried (it may have done it)",
                                      headers={"x-request-id": request_id}, unit=unit.name)
            except httpx.HTTPError as exc:
                return error_response(502, "unit_error", f"unit {unit.name} ({unit.url}) failed the voice "
                                      f"request: {exc!r}; not retried (it may have done it)",
                                      headers={"x-request-id": request_id}, unit=unit.name)
        headers_out = {"retry-after": str(fwd.policy.retry_after_s), "x-request-id": request_id}
        if failures:
            detail = "; ".join(f"{f['unit']}: {f['result']}" for f in failures)
            return error_response(503, "no_unit_available", f"no unit could be reached for the voice "
                                  f"request ({detail})", headers=headers_out, attempts=failures)
        states = ", ".join(f"{u.name}: {u.state}" for u in fwd.table.units.values()) or "none discovered"
        return error_response(503, "no_routable_unit", f"no unit is routable ({states})", headers=headers_out)

    async def _send(
        self, unit: Unit, method: str, path: str, body: bytes, headers: list[tuple[str, str]], request_id: str
    ) -> Response:
        client = self.streams.client
        upstream = await client.send(
            client.build_request(method, unit.url + path, content=body or None, headers=headers), stream=True)
        try:
            data = bytearray()
            async for chunk in upstream.aiter_raw():
                data += chunk
                if len(data) > ANSWER_MAX_BYTES:
                    return error_response(502, "unit_error", f"unit {unit.name}'s voice answer exceeds "
                                          f"{ANSWER_MAX_BYTES} bytes", headers={"x-request-id": request_id},
                                          unit=unit.name)
        finally:
            await upstream.aclose()
        out = to_client(upstream.headers)
        out["x-request-id"] = request_id
        out["x-pdunit-unit"] = unit.name
        return Response(bytes(data), status_code=upstream.status_code, headers=out)
