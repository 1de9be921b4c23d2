"""POST /v1/audio/speech and /v1/voices against a fake D that sends AudioChunks, driven by
the official `openai` client where it has a call for it (tiny CSM tokenizer, tiny Mimi)."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import threading
import wave
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from pdunit.engine.audio.tiny_tokenizer import tiny_prompter
from pdunit.engine.lb.speech import speech_rows
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.security import write_secret_file
from tests.lb.conftest import RunningLB, wait_until
from tests.lb.fakes import FakeUnit, pcm_of

MODEL, CODEC = "random:csm-tiny:0", "random:mimi-tiny:0"
RATE, SPF = 800, 32  # the tiny Mimi: 800 Hz, 32 samples a frame (25 frames/s)


def wav_bytes(seconds: float, rate: int = RATE, channels: int = 1, width: int = 2) -> bytes:
    n = int(seconds * rate)
    samples = (0.3 * np.sin(np.arange(n * channels) * 0.05) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(samples.tobytes() if width == 2 else bytes(n * channels * width))
    return buf.getvalue()


def speech_unit(fake_unit: FakeUnit, codec: bool = True) -> None:
    d = fake_unit.decode
    d.model, d.n_codebooks, d.vocab = MODEL, 5, 64
    if codec:
        d.audio_format = pb.AudioFormat(sample_rate=RATE, samples_per_frame=SPF, frame_rate_hz=25.0, codec=CODEC)


@pytest.fixture
def voices_dir(short_dir: str) -> str:
    return os.path.join(short_dir, "voices")


@pytest.fixture
def speech_lb(start_lb: Callable[..., RunningLB], fake_unit: FakeUnit, voices_dir: str, short_dir: str) -> RunningLB:
    speech_unit(fake_unit)
    token_file = os.path.join(short_dir, "voices-token")
    write_secret_file(token_file)
    return start_lb(model=MODEL, codec=CODEC, voices=voices_dir, voices_token_file=token_file)


def owner(lb: RunningLB) -> httpx.Client:
    """A client of the store's owner: it holds the bearer token of --voices-token-file."""
    token = lb.lb.speech.voices_token
    assert token is not None
    return lb.client(headers={"Authorization": f"Bearer {token.decode()}"})


@pytest.fixture
def client(speech_lb: RunningLB) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=speech_lb.url + "/v1", api_key="unused", max_retries=0, timeout=20) as c:
        yield c


def upload(lb: RunningLB, name: str = "anna", seconds: float = 1.5, **extra: Any) -> httpx.Response:
    body = {"name": name, "transcript": "hello there", "audio": base64.b64encode(wav_bytes(seconds)).decode(),
            **extra}
    with owner(lb) as c:
        return c.post("/v1/voices", json=body)


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_openai_client_streams_pcm_and_wav_of_the_codec(speech_lb, client, fake_unit):
    assert upload(speech_lb).status_code == 201
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="anna", input="Hi there.", response_format="pcm", extra_body={"max_frames": 7},
    ) as resp:
        assert resp.headers["content-type"] == "audio/pcm"
        assert resp.headers["x-pdunit-sample-rate"] == str(RATE)
        pcm = resp.read()
    assert pcm == pcm_of(0, 7, SPF)  # 7 frames x 32 samples, in order
    sub = fake_unit.prefill.submits[-1]
    assert sub.audio and sub.sampling.max_frames == 7
    store_voice = speech_lb.lb.speech.store.get("anna")
    want = speech_rows(tiny_prompter(), "Hi there.", store_voice)
    assert np.frombuffer(sub.prompt, "<i8").reshape(sub.rows, sub.cols).tolist() == want.tolist()

    fake_unit.decode.last_chunk_later = True  # the last chunk in the step after the last frame
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice={"id": "anna"}, input="Hello!", response_format="wav", extra_body={"max_frames": 9},
    ) as resp:
        assert resp.headers["content-type"] == "audio/wav"
        data = resp.read()
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        samples = w.readframes(w.getnframes())
    assert len(samples) == 2 * 9 * SPF and samples == pcm_of(0, 9, SPF)
    wait_until(lambda: len(speech_lb.lb.table) == 0, what="streams left the table")
    assert fake_unit.decode.cancels == []  # both ended normally


def test_sse_events_parse_as_openai_speech_events(speech_lb, client):
    assert upload(speech_lb).status_code == 201
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="anna", input="ok", response_format="pcm", stream_format="sse",
        extra_body={"max_frames": 6},
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = resp.read().decode()
    events = [json.loads(block.removeprefix("data: ")) for block in text.split("\n\n") if block]
    deltas, done = events[:-1], events[-1]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == pcm_of(0, 6, SPF)
    assert done["type"] == "speech.audio.done"
    assert done["usage"]["output_tokens"] == 6 and done["usage"]["input_tokens"] > 0


