"""The router's edge (issue 32): what crosses it in each direction, whom it believes
about the client's address, how much body it reads, who may read /v1/units, the limits
of its HTTP server, and the retry of a unit's 502.

The router runs as `pdunit router` serves it (engine/edge.py's protocol) in front of
fake units on loopback; attacks go through raw sockets where httpx would not send them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import tempfile
import time

import httpx
import pytest

from pdunit.engine.edge import listen_hosts, read_token_file
from pdunit.engine.lb.config import LBConfig
from pdunit.engine.router.config import RouterConfig
from pdunit.engine.router.main import main
from pdunit.engine.router.proxy import ForwardPolicy, to_client, to_unit
from pdunit.engine.security import SECURITY_EVENTS, write_secret_file
from tests.lb import rawhttp
from tests.router.routerkit import (
    PROMPT,
    FakeUnit,
    key_owned_by,
    read_stream,
    run_router,
    run_units,
)

pytestmark = pytest.mark.anyio


def events(what: str) -> float:
    return SECURITY_EVENTS.labels(what=what)._value.get()


async def in_thread(fn, *args):  # type: ignore[no-untyped-def]
    """Raw-socket helpers block: run them off the loop that serves the router."""
    return await asyncio.to_thread(fn, *args)


# ---------------------------------------------------------------- towards the unit

ATTACK_HEADERS = {
    "Authorization": "Bearer client-secret",
    "Cookie": "session=client-secret",
    "Proxy-Authorization": "Basic c2VjcmV0",
    "Forwarded": "for=6.6.6.6;proto=https",
    "X-Forwarded-For": "6.6.6.6",
    "X-Real-Ip": "6.6.6.6",
    "Connection": "keep-alive, X-Hop-Secret",
    "X-Hop-Secret": "named by Connection",
    "Keep-Alive": "timeout=5",
    "TE": "trailers",
    "Proxy-Foo": "bar",
    "X-Pdunit-Max-Frames": "5",
}


async def test_credentials_hop_by_hop_and_forwarded_headers_never_reach_a_unit() -> None:
    unit = FakeUnit("a")
    async with run_units(unit) as served, run_router({"a": served["a"].url}) as router:
        async with httpx.AsyncClient() as client:
            status, _, _ = await read_stream(client, router.url, session="s1", **ATTACK_HEADERS)
    assert status == 200
    (seen,) = unit.headers
    for name in ("authorization", "cookie", "proxy-authorization", "forwarded", "x-real-ip",
                 "x-hop-secret", "keep-alive", "te", "proxy-foo"):
        assert name not in seen, name
    assert seen["x-forwarded-for"] == "127.0.0.1"  # the TCP peer, not what the client claimed
    assert seen["x-session-id"] == "s1" and seen["x-pdunit-max-frames"] == "5"


async def test_forwarded_headers_are_kept_only_from_a_trusted_proxy() -> None:
    unit = FakeUnit("a")
    async with run_units(unit) as served:
        async with run_router({"a": served["a"].url}, trusted_proxies=["127.0.0.0/8"]) as router:
            async with httpx.AsyncClient() as client:
                await read_stream(client, router.url, **ATTACK_HEADERS)
    (seen,) = unit.headers
    assert seen["x-forwarded-for"] == "6.6.6.6, 127.0.0.1"
    assert seen["forwarded"] == "for=6.6.6.6;proto=https"
    assert "authorization" not in seen and "cookie" not in seen  # trusted or not


def test_the_header_policy_in_both_directions() -> None:
    untrusted = ForwardPolicy()
    headers = [
        ("Upgrade", "websocket"), ("Trailer", "x"), ("Transfer-Encoding", "chunked"),
        ("Connection", "Upgrade, X-A"), ("X-A", "1"), ("Host", "evil"), ("Content-Length", "9"),
        ("X-Request-Id", "client"), ("X-Forwarded-For", "1.2.3.4"), ("X-Session-Id", "v"),
        ("Proxy-Connection", "keep-alive"),
    ]
    out = dict(to_unit(headers, "10.0.0.9", untrusted, "rid-1"))
    assert out == {"x-session-id": "v", "x-request-id": "rid-1", "x-forwarded-for": "10.0.0.9"}
    trusted = ForwardPolicy(trusted_proxies=(ipaddress.ip_network("10.0.0.0/8"),))
    assert dict(to_unit(headers, "10.0.0.9", trusted, "r"))["x-forwarded-for"] == "1.2.3.4, 10.0.0.9"
    assert dict(to_unit(headers, "11.0.0.9", trusted, "r"))["x-forwarded-for"] == "11.0.0.9"
    back = to_client(httpx.Headers([
        ("Content-Type", "application/x-ndjson"), ("Set-Cookie", "a=b"), ("Connection", "X-B"),
        ("X-B", "1"), ("Keep-Alive", "5"), ("Transfer-Encoding", "chunked"),
        ("X-Pdunit-Request-Id", "00ff"), ("X-Pdunit-Debug-Socket", "/run/pdunit/d.sock"),
        ("Authorization", "x"), ("Retry-After", "1"),
    ]))
    assert back == {"content-type": "application/x-ndjson", "x-pdunit-request-id": "00ff",
                    "retry-after": "1"}


# ---------------------------------------------------------------- towards the client


@pytest.mark.parametrize("refuse", [None, 400], ids=["stream", "error"])
async def test_set_cookie_and_internal_headers_never_reach_the_client(refuse: int | None) -> None:
    unit = FakeUnit("a")
    unit.response_headers = {
        "Set-Cookie": "unit-session=secret",
        "X-Pdunit-Internal-Socket": "/run/pdunit/decode.sock",
        "X-Pdunit-Request-Id": "00000000000000ff",
    }
    unit.refuse_with = refuse
    async with run_units(unit) as served, run_router({"a": served["a"].url}) as router:
        async with httpx.AsyncClient() as client:
            status, _, headers = await read_stream(client, router.url)
    assert status == (refuse or 200)
    assert "set-cookie" not in headers and "x-pdunit-internal-socket" not in headers
    assert headers["x-pdunit-request-id"] == "00000000000000ff"
    assert headers["x-pdunit-unit"] == "a"


# ---------------------------------------------------------------- retries


async def test_a_502_before_the_first_byte_is_retried_on_another_unit() -> None:
    a, b = FakeUnit("a"), FakeUnit("b")
    a.refuse_with = 502
    async with run_units(a, b) as served:
        async with run_router({n: s.url for n, s in served.items()}) as router:
            key = key_owned_by(router.table, "a")
            async with httpx.AsyncClient() as client:
                status, lines, headers = await read_stream(client, router.url, session=key)
            metrics = router.app.state.router.forwarder.metrics
            retried = metrics.retries.labels(unit="a", reason="unit_502")._value.get()
    assert status == 200 and headers["x-pdunit-unit"] == "b" and lines[-1]["done"] is True
    assert b.starts == 1 and retried == 1


# ---------------------------------------------------------------- the body


def test_the_routers_body_limit_is_the_lbs() -> None:
    assert RouterConfig(units=["a=http://x:1"]).max_body_bytes == LBConfig().max_body_bytes


async def test_a_client_that_sends_its_whole_oversized_body_reads_its_413() -> None:
    """Past the limit the router drops a bounded rest before it answers (engine/http_body.py):
    a client that writes everything before reading gets the 413, not a reset."""
    unit = FakeUnit("a")
    async with run_units(unit) as served, run_router({"a": served["a"].url}) as router:
        body = b"[" * (6 << 20)
        out = await in_thread(lambda: rawhttp.post_whole(router.url, "/v1/tts/stream", body))
    assert out.sent >= len(body)
    assert out.status == 413 and json.loads(out.body)["error"]["limit"] == 4 << 20
    assert unit.starts == 0 and unit.headers == []


async def test_a_body_over_the_limit_is_refused_while_it_is_sent_and_never_forwarded() -> None:
    unit = FakeUnit("a")
    async with run_units(unit) as served, run_router({"a": served["a"].url}) as router:
        size = 60 << 20
        chunk = b"%x\r\n%s\r\n" % (1 << 16, b"[" * (1 << 16))

        def send() -> rawhttp.Outcome:
            with rawhttp.connect(router.url) as sock:
                head = (b"POST /v1/tts/stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                        b"\r\nTransfer-Encoding: chunked\r\n\r\n")
                sent = rawhttp.send_all_or_broken(sock, [head] + [chunk] * (size >> 16))
                out = rawhttp.read_until_closed(sock)
                out.sent = sent
                return out

        out = await in_thread(send)
    assert out.status == 413 and out.closed
    assert json.loads(out.body)["error"]["limit"] == 4 << 20
    assert out.sent < size  # past the linger bound (engine/http_body.py) the router stopped reading
    assert unit.starts == 0 and unit.headers == []


# ---------------------------------------------------------------- /v1/units


async def test_units_table_is_served_to_loopback_only_without_a_token() -> None:
    unit = FakeUnit("a")
    async with run_units(unit) as served, run_router({"a": served["a"].url}) as router:
        before = events("units_unauthorized")
        remote = httpx.ASGITransport(app=router.app, client=("203.0.113.7", 40000))
        async with httpx.AsyncClient(transport=remote, base_url="http://router") as client:
            refused = await client.get("/v1/units")
        async with httpx.AsyncClient() as client:
            local = await client.get(router.url + "/v1/units")
    assert refused.status_code == 403 and "--admin-token-file" in refused.json()["error"]["message"]
    assert served["a"].url not in refused.text
    assert events("units_unauthorized") == before + 1
    assert local.status_code == 200 and local.json()["units"][0]["url"] == served["a"].url


async def test_units_table_needs_the_bearer_token_when_one_is_configured() -> None:
    unit = FakeUnit("a")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "token")
        token = write_secret_file(path).decode()
        async with run_units(unit) as served:
            async with run_router({"a": served["a"].url}, admin_token=read_token_file(path, "x")) as router:
                async with httpx.AsyncClient(base_url=router.url) as client:
                    missing = await client.get("/v1/units")
                    wrong = await client.get("/v1/units", headers={"Authorization": "Bearer nope"})
                    ok = await client.get("/v1/units", headers={"Authorization": f"Bearer {token}"})
    assert missing.status_code == wrong.status_code == 401  # loopback too: the token decides
    assert missing.headers["www-authenticate"] == "Bearer"
    assert ok.status_code == 200 and ok.json()["routable_units"] == 1


def test_an_unreadable_token_file_or_a_bad_proxy_cidr_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--units", "a=http://127.0.0.1:9", "--admin-token-file", "/nonexistent/token"]) == 2
    assert "--admin-token-file" in capsys.readouterr().err
    assert main(["--units", "a=http://127.0.0.1:9", "--trusted-proxies", "10.0.0.0/8,nope"]) == 2
    assert "'nope'" in capsys.readouterr().err


def test_the_router_listens_on_loopback_unless_in_a_pod_or_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDUNIT_POD_IP", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert RouterConfig(units=["a=http://x:1"]).host == ""
    assert listen_hosts("") == ["127.0.0.1"]  # a laptop: never every interface by default
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert listen_hosts("") == ["0.0.0.0"]  # the chart's Deployment: the pod's own network


# ---------------------------------------------------------------- the server's limits


async def test_bad_x_request_id_is_refused_before_any_unit() -> None:
    unit = FakeUnit("a")
    async with run_units(unit) as served, run_router({"a": served["a"].url}) as router:
        async with httpx.AsyncClient() as client:
            resp = await client.post(router.url + "/v1/tts/stream", json=PROMPT,
                                     headers={"X-Request-Id": "x" * 500})
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "X-Request-Id"
    assert "x-request-id" not in resp.headers and unit.headers == []


async def test_oversized_headers_slowloris_and_short_bodies_are_cut_off() -> None:
    unit = FakeUnit("a")
    async with run_units(unit) as served:
        async with run_router({"a": served["a"].url}, header_timeout_s=1.0,
                              body_timeout_s=1.0) as router:
            big = await in_thread(rawhttp.oversized_header, router.url, 32 << 20)
            slow = await in_thread(rawhttp.slowloris, router.url)
            short = await in_thread(rawhttp.short_body, router.url, "/v1/tts/stream", 1000, b"{")
    assert big.closed and (big.status == 431 or big.sent < 32 << 20)
    assert slow.closed and slow.status == 408
    assert short.closed and short.status == 408 and b"--body-timeout-s" in short.body
    assert unit.headers == []


async def test_connections_beyond_the_limit_are_refused() -> None:
    unit = FakeUnit("a")
    async with run_units(unit) as served:
        async with run_router({"a": served["a"].url}, max_connections=4,
                              header_timeout_s=30.0) as router:
            state = router.served.server.server_state

            def hold_then_one_more() -> rawhttp.Outcome:
                held = [rawhttp.connect(router.url) for _ in range(4)]
                try:
                    for _ in range(500):
                        if len(state.connections) >= 4:
                            break
                        time.sleep(0.01)
                    with rawhttp.connect(router.url) as extra:
                        return rawhttp.read_until_closed(extra)
                finally:
                    for sock in held:
                        sock.close()

            for _ in range(500):
                if not state.connections:
                    break
                await asyncio.sleep(0.01)
            out = await in_thread(hold_then_one_more)
    assert out.status == 503 and b"--max-connections" in out.body
