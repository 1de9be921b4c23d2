"""The LB's edge under attack (issue 32): admin port and token, header and body limits,
timeouts, connection limit, JSON nesting, X-Request-Id, unguessable request ids, and
readiness while P or D re-register.

Every test runs the servers `pdunit lb` runs (`build_servers`: the edge's protocol,
both ports) over raw sockets, with timeouts of 1-3 s set by flags; each asserts an
answer or a close within a generous deadline, never how fast.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import numpy as np
import pytest

from pdunit.engine.edge import listen_hosts
from pdunit.engine.lb.balancer import RequestIds
from pdunit.engine.lb.config import LBConfig
from pdunit.engine.lb.main import main
from pdunit.engine.security import SECURITY_EVENTS, write_secret_file
from tests.lb import rawhttp
from tests.lb.conftest import wait_until
from tests.lb.fakes import N_CODEBOOKS


def events(what: str) -> float:
    return SECURITY_EVENTS.labels(what=what)._value.get()


def prompt(rows: int = 4) -> list[list[int]]:
    return np.random.default_rng(0).integers(0, 1024, (rows, N_CODEBOOKS)).tolist()


# ---------------------------------------------------------------- the admin port


def test_admin_routes_are_served_on_the_admin_port_only(start_lb, fake_unit):
    lb = start_lb()
    with lb.client() as c:
        assert c.post("/v1/admin/drain").status_code == 404
        assert c.get("/readyz").status_code == 200  # the stream port still serves the rest
    with lb.admin() as admin:
        assert admin.post("/v1/admin/drain").json()["draining"] is True
        assert admin.get("/v1/load").status_code == 404  # and the admin port nothing else
    assert lb.lb.draining


def test_admin_calls_need_the_bearer_token_of_the_token_file(start_lb, fake_unit, short_dir):
    path = os.path.join(short_dir, "admin-token")
    token = write_secret_file(path).decode()
    lb = start_lb(admin_token_file=path)
    before = events("admin_unauthorized")
    with lb.admin() as admin:
        missing = admin.post("/v1/admin/drain")
        wrong = admin.post("/v1/admin/drain", headers={"Authorization": "Bearer " + "0" * 64})
        basic = admin.post("/v1/admin/drain", headers={"Authorization": f"Basic {token}"})
        assert not lb.lb.draining
        ok = admin.post("/v1/admin/drain", headers={"Authorization": f"Bearer {token}"})
    for refused in (missing, wrong, basic):
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        assert "--admin-token-file" in refused.json()["error"]["message"]
    assert events("admin_unauthorized") == before + 3
    assert ok.status_code == 200 and lb.lb.draining


def test_an_admin_port_beyond_loopback_needs_a_token_file(capsys):
    assert main(["--admin-host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--admin-token-file" in err
    with pytest.raises(ValueError, match="--admin-port another port"):
        LBConfig(port=9000, admin_port=9000)
    LBConfig(admin_host="0.0.0.0", admin_token_file="/run/secrets/admin")  # with a token: fine


def test_a_token_file_others_can_read_is_refused_at_start(short_dir, capsys):
    path = os.path.join(short_dir, "token")
    write_secret_file(path)
    os.chmod(path, 0o644)
    assert main(["--port", "0", "--admin-port", "0", "--admin-token-file", path]) == 2
    assert "--admin-token-file" in capsys.readouterr().err


def test_listen_addresses_are_the_pod_ip_and_loopback_never_every_interface(monkeypatch):
    monkeypatch.delenv("PDUNIT_POD_IP", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert listen_hosts("") == ["127.0.0.1"] and LBConfig().admin_host == "127.0.0.1"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # a pod: its own network
    assert listen_hosts("") == ["0.0.0.0"]
    monkeypatch.setenv("PDUNIT_POD_IP", "10.1.2.3")  # a unit's pod
    assert listen_hosts("") == ["10.1.2.3", "127.0.0.1"]
    assert listen_hosts("0.0.0.0") == ["0.0.0.0"]  # only when asked


def test_an_lb_in_a_units_pod_serves_its_pod_ip_and_loopback(start_lb, monkeypatch):
    monkeypatch.setenv("PDUNIT_POD_IP", "127.0.0.2")  # a loopback alias stands in for the pod IP
    lb = start_lb(host="")
    port = lb.url.rsplit(":", 1)[1]
    for address in ("127.0.0.2", "127.0.0.1"):
        with httpx.Client(base_url=f"http://{address}:{port}", timeout=10) as c:
            assert c.get("/healthz").status_code == 200, address
    with pytest.raises(httpx.ConnectError):  # nothing else: not 0.0.0.0
        httpx.get(f"http://127.0.0.3:{port}/healthz", timeout=5)


# ---------------------------------------------------------------- headers


@pytest.mark.parametrize("size", [1 << 20, 32 << 20])
def test_an_oversized_header_is_refused_with_431_before_it_is_read_whole(start_lb, size):
    lb = start_lb(max_header_bytes=16384)
    before = events("header_too_large")
    out = rawhttp.oversized_header(lb.url, size)
    assert out.closed
    # refused while it was still being sent: the LB never buffered the whole header
    assert out.status == 431 or out.sent < size
    if out.status == 431:
        assert b"--max-header-bytes" in out.body
    assert events("header_too_large") == before + 1
    with lb.client() as c:
        assert c.get("/healthz").status_code == 200


def test_headers_just_under_the_limit_are_served(start_lb):
    lb = start_lb(max_header_bytes=16384)
    with lb.client() as c:
        resp = c.get("/healthz", headers={"X-Pad": "a" * 12000})
    assert resp.status_code == 200


def test_a_header_that_never_ends_is_cut_off(start_lb):
    lb = start_lb(header_timeout_s=1.0)
    before = events("header_timeout")
    out = rawhttp.slowloris(lb.url)
    assert out.closed, "the slowloris connection was still open after 10 s"
    assert out.status == 408 and b"--header-timeout-s" in out.body
    assert events("header_timeout") == before + 1


def test_a_connection_that_sends_nothing_is_closed(start_lb):
    lb = start_lb(header_timeout_s=1.0)
    with rawhttp.connect(lb.url) as sock:
        out = rawhttp.read_until_closed(sock)
    assert out.closed and out.data == b""


def test_an_idle_keep_alive_connection_is_closed(start_lb):
    lb = start_lb(keep_alive_timeout_s=1.0, header_timeout_s=30.0)
    with rawhttp.connect(lb.url) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        out = rawhttp.read_until_closed(sock)
    assert out.status == 200 and out.closed


# ---------------------------------------------------------------- bodies


def test_a_body_shorter_than_its_content_length_is_answered_408(start_lb, fake_unit):
    lb = start_lb(body_timeout_s=1.0)
    before = events("body_timeout")
    out = rawhttp.short_body(lb.url, "/v1/tts/stream", 1000, b'{"prompt": [[1')
    assert out.closed and out.status == 408, out.data
    assert b"--body-timeout-s" in out.body
    assert events("body_timeout") == before + 1
    assert fake_unit.prefill.submits == []
    wait_until(lambda: len(lb.lb.table) == 0, what="no stream left")
    with lb.client() as c:  # the LB still serves
        assert c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 3}).status_code == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_client_that_sends_its_whole_oversized_body_reads_its_413(start_lb, fake_unit, chunked):
    """The LB reads and drops the rest of a refused body (within engine/http_body.py's
    bounds) before it answers and closes: closing on unread bytes resets the connection,
    and a client still writing got ECONNRESET, never its 413 (a CI flake of the speech
    route's 4-MiB upload)."""
    lb = start_lb(max_body_bytes=4096)
    body = b"[" * (2 << 20)
    out = rawhttp.post_whole(lb.url, "/v1/tts/stream", body, chunked=chunked)
    assert out.sent >= len(body)  # every byte accepted: no reset while it was sent
    assert out.status == 413 and out.closed, out.data[:300]
    assert json.loads(out.body)["error"]["code"] == "body_too_large"
    assert fake_unit.prefill.submits == []


def test_a_client_that_stops_sending_its_oversized_body_gets_its_413_soon(start_lb, fake_unit):
    """The drain waits at most LINGER_IDLE_S for the next byte (a bounded wait)."""
    lb = start_lb(max_body_bytes=4096)
    with rawhttp.connect(lb.url) as sock:
        sock.sendall(b"POST /v1/tts/stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1048576\r\n\r\n" + b"[" * 65536)
        t0 = time.monotonic()
        out = rawhttp.read_until_closed(sock)
    assert out.status == 413 and out.closed
    assert time.monotonic() - t0 < 8  # the idle bound, not the edge's body timeout (408)


def test_an_oversized_admin_body_is_a_413_the_client_reads(start_lb, fake_unit):
    lb = start_lb()
    out = rawhttp.post_whole(lb.admin_url, "/v1/admin/drain", b" " * (1 << 20))
    assert out.sent >= 1 << 20
    assert out.status == 413 and json.loads(out.body)["error"]["field"] == "body"
    assert not lb.lb.draining


def test_a_body_declared_over_the_limit_is_refused_and_the_connection_closed(start_lb, fake_unit):
    lb = start_lb(max_body_bytes=4096)
    with rawhttp.connect(lb.url) as sock:
        sock.sendall(
            b"POST /v1/tts/stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 62914560\r\n\r\n" + b"[" * 65536
        )
        out = rawhttp.read_until_closed(sock)
    assert out.status == 413 and out.closed
    assert json.loads(out.body)["error"]["limit"] == 4096
    assert fake_unit.prefill.submits == []


# ---------------------------------------------------------------- connections


def test_connections_beyond_the_limit_are_answered_503_and_closed(start_lb):
    lb = start_lb(max_connections=8, header_timeout_s=30.0)
    wait_until(lambda: not lb.server.server_state.connections, what="readiness probes closed")
    before = events("too_many_connections")
    held = [rawhttp.connect(lb.url) for _ in range(8)]
    try:
        wait_until(
            lambda: len(lb.server.server_state.connections) >= 8, what="8 connections held"
        )
        with rawhttp.connect(lb.url) as extra:
            out = rawhttp.read_until_closed(extra)
        assert out.status == 503 and out.closed
        assert b"--max-connections" in out.body
        assert events("too_many_connections") == before + 1
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: len(lb.server.server_state.connections) == 0, what="connections closed")
    out = rawhttp.request(lb.url, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.status == 200


def test_many_half_open_connections_are_all_closed(start_lb):
    lb = start_lb(header_timeout_s=1.0, max_connections=1024)
    socks = []
    for _ in range(300):
        sock = rawhttp.connect(lb.url)
        sock.sendall(b"POST /v1/tts/stream HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        socks.append(sock)
    try:
        wait_until(
            lambda: len(lb.server.server_state.connections) == 0,
            timeout=20,
            what="every half-open connection closed",
        )
    finally:
        for sock in socks:
            sock.close()


# ---------------------------------------------------------------- JSON nesting


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",  # no number: the exact path
        b"[" * 3000 + b"]" * 3000,  # not an object at all
        b'{"prompt": [[' + b",".join([b"1"] * N_CODEBOOKS) + b']], "seed": '
        + b"[" * 3000 + b"]" * 3000 + b"}",  # a valid prompt: the fast path parses the rest
    ],
    ids=["exact-path", "bare-array", "fast-path"],
)
def test_deeply_nested_json_is_a_400_naming_the_limit(start_lb, fake_unit, body):
    lb = start_lb()
    with lb.client() as c:
        resp = c.post("/v1/tts/stream", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["code"] == "json_too_deep" and error["limit"] == 32
    assert "levels deep, the limit is 32" in error["message"]
    assert fake_unit.prefill.submits == []


# ---------------------------------------------------------------- request ids


@pytest.mark.parametrize(
    "rid",
    ["a" * 129, "sp ace", "caf\u00e9", "x;y", "<script>"],
    ids=["too-long", "space", "non-ascii", "semicolon", "markup"],
)
def test_a_bad_x_request_id_is_refused_and_never_echoed(start_lb, fake_unit, rid):
    lb = start_lb()
    before = events("bad_request_id")
    raw = (
        b"POST /v1/tts/stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nX-Request-Id: " + rid.encode("utf-8") + b"\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    out = rawhttp.request(lb.url, raw)
    assert out.status == 400
    assert json.loads(out.body)["error"]["field"] == "X-Request-Id"
    assert out.header("x-request-id") is None and rid.encode("utf-8") not in out.data
    assert events("bad_request_id") == before + 1
    assert fake_unit.prefill.submits == []


def test_a_control_byte_in_x_request_id_is_refused_by_the_parser(start_lb, fake_unit):
    lb = start_lb()
    raw = (
        b"POST /v1/tts/stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"X-Request-Id: evil\x01\x1b[2Jid\r\nContent-Length: 2\r\n\r\n{}"
    )
    out = rawhttp.request(lb.url, raw)
    assert out.status == 400 and b"evil" not in out.data
    assert fake_unit.prefill.submits == []


def test_a_good_x_request_id_is_still_echoed(start_lb):
    lb = start_lb()
    rid = "Req-0123_abc.def:42+/="
    with lb.client() as c:
        resp = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 2},
                      headers={"X-Request-Id": rid})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == rid


def test_request_ids_are_random_64_bit_never_a_counter():
    ids = RequestIds()
    drawn = [ids.next() for _ in range(5000)]
    assert len(set(drawn)) == len(drawn) and 0 not in drawn
    # a counter (or a fixed prefix plus one) would give the next id from one response's id
    steps = {b - a for a, b in zip(drawn, drawn[1:], strict=False)}
    assert len(steps) > 4900
    assert len({i >> 32 for i in drawn}) > 4900 and len({i & 0xFFFFFFFF for i in drawn}) > 4900


def test_request_ids_never_repeat_a_recent_one(monkeypatch):
    ids = RequestIds()
    first = ids.next()
    draws = iter([first, 0, first, 12345])  # the source repeats itself: drawn again
    monkeypatch.setattr("pdunit.engine.lb.balancer.secrets.randbits", lambda bits: next(draws))
    assert ids.next() == 12345


def test_streams_get_unrelated_request_ids(start_lb, fake_unit):
    lb = start_lb()
    with lb.client() as c:
        got = [
            int(c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 1})
                .headers["x-pdunit-request-id"], 16)
            for _ in range(4)
        ]
    assert len({b - a for a, b in zip(got, got[1:], strict=False)}) == 3
    assert len({i >> 32 for i in got}) == 4