def test_client_disconnect_cancels_the_speech_stream(speech_lb, fake_unit):
    assert upload(speech_lb).status_code == 201
    fake_unit.decode.step_s = 0.05
    body = {"model": MODEL, "voice": "anna", "input": "a long one", "response_format": "pcm", "max_frames": 2000}
    with speech_lb.client() as c, c.stream("POST", "/v1/audio/speech", json=body) as resp:
        assert resp.status_code == 200
        rid = int(resp.headers["x-pdunit-request-id"], 16)
        next(resp.iter_bytes())
    wait_until(lambda: len(speech_lb.lb.table) == 0, what="the stream left the LB's table")
    wait_until(lambda: rid in fake_unit.decode.cancels and rid in fake_unit.prefill.cancels, what="Cancel sent")


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"voice": "nobody"}, 404, "voice"),
        ({"model": "tts-1"}, 404, "model"),
        ({"speed": 1.5}, 400, "speed"),
        ({"response_format": "mp3"}, 400, "response_format"),
        ({"stream_format": "chunks"}, 400, "stream_format"),
        ({"instructions": "cheerful"}, 400, "instructions"),
        ({"input": ""}, 400, "input"),
        ({"input": "x" * 4097}, 400, "input"),
        ({"input": "hi <|AUDIO|>"}, 400, "input"),
        ({"max_frames": 0}, 422, "max_frames"),
        ({"colour": "red"}, 400, "colour"),
    ],
)
def test_each_refusal_is_openai_shaped_and_names_the_field(speech_lb, change, status, param):
    assert upload(speech_lb).status_code == 201
    body = {"model": MODEL, "voice": "anna", "input": "hi", **change}
    with speech_lb.client() as c:
        resp = c.post("/v1/audio/speech", json=body)
    assert resp.status_code == status, resp.text
    assert error_of(resp)["param"] == param


def test_the_openai_client_sees_an_unknown_voice_as_not_found(speech_lb, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.audio.speech.create(model=MODEL, voice="ghost", input="hi", response_format="wav")
    assert err.value.status_code == 404 and err.value.body["param"] == "voice"  # type: ignore[index]


def test_speech_is_refused_when_d_has_no_codec(start_lb, fake_unit, voices_dir):
    speech_unit(fake_unit, codec=False)
    lb = start_lb(model=MODEL)  # no --codec: D's Hello has no audio format either
    with lb.client() as c:
        resp = c.post("/v1/audio/speech", json={"model": MODEL, "voice": "anna", "input": "hi"})
        assert resp.status_code == 503 and error_of(resp)["code"] == "no_codec"
        # and the frames API still serves this unit
        assert c.get("/readyz").status_code == 200


def test_lb_is_not_ready_when_its_model_or_codec_differs_from_ds(start_lb, fake_unit, voices_dir):
    speech_unit(fake_unit)
    fake_unit.decode.audio_format.codec = "random:mimi-tiny:1"
    lb = start_lb(wait_ready=False, model=MODEL, codec=CODEC, voices=voices_dir)
    with lb.client() as c:
        wait_until(lambda: "--codec" in c.get("/readyz").json()["reason"], what="--codec mismatch")


def test_voices_upload_list_get_use_delete(speech_lb, client):
    resp = upload(speech_lb, "anna", seconds=2.0, speaker=1)
    assert resp.status_code == 201, resp.text
    voice = resp.json()
    assert voice["id"] == "anna" and voice["speaker"] == 1 and voice["frames"] == 50 and voice["seconds"] == 2.0
    # multipart, as a form upload with a file part
    files = {"audio": ("b.wav", wav_bytes(1.2), "audio/wav")}
    with owner(speech_lb) as c:
        resp = c.post("/v1/voices", data={"name": "bert", "transcript": "a clip"}, files=files)
        assert resp.status_code == 201, resp.text
        codes = np.random.default_rng(0).integers(0, 32, (4, 30)).tolist()
        resp = c.post("/v1/voices", json={"name": "carl", "transcript": "codes", "codes": codes})
        assert resp.status_code == 201 and resp.json()["frames"] == 30
        listed = c.get("/v1/voices").json()
        assert listed["object"] == "list" and [v["id"] for v in listed["data"]] == ["anna", "bert", "carl"]
        assert c.get("/v1/voices/bert").json()["transcript"] == "a clip"
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="carl", input="go", response_format="pcm", extra_body={"max_frames": 3}
    ) as resp:
        assert len(resp.read()) == 2 * 3 * SPF
    with owner(speech_lb) as c:
        assert c.delete("/v1/voices/carl").json() == {"id": "carl", "object": "voice", "deleted": True}
        resp = c.get("/v1/voices/carl")
        assert resp.status_code == 404 and error_of(resp)["param"] == "voice"
        assert c.delete("/v1/voices/carl").status_code == 404
        resp = c.post("/v1/audio/speech", json={"model": MODEL, "voice": "carl", "input": "hi"})
        assert resp.status_code == 404 and error_of(resp)["param"] == "voice"


