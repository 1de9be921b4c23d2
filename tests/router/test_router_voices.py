"""The router's /v1/voices: the set's shared voice store through any unit. Each method and
path reaches a unit unchanged with the client's Authorization (and only on these routes:
the stream routes still strip it), the unit's answer (errors included) comes back as it
is, a unit that cannot be reached is replaced by another, and the body limit is the
stream routes'. Each is traced as the stream routes are (engine/tracing.py), against
test_tracing_unit.py's fake collector. Last, two real LBs sharing one voices directory
behind the router: a voice uploaded through the router speaks on either unit."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.security import write_secret_file
from tests.engine.test_tracing_unit import Collector, collector  # noqa: F401 (the fixture)
from tests.lb.conftest import RunningLB, fake_unit, loop_thread, start_lb  # noqa: F401 (fixtures)
from tests.lb.fakes import FakeDecode, FakePrefill, LoopThread
from tests.lb.fakes import FakeUnit as FakeLBUnit
from tests.lb.test_speech import CODEC, MODEL, speech_unit, wav_bytes
from tests.router.routerkit import FakeUnit, key_owned_by, read_stream, run_router, run_units

pytestmark = pytest.mark.anyio
TOKEN = "t" * 40


class VoiceUnit(FakeUnit):
    """A FakeUnit with the LB's voice routes over an in-memory store (the set's shared one
    in the tests that share `store`); it records every voice request it got."""

    def __init__(self, name: str, store: dict[str, dict[str, object]]) -> None:
        super().__init__(name)
        self.store = store
        self.got: list[tuple[str, str, dict[str, str], bytes]] = []
        self.app.router.routes += [
            Route("/v1/voices", self._voices, methods=["GET", "POST"]),
            Route("/v1/voices/{name}", self._voice, methods=["GET", "DELETE"]),
        ]

    def _write_refused(self, request: Request) -> Response | None:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return JSONResponse({"error": {"message": "needs the token", "type": "invalid_request_error",
                                           "param": "Authorization", "code": "missing_token"}},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return None

    async def _voices(self, request: Request) -> Response:
        body = await request.body()
        self.got.append((request.method, request.url.path, dict(request.headers), body))
        if request.method == "GET":
            return JSONResponse({"object": "list", "data": sorted(self.store.values(), key=lambda v: str(v["id"]))})
        refused = self._write_refused(request)
        if refused:
            return refused
        doc = json.loads(body)
        if doc["name"] in self.store:
            return JSONResponse({"error": {"message": "exists", "type": "invalid_request_error",
                                           "param": "name", "code": "voice_exists"}}, status_code=409)
        self.store[doc["name"]] = {"id": doc["name"], "object": "voice", "unit": self.name}
        return JSONResponse(self.store[doc["name"]], status_code=201)

    async def _voice(self, request: Request) -> Response:
        name = request.path_params["name"]
        self.got.append((request.method, request.url.path, dict(request.headers), await request.body()))
        if request.method == "DELETE" and (refused := self._write_refused(request)):
            return refused
        if name not in self.store:
            return JSONResponse({"error": {"message": f"no voice named {name!r}", "type": "invalid_request_error",
                                           "param": "voice", "code": "voice_not_found"}}, status_code=404)
        if request.method == "DELETE":
            del self.store[name]
            return JSONResponse({"id": name, "object": "voice", "deleted": True})
        return JSONResponse(self.store[name])


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_each_voice_route_reaches_a_unit_with_the_clients_authorization_and_its_answer_returns() -> None:
    shared: dict[str, dict[str, object]] = {}
    a, b = VoiceUnit("a", shared), VoiceUnit("b", shared)
    async with run_units(a, b) as served, run_router({n: s.url for n, s in served.items()}) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as c:
            created = await c.post("/v1/voices", json={"name": "anna"}, headers={**AUTH, "Cookie": "s=1"})
            assert created.status_code == 201 and created.json()["id"] == "anna"
            assert created.headers["x-pdunit-unit"] in ("a", "b") and created.headers["x-request-id"]
            again = await c.post("/v1/voices", json={"name": "anna"}, headers=AUTH)
            assert again.status_code == 409 and again.json()["error"]["code"] == "voice_exists"
            listed = await c.get("/v1/voices")
            assert listed.status_code == 200 and [v["id"] for v in listed.json()["data"]] == ["anna"]
            one = await c.get("/v1/voices/anna")
            assert one.status_code == 200 and one.json()["id"] == "anna"
            stranger = await c.delete("/v1/voices/anna")  # no token: the unit's 401, as it gave it
            assert stranger.status_code == 401 and stranger.headers["www-authenticate"] == "Bearer"
            assert stranger.json()["error"]["param"] == "Authorization"
            deleted = await c.delete("/v1/voices/anna", headers=AUTH)
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
            gone = await c.get("/v1/voices/anna")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "voice_not_found"
            # the stream routes still strip credentials
            status, _, _ = await read_stream(c, router.url, Authorization=f"Bearer {TOKEN}")
            assert status == 200
    got = a.got + b.got  # every voice request, whichever unit it reached
    assert [(m, p) for m, p, _, _ in a.got + b.got].count(("POST", "/v1/voices")) == 2
    post = next(g for g in got if g[0] == "POST")
    assert post[2]["authorization"] == f"Bearer {TOKEN}" and "cookie" not in post[2]
    assert json.loads(post[3]) == {"name": "anna"}
    assert {(m, p) for m, p, _, _ in got} == {("POST", "/v1/voices"), ("GET", "/v1/voices"),
                                              ("GET", "/v1/voices/anna"), ("DELETE", "/v1/voices/anna")}
    assert all("authorization" not in h for h in a.headers + b.headers)  # stream requests


async def test_a_voice_request_to_an_unreachable_unit_goes_to_another_and_without_any_unit_is_503() -> None:
    shared: dict[str, dict[str, object]] = {}
    live, dead = VoiceUnit("live", shared), VoiceUnit("dead", shared)
    async with run_units(live, dead) as served, run_router({n: s.url for n, s in served.items()}) as router:
        await served["dead"].stop()  # still routable in the table until a poll or a request says otherwise
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as c:
            for i in range(4):
                resp = await c.post("/v1/voices", json={"name": f"v{i}"}, headers=AUTH)
                assert resp.status_code == 201 and resp.headers["x-pdunit-unit"] == "live"
            assert sorted(shared) == ["v0", "v1", "v2", "v3"]
            await served["live"].stop()
            for _ in range(200):
                if router.table.routable_count() == 0:
                    break
                await asyncio.sleep(0.02)
            none = await c.get("/v1/voices")
            assert none.status_code == 503 and none.json()["error"]["code"] == "no_routable_unit"
            assert none.headers["retry-after"] and none.headers["x-request-id"]


async def test_a_unit_full_for_streams_still_serves_voices() -> None:
    shared: dict[str, dict[str, object]] = {}
    unit = VoiceUnit("a", shared)
    async with run_units(unit) as served, run_router({n: s.url for n, s in served.items()},
                                                     poll_interval_s=30) as router:
        router.table.mark_rejected("a", 429, "D has no capacity")
        assert router.table.routable_count() == 0
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as c:
            resp = await c.post("/v1/voices", json={"name": "anna"}, headers=AUTH)
    assert resp.status_code == 201 and resp.headers["x-pdunit-unit"] == "a"


async def test_a_voice_body_over_the_routers_limit_is_413_and_reaches_no_unit() -> None:
    unit = VoiceUnit("a", {})
    async with run_units(unit) as served, run_router({n: s.url for n, s in served.items()},
                                                     max_body_bytes=1000) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as c:
            resp = await c.post("/v1/voices", content=b"x" * 2000, headers=AUTH)
            bad_id = await c.get("/v1/voices", headers={"X-Request-Id": "x" * 500})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
    assert resp.json()["error"]["field"] == "body"
    assert bad_id.status_code == 400 and bad_id.json()["error"]["field"] == "X-Request-Id"
    assert unit.got == []


TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


async def test_each_voice_route_is_a_router_span_whose_context_the_unit_gets(
    collector: tuple[Collector, str]  # noqa: F811 (the imported fixture)
) -> None:
    sink, endpoint = collector
    unit = VoiceUnit("a", {})
    client_ctx = {"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"}
    calls = [("POST", "/v1/voices", 201), ("GET", "/v1/voices", 200), ("GET", "/v1/voices/anna", 200),
             ("DELETE", "/v1/voices/anna", 200), ("GET", "/v1/voices/anna", 404)]
    async with run_units(unit) as served, run_router({n: s.url for n, s in served.items()},
                                                     otlp_endpoint=endpoint) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as c:
            for i, (method, path, status) in enumerate(calls):
                resp = await c.request(method, path, json={"name": "anna"} if method == "POST" else None,
                                       headers={**AUTH, **client_ctx, "X-Request-Id": f"voice-{i}"})
                assert resp.status_code == status, (method, path, resp.text)
    deadline = time.monotonic() + 10  # the router's shutdown flushed its spans; the collector may lag
    while time.monotonic() < deadline and len(sink.of_trace(TRACE)) < len(calls):
        await asyncio.sleep(0.05)
    spans = {s["attrs"]["pdunit.request_id"]: s for s in sink.of_trace(TRACE)}
    assert sorted(spans) == [f"voice-{i}" for i in range(len(calls))]
    for i, (method, path, status) in enumerate(calls):
        span = spans[f"voice-{i}"]
        assert span["name"] == "router.request" and span["service"] == "pdunit-router"
        assert span["parent"] == CLIENT_SPAN and span["start"] <= span["end"]
        assert span["attrs"]["pdunit.method"] == method and span["attrs"]["pdunit.path"] == path
        assert span["attrs"]["pdunit.status"] == status and span["attrs"]["pdunit.unit"] == "a"
        # the unit got the router span's context in place of the client's
        got = unit.got[i][2]
        assert got["x-request-id"] == f"voice-{i}"
        assert got["traceparent"].split("-")[1:3] == [TRACE, span["id"]], got["traceparent"]


# ------------------------------------------------------------ two real LBs, one store


class RoomyDecode(FakeDecode):
    """A fake D without rate-floor admission (headroom -1): the router then keeps a session
    on its ring owner, so each test stream lands on the unit the test chose."""

    async def Info(self, request: pb.Empty, context: Any) -> pb.InfoReply:
        reply = await super().Info(request, context)
        reply.headroom_streams = -1
        return reply


@pytest.fixture
def fake_units(loop_thread: LoopThread) -> Iterator[list[FakeLBUnit]]:  # noqa: F811 (the imported fixture)
    units, dirs = [], []
    for _ in range(2):
        dirs.append(tempfile.mkdtemp(prefix="pdt", dir="/tmp"))
        unit = FakeLBUnit(dirs[-1])
        unit.decode = RoomyDecode()
        unit.prefill = FakePrefill(unit.decode)
        loop_thread.run(unit.start())
        units.append(unit)
    yield units
    for unit in units:
        loop_thread.run(unit.stop())
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def two_lbs(
    start_lb: Callable[..., RunningLB], fake_units: list[FakeLBUnit], short_dir: str  # noqa: F811
) -> tuple[RunningLB, RunningLB]:
    """Two LBs, each with its own fake P and D, one voices directory and one token file."""
    voices, token_file = os.path.join(short_dir, "voices"), os.path.join(short_dir, "voices-token")
    write_secret_file(token_file)
    lbs = []
    for unit in fake_units:
        speech_unit(unit)
        lbs.append(start_lb(model=MODEL, codec=CODEC, voices=voices, voices_token_file=token_file,
                            prefill_socket=unit.prefill_socket, decode_socket=unit.decode_socket))
    return lbs[0], lbs[1]


def upload_body(name: str) -> dict[str, str]:
    return {"name": name, "transcript": "hello there", "audio": base64.b64encode(wav_bytes(1.5)).decode()}


@pytest.mark.anyio
async def test_two_real_lbs_sharing_a_store_a_voice_uploaded_through_the_router_speaks_on_either(
    two_lbs: tuple[RunningLB, RunningLB]
) -> None:
    one, two = two_lbs
    token = one.lb.speech.voices_token
    assert token is not None
    auth = {"Authorization": f"Bearer {token.decode()}"}
    async with run_router({"one": one.url, "two": two.url}) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=20) as c:
            created = await c.post("/v1/voices", json=upload_body("anna"), headers=auth)
            assert created.status_code == 201, created.text
            for unit in ("one", "two"):
                session = key_owned_by(router.table, unit, prefix="s")
                resp = await c.post("/v1/audio/speech", headers={"X-Session-Id": session}, json={
                    "model": MODEL, "voice": "anna", "input": "Hi there.", "response_format": "pcm",
                    "max_frames": 5})
                assert resp.status_code == 200, resp.text
                assert resp.headers["x-pdunit-unit"] == unit and resp.content
            listed = {u.url: (await c.get(u.url + "/v1/voices")).json()["data"] for u in (one, two)}
            assert [[v["name"] for v in data] for data in listed.values()] == [["anna"], ["anna"]]
            # a create of one name on both units at once: exactly one 201, the other 409
            async with httpx.AsyncClient(timeout=20) as direct:
                answers = await asyncio.gather(*(direct.post(u.url + "/v1/voices", json=upload_body("bob"),
                                                             headers=auth) for u in (one, two)))
            assert sorted(a.status_code for a in answers) == [201, 409]
            deleted = await c.delete("/v1/voices/anna", headers=auth)
            assert deleted.status_code == 200
            for u in (one, two):  # gone on both at once
                assert (await c.get(u.url + "/v1/voices/anna")).status_code == 404
            refused = await c.post("/v1/audio/speech", json={
                "model": MODEL, "voice": "anna", "input": "Hi.", "response_format": "pcm"})
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "voice_not_found"