# ---------------------------------------------------------------- readiness


@pytest.mark.parametrize("who", ["prefill", "decode"])
def test_readiness_is_false_while_p_or_d_says_unready(start_lb, fake_unit, who):
    lb = start_lb()
    part = fake_unit.prefill if who == "prefill" else fake_unit.decode
    part.unready = "re-registering with the restarted proxy"
    with lb.client() as c:
        wait_until(lambda: c.get("/readyz").status_code == 503, what="LB unready")
        reason = c.get("/readyz").json()["reason"]
        refused = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 2})
        part.unready = ""
        wait_until(lambda: c.get("/readyz").status_code == 200, what="LB ready again")
    name = "P" if who == "prefill" else "D"
    assert reason == f"{name} is not ready: re-registering with the restarted proxy"
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert fake_unit.prefill.submits == []


def _late_probes(lb) -> float:
    return lb.lb.metrics.probe_late.labels(target="decode")._value.get()


def test_one_late_probe_answer_does_not_make_the_unit_unready(start_lb, fake_unit):
    """A busy D answers one Info past the probe's timeout: its previous answer (fresh)
    stands in, so the LB keeps admitting streams (a loaded machine refused a fault
    run's stream with `not_ready` for one late answer)."""
    lb = start_lb()  # probe_interval_s 0.2: the probe's timeout; a reply may stand in 0.9 s
    fake_unit.decode.info_delays = [0.5]
    statuses = []
    with lb.client() as c:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            statuses.append(c.get("/readyz").status_code)
            time.sleep(0.02)
        admitted = c.post("/v1/tts/stream", json={"prompt": prompt(), "max_frames": 2})
    assert _late_probes(lb) == 1
    assert set(statuses) == {200}
    assert admitted.status_code == 200


