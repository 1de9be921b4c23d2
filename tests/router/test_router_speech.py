"""The router's POST /v1/audio/speech: the body's voice is the affinity key when no session
header is given (a voice's requests reach the unit whose P caches its prefix), the body
reaches the unit unchanged, a body the router cannot read a voice from is still forwarded
(the LB judges it), and a broken audio stream is cut, never given a text trailer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdunit.engine.router.proxy import voice_key
from tests.router.routerkit import FakeUnit, key_owned_by, run_router, run_units

pytestmark = pytest.mark.anyio
PCM = b"\x01\x00" * 320


class SpeechUnit(FakeUnit):
    """A FakeUnit that also answers /v1/audio/speech as the LB does: PCM, or the LB's
    400 for a body it cannot parse."""

    def __init__(self, name: str, chunks: int = 3, fail_after: int | None = None) -> None:
        super().__init__(name)
        self.chunks, self.fail_after = chunks, fail_after
        self.bodies: list[bytes] = []
        self.voices: list[str | None] = []
        self.app.router.routes.append(Route("/v1/audio/speech", self._speech, methods=["POST"]))

    async def _speech(self, request: Request) -> Response:
        body = await request.body()
        self.bodies.append(body)
        try:
            doc = json.loads(body)
            voice = doc["voice"] if isinstance(doc["voice"], str) else doc["voice"]["id"]
        except (ValueError, KeyError, TypeError, RecursionError):
            self.voices.append(None)
            return JSONResponse({"error": {"message": "the body is not JSON", "type": "invalid_request_error",
                                           "param": "body", "code": "malformed_json"}}, status_code=400)
        self.voices.append(voice)
        return StreamingResponse(self._pcm(), media_type="audio/pcm",
                                 headers={"X-Pdunit-Cached-Rows": "48", "X-Pdunit-Sample-Rate": "800",
                                          "X-Pdunit-Secret": "x"})

    async def _pcm(self) -> AsyncIterator[bytes]:
        for i in range(self.chunks):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError(f"fake unit {self.name} dies after {i} chunks")
            yield PCM
            await asyncio.sleep(0.005)


def speech(voice: object, text: str = "Hello there.") -> dict[str, object]:
    return {"model": "random:csm-tiny:0", "input": text, "voice": voice, "response_format": "pcm"}


async def test_same_voice_without_a_session_header_reaches_the_same_unit() -> None:
    a, b = SpeechUnit("a"), SpeechUnit("b")
    async with run_units(a, b) as served, run_router({n: s.url for n, s in served.items()}) as router:
        voice_a = key_owned_by(router.table, "a", prefix="voice:anna").removeprefix("voice:")
        async with httpx.AsyncClient() as client:
            for text, voice in (("One.", voice_a), ("Two.", {"id": voice_a})):
                r = await client.post(router.url + "/v1/audio/speech", json=speech(voice, text))
                assert r.status_code == 200 and r.content == PCM * 3
                assert r.headers["x-pdunit-unit"] == "a"
                # the speech headers reach the client; the unit's other internal ones do not
                assert r.headers["x-pdunit-cached-rows"] == "48" and r.headers["x-pdunit-sample-rate"] == "800"
                assert "x-pdunit-secret" not in r.headers
            metrics = (await client.get(router.url + "/metrics")).text
    assert (a.voices, b.voices) == ([voice_a, voice_a], [])
    assert json.loads(a.bodies[1]) == speech({"id": voice_a}, "Two.")  # forwarded unchanged
    assert 'pdunit_router_affinity_keys_total{source="voice"} 2.0' in metrics


async def test_different_voices_spread_and_a_session_header_wins() -> None:
    a, b = SpeechUnit("a"), SpeechUnit("b")
    async with run_units(a, b) as served, run_router({n: s.url for n, s in served.items()}) as router:
        async with httpx.AsyncClient() as client:
            for i in range(24):  # one at a time: the load bound never moves a key
                r = await client.post(router.url + "/v1/audio/speech", json=speech(f"voice-{i}"))
                assert r.status_code == 200
            owner = {f"voice-{i}": router.table.ring.owner(f"voice:voice-{i}") for i in range(24)}
            session_b = key_owned_by(router.table, "b", prefix="s")
            voice_a = next(v for v, u in owner.items() if u == "a")
            r = await client.post(router.url + "/v1/audio/speech", json=speech(voice_a),
                                  headers={"X-Session-Id": session_b})
            assert r.headers["x-pdunit-unit"] == "b"
    assert a.voices and b.voices  # spread over both
    assert all(owner[v] == "a" for v in a.voices) and all(owner[v] == "b" for v in b.voices[:-1])
    assert b.voices[-1] == voice_a


@pytest.mark.parametrize("body", [
    b"{not json", b"[" * 50_000, b"[1, 2]", json.dumps(speech(7)).encode(),
    json.dumps(speech("x" * 65)).encode(), json.dumps({"input": "no voice"}).encode(),
    b'{"voice": "' + b"a" * (70 << 10) + b'"}',  # past the peek: forwarded unread
])
async def test_a_body_without_a_readable_voice_is_forwarded_for_the_lb_to_refuse(body: bytes) -> None:
    a = SpeechUnit("a")
    async with run_units(a) as served, run_router({"a": served["a"].url}) as router:
        async with httpx.AsyncClient() as client:
            r = await client.post(router.url + "/v1/audio/speech", content=body,
                                  headers={"Content-Type": "application/json"})
            assert r.headers["x-pdunit-unit"] == "a"
            assert (await client.get(router.url + "/healthz")).status_code == 200
    assert a.bodies == [body]  # unchanged, whatever it holds
    assert voice_key(body) is None


async def test_an_audio_stream_that_breaks_is_cut_not_given_a_text_trailer() -> None:
    a = SpeechUnit("a", chunks=5, fail_after=2)
    async with run_units(a) as served, run_router({"a": served["a"].url}) as router:
        received = b""
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("POST", router.url + "/v1/audio/speech", json=speech("anna")) as resp:
                    assert resp.status_code == 200
                    async for chunk in resp.aiter_raw():
                        received += chunk
    assert received == PCM * 2


def test_voice_key_reads_a_name_or_openais_voice_object() -> None:
    assert voice_key(json.dumps(speech("anna")).encode()) == "voice:anna"
    assert voice_key(json.dumps(speech({"id": "bob"})).encode()) == "voice:bob"
    assert voice_key(json.dumps(speech({"name": "bob"})).encode()) is None
    assert voice_key(json.dumps(speech("")).encode()) is None