@pytest.mark.parametrize(
    ("kind", "status", "param"),
    [
        ("corrupt", 400, "audio"),
        ("too_long", 400, "audio"),
        ("too_short", 400, "audio"),
        ("wrong_rate", 400, "audio"),
        ("stereo", 400, "audio"),
        ("bad_base64", 400, "audio"),
        ("bad_name", 400, "name"),
        ("no_transcript", 400, "transcript"),
        ("bad_codes", 400, "codes"),
        ("duplicate", 409, "name"),
        ("huge", 413, "body"),
    ],
)
def test_each_bad_upload_is_a_4xx_naming_the_field_and_leaves_nothing(speech_lb, voices_dir, kind, status, param):
    assert upload(speech_lb, "anna").status_code == 201
    audio: Any = base64.b64encode(wav_bytes(1.5)).decode()
    body: dict[str, Any] = {"name": "new", "transcript": "words"}
    if kind == "corrupt":
        audio = base64.b64encode(b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunk").decode()
    elif kind == "too_long":
        audio = base64.b64encode(wav_bytes(31)).decode()
    elif kind == "too_short":
        audio = base64.b64encode(wav_bytes(0.5)).decode()
    elif kind == "wrong_rate":
        audio = base64.b64encode(wav_bytes(1.5, rate=16000)).decode()
    elif kind == "stereo":
        audio = base64.b64encode(wav_bytes(1.5, channels=2)).decode()
    elif kind == "bad_base64":
        audio = "not base64 !!"
    elif kind == "bad_name":
        body["name"] = "../etc"
    elif kind == "no_transcript":
        body["transcript"] = ""
    elif kind == "duplicate":
        body["name"] = "anna"
    elif kind == "huge":
        audio = "A" * (4 << 20)
    if kind == "bad_codes":
        body["codes"] = [[99] * 30] * 4  # outside the codec's 32 ids
    else:
        body["audio"] = audio
    with owner(speech_lb) as c:
        resp = c.post("/v1/voices", json=body)
    assert resp.status_code == status, resp.text
    assert error_of(resp)["param"] == param
    assert sorted(os.listdir(voices_dir)) == ["anna.voice"]  # nothing half-written


def test_frames_streams_never_see_pcm(speech_lb, fake_unit):
    """A frames stream of a unit with a codec gets its frames only (D sends PCM to audio streams)."""
    with speech_lb.client() as c:
        resp = c.post("/v1/tts/stream", json={"prompt": [[1, 2, 3, 4, 5]] * 3, "max_frames": 5})
    lines = [json.loads(x) for x in resp.text.splitlines()]
    assert len(lines) == 6 and lines[-1]["done"] is True


def test_a_gap_in_the_pcm_cuts_the_stream(speech_lb, fake_unit):
    assert upload(speech_lb).status_code == 201
    d = fake_unit.decode
    original = d._chunk

    def skipping(a: Any, last: bool) -> pb.AudioChunk:
        chunk = original(a, last)
        if chunk.first_frame > 0:
            chunk.first_frame += 1  # D skipped a frame's PCM
        return chunk

    d._chunk = skipping  # type: ignore[method-assign]
    body = {"model": MODEL, "voice": "anna", "input": "hi", "response_format": "pcm", "max_frames": 8}
    got = threading.Event()
    with speech_lb.client() as c, c.stream("POST", "/v1/audio/speech", json=body) as resp:
        assert resp.status_code == 200
        with pytest.raises(httpx.HTTPError):
            for _ in resp.iter_bytes():
                got.set()
    assert got.is_set()
    wait_until(lambda: len(speech_lb.lb.table) == 0, what="the stream left the table")


def test_tiny_tokenizer_stays_in_the_tiny_vocabulary():
    p = tiny_prompter()
    rows = p.rows("Hello, World! 123 ~é")
    assert rows.shape[1] == 5 and rows[:, 4].max() < 64 and rows[:, :4].max() < 32
    vocab = p.tokenizer.get_vocab()
    assert vocab["<|AUDIO|>"] == 62 and vocab["<|audio_eos|>"] == 61 and max(vocab.values()) < 64


def test_lb_flags_for_speech_come_together_and_a_bad_model_stops_the_start(tmp_path):
    from pydantic import ValidationError

    from pdunit.engine.lb.config import LBConfig

    with pytest.raises(ValidationError, match="--voices needs --codec"):
        LBConfig(model=MODEL, voices=str(tmp_path))
    with pytest.raises(ValidationError, match="--codec needs --model"):
        LBConfig(codec=CODEC)
    out = subprocess.run([sys.executable, "-m", "pdunit.engine.lb.main", "--model", str(tmp_path / "nowhere"),
                          "--host", "127.0.0.1", "--port", "0", "--admin-port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot read its config.json" in out.stderr