def test_a_d_that_keeps_answering_late_makes_the_unit_unready(start_lb, fake_unit):
    """Late for longer than 2 x the probe interval + 0.5 s: the stand-in is too old and
    the LB says why it is not ready; ready again once D answers in time."""
    lb = start_lb()
    fake_unit.decode.info_delays = [0.5] * 100
    with lb.client() as c:
        wait_until(lambda: c.get("/readyz").status_code == 503, what="LB unready")
        reason = c.get("/readyz").json()["reason"]
        fake_unit.decode.info_delays = []
        wait_until(lambda: c.get("/readyz").status_code == 200, what="LB ready again")
    assert reason.startswith("decode Info failed: DEADLINE_EXCEEDED")
    assert _late_probes(lb) >= 1


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b'{"prompt": [[1, 2]]}', 3),
        (b'{"a": "[[[[[[[[", "b": [1]}', 2),  # brackets inside a string do not nest
        (b'{"a": "\\"[[[[[[", "b": [1]}', 2),  # nor after an escaped quote
        (b'{"a": "\\\\", "b": [[[1]]]}', 4),  # an escaped backslash ends its string
        (b'"]]]]]]"' + b"[" * 40, 40),  # a string of closers cannot hide the opens after it
        (b"", 0),
    ],
)
def test_json_depth_counts_brackets_outside_strings(raw, depth):
    from pdunit.engine.lb.validate import json_depth

    assert json_depth(raw) == depth


def test_a_string_full_of_brackets_is_not_taken_for_nesting(start_lb, fake_unit):
    lb = start_lb()
    body = json.dumps({"prompt": prompt(), "max_frames": 2, "note": "[" * 5000}).encode()
    with lb.client() as c:
        resp = c.post("/v1/tts/stream", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "unknown_field"
