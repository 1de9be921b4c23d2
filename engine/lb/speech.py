"""Text in, audio out: POST /v1/audio/speech (OpenAI's shape) and /v1/voices (docs/api.md).

Owns the speech request's fields, text + a stored voice -> prompt rows (CsmPrompter,
the voice's turn first: a shared prefix), the stream's submit with `audio` set (through
the LoadBalancer's own stream path) and the 200 that writes D's AudioChunks in order as
PCM, WAV or OpenAI's SSE events; and the voice store's routes (writes only with the
bearer token of --voices-token-file: a voice a stranger changed changes every client's
speech with it; reads open). Every refusal is OpenAI's error shape naming the field.
Must never decode audio itself (D's codec does), nor write PCM out of order.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import email.parser
import email.policy
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import Send

from pdunit.engine.audio.errors import FieldError, UnknownVoice, VoiceExists
from pdunit.engine.audio.pcm import sse_audio_delta, sse_audio_done, wav_header
from pdunit.engine.edge import bearer_of, read_token_file, request_id_problem
from pdunit.engine.http_body import BadContentLength, BodyTooLarge, read_limited
from pdunit.engine.lb.response import StreamEnd, StreamResponse
from pdunit.engine.lb.streams import (
    Audio,
    ClientGone,
    Frames,
    Stream,
    StreamEvent,
    StreamFailure,
    StreamStartError,
)
from pdunit.engine.lb.validate import (
    Limits,
    PackedRequest,
    RequestError,
    check_json_depth,
    make_sampling,
)
from pdunit.engine.observability import now_ns
from pdunit.engine.packing import pack
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.security import same_bytes, security_event

if TYPE_CHECKING:
    from pdunit.engine.audio.csm_prompt import CsmPrompter
    from pdunit.engine.audio.mimi_stream import MimiCodec
    from pdunit.engine.audio.voices import Voice, VoiceStore
    from pdunit.engine.lb.config import LBConfig

log = logging.getLogger("pdunit.lb.speech")

RESPONSE_FORMATS = {"pcm": "audio/pcm", "wav": "audio/wav"}
STREAM_FORMATS = ("audio", "sse")
SSE = "text/event-stream"
OPENAI_FIELDS = {"model", "input", "voice", "response_format", "stream_format", "speed", "instructions"}
SAMPLING_FIELDS = {"max_frames", "min_frames", "temperature", "top_k", "seed"}  # pdunit's extensions
SPEECH_BODY_LIMIT = 64 << 10  # 4096 characters of input, as JSON escapes, fit many times over
VOICE_FIELDS = {"name", "transcript", "speaker", "replace", "audio", "audio_format", "codes"}


class SpeechError(Exception):
    """A refused speech or voice request, answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: bool = False, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after, self.headers = retry_after, headers or {}

    @classmethod
    def of(cls, exc: FieldError | RequestError) -> SpeechError:
        if isinstance(exc, UnknownVoice):
            return cls(404, str(exc), exc.field, "voice_not_found")
        if isinstance(exc, VoiceExists):
            return cls(409, str(exc), exc.field, "voice_exists")
        if isinstance(exc, FieldError):
            return cls(400, str(exc), exc.field, "invalid_value")
        return cls(exc.status, exc.message, exc.field, exc.code)

    def response(self, retry_after_s: int = 1, headers: dict[str, str] | None = None) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        out = {**self.headers, **(headers or {})}
        if self.retry_after:
            out["Retry-After"] = str(retry_after_s)
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=out)


@dataclass
class Speech:
    """What the LB loaded for text and voices (LBConfig --model/--codec/--voices and
    --voices-token-file); a missing piece leaves its `*_problem` saying which flag gives it."""

    prompter: CsmPrompter | None = None
    codec: MimiCodec | None = None
    store: VoiceStore | None = None
    voices_token: bytes | None = None  # what a voice write needs; None: the store takes no write
    text_problem: str = "the LB has no --model: give it the CSM spec D serves to take text"
    voices_problem: str = "the LB has no voice store: give it --voices DIR (and --codec, --model)"

    @classmethod
    def load(cls, config: LBConfig) -> Speech:
        """Loads the tokenizer, the codec and the store the flags name; ValueError naming
        the flag when one cannot be loaded."""
        out = cls()
        if not config.model:
            return out
        prompter = load_prompter(config.model, config.max_rows)
        if prompter is None:
            out.text_problem = f"model {config.model!r} is not a CSM: only a CSM model takes text"
        else:
            out.prompter, out.text_problem = prompter, ""
        if config.codec:
            if prompter is None:
                raise ValueError(f"--codec {config.codec!r}: the model {config.model!r} is not a CSM")
            from pdunit.engine.audio.codec_spec import load_codec

            n_books, size = codec_books(config.model)
            out.codec = load_codec(config.codec, n_codebooks=n_books, codebook_size=size,
                                   model_dir=config.model if Path(config.model).is_dir() else None)
        if config.voices:
            from pdunit.engine.audio.voices import VoiceStore

            assert out.codec is not None and prompter is not None  # LBConfig: --voices needs --codec
            try:
                out.store = VoiceStore(Path(config.voices), out.codec)
            except OSError as exc:
                raise ValueError(f"--voices {config.voices!r}: {exc}") from None
            out.voices_problem = ""
            out.voices_token = read_token_file(config.voices_token_file, "--voices-token-file")
            # a voice may hold all the frames the store accepts
            frames = math.ceil(out.store.limits.max_seconds * out.codec.frame_rate)
            prompter.limits = dataclasses.replace(prompter.limits, max_voice_frames=max(frames, 1))
        return out


class SpeechHost(StreamEnd, Protocol):
    """What the speech and voice routes read of the LB (balancer.py's LoadBalancer, which
    imports this module: so this one names none of balancer.py, not even for types)."""

    @property
    def config(self) -> LBConfig: ...
    @property
    def limits(self) -> Limits | None: ...
    @property
    def speech(self) -> Speech: ...
    @property
    def speech_lock(self) -> asyncio.Lock: ...
    @property
    def hellos(self) -> list[pb.HelloReply | None]: ...
    @property
    def draining(self) -> bool: ...
    @property
    def shutting_down(self) -> bool: ...

    def readiness(self) -> tuple[bool, str]: ...

    async def open_stream(
        self, request: Request, packed: PackedRequest, stamps: dict[str, int], client_rid: str,
        audio: bool = False,
    ) -> tuple[Stream, list[StreamEvent]]: ...


def load_prompter(model: str, max_rows: int) -> CsmPrompter | None:
    """The text -> rows of a model spec: a CSM checkpoint directory's own tokenizer, the
    tiny one of `random:csm-tiny:<seed>`; None for a model that takes no text."""
    from pdunit.engine.audio.csm_prompt import CsmPrompter, PromptLimits

    limits = PromptLimits(max_rows=max_rows)
    if model.startswith("random:"):
        parts = model.split(":")
        if len(parts) == 3 and parts[1] == "csm-tiny":
            from pdunit.engine.audio.tiny_tokenizer import tiny_prompter

            return tiny_prompter(limits)
        return None
    path = Path(model)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {model!r}: cannot read its config.json ({exc})") from None
    if not isinstance(raw, dict) or raw.get("model_type") != "csm":
        return None
    try:
        return CsmPrompter.from_checkpoint(path, limits)
    except ValueError as exc:
        raise ValueError(f"--model {model!r}: {exc}") from None


def codec_books(model: str) -> tuple[int, int]:
    """(codebooks, ids per codebook) of a CSM's codec (`TTSModel.codec_books`, read from
    the model's config without building it): what D checks its --codec against."""
    from pdunit.engine.model.family_csm import CsmExtras, CsmFamily
    from pdunit.engine.model.registry import random_shape

    if model.startswith("random:"):
        shape = random_shape(model.split(":")[1])
        assert shape is not None  # load_prompter took it for a CSM
        parsed = shape[1]
    else:
        parsed = CsmFamily().parse_config(json.loads((Path(model) / "config.json").read_text()), Path(model).name)
    extras: CsmExtras = parsed.extras
    return extras.n_audio, extras.codec_codebook_size


# ------------------------------------------------------------------ POST /v1/audio/speech


@dataclass(frozen=True)
class SpeechRequest:
    model: str
    text: str
    voice: str
    response_format: str
    stream_format: str
    sampling_values: dict[str, Any]


def parse_speech(body: bytes) -> SpeechRequest:
    """The body's fields, typed and in range (SpeechError naming the field)."""
    try:
        check_json_depth(body)
        doc = json.loads(body)
    except RequestError as exc:
        raise SpeechError.of(exc) from None
    except ValueError as exc:
        raise SpeechError(400, f"the body is not JSON: {exc}", "body", "malformed_json") from None
    if not isinstance(doc, dict):
        raise SpeechError(400, "the body must be a JSON object", "body", "invalid_type")
    unknown = sorted(set(doc) - OPENAI_FIELDS - SAMPLING_FIELDS)
    if unknown:
        raise SpeechError(400, f"unknown field {unknown[0]!r}: this endpoint takes "
                          f"{', '.join(sorted(OPENAI_FIELDS | SAMPLING_FIELDS))}", unknown[0], "unknown_field")
    for name in ("model", "input", "voice"):
        if name not in doc:
            raise SpeechError(400, f"{name} is required", name, "missing_field")
    model, text = doc["model"], doc["input"]
    if not isinstance(model, str):
        raise SpeechError(400, f"model is {model!r}, expected a string", "model", "invalid_type")
    if not isinstance(text, str):
        raise SpeechError(400, f"input is {text!r}, expected a string", "input", "invalid_type")
    voice = doc["voice"]
    if isinstance(voice, dict) and set(voice) == {"id"}:
        voice = voice["id"]  # OpenAI's custom voice object {"id": ...}
    if not isinstance(voice, str):
        raise SpeechError(400, f"voice is {voice!r}: give a stored voice's name (GET /v1/voices)",
                          "voice", "invalid_type")
    fmt = doc.get("response_format", "wav")
    if fmt not in RESPONSE_FORMATS:
        raise SpeechError(400, f"response_format {fmt!r} is not served: use one of "
                          f"{', '.join(RESPONSE_FORMATS)}", "response_format", "unsupported_value")
    stream_format = doc.get("stream_format", "audio")
    if stream_format not in STREAM_FORMATS:
        raise SpeechError(400, f"stream_format {stream_format!r}: use audio or sse", "stream_format",
                          "unsupported_value")
    speed = doc.get("speed", 1.0)
    if type(speed) not in (int, float) or speed != 1.0:
        raise SpeechError(400, f"speed is {speed!r}: only 1.0 is served (the model speaks at its own rate)",
                          "speed", "unsupported_value")
    instructions = doc.get("instructions", "")
    if not isinstance(instructions, str) or instructions.strip():
        raise SpeechError(400, "instructions are not served: the voice sets how the text is spoken",
                          "instructions", "unsupported_value")
    values = {k: doc[k] for k in SAMPLING_FIELDS if k in doc}
    return SpeechRequest(model, text, voice, fmt, stream_format, values)


async def handle_speech(lb: SpeechHost, request: Request) -> Response:
    received = now_ns()
    client_rid = request.headers.get("x-request-id", "")
    echo = {"X-Request-Id": client_rid} if client_rid else {}
    retry_s = lb.config.retry_after_s
    try:
        if client_rid and (problem := request_id_problem(client_rid)):
            raise SpeechError(400, problem, "X-Request-Id", "bad_header")
        fmt = speech_format(lb)
        limits = lb.limits
        assert limits is not None and lb.speech.prompter is not None and lb.speech.store is not None
        body = await read_speech_body(request, SPEECH_BODY_LIMIT)
        t0 = time.perf_counter()
        req = parse_speech(body)
        served = lb.config.model
        if req.model != served:
            raise SpeechError(404, f"model {req.model!r} is not served here; this unit serves {served!r} "
                              "(GET /v1/models)", "model", "model_not_found")
        try:
            voice = await asyncio.to_thread(lb.speech.store.get, req.voice)
            sampling = make_sampling(req.sampling_values, limits)
            rows = speech_rows(lb.speech.prompter, req.text, voice)
        except (FieldError, RequestError) as exc:
            raise SpeechError.of(exc) from None
        if rows.shape[1] != limits.n_codebooks:
            raise SpeechError(503, f"the LB's --model makes rows of {rows.shape[1]} ids, D's model "
                              f"{limits.n_codebooks}: the unit is misconfigured", None, "config_error")
        packed = PackedRequest(rows, pack(rows, "i8"), sampling, "speech")
        lb.metrics.validate_seconds.labels("speech").observe(time.perf_counter() - t0)
    except SpeechError as exc:
        lb.metrics.requests.labels(code=str(exc.status), outcome="rejected").inc()
        return exc.response(retry_s, {**echo, "Connection": "close"} if exc.status == 413 else echo)
    except ClientDisconnect:
        lb.metrics.requests.labels(code="499", outcome="disconnected").inc()
        return Response(status_code=499)
    stamps = {"lb_received": received, "lb_validated": now_ns()}
    try:
        stream, first = await lb.open_stream(request, packed, stamps, client_rid, audio=True)
    except ClientGone:
        return Response(status_code=499)
    except StreamStartError as exc:
        rid = f"{exc.request_id or 0:016x}"
        err = SpeechError(exc.status, exc.message, None, exc.code, exc.retry_after)
        return err.response(retry_s, {"X-Request-Id": client_rid or rid, "X-Pdunit-Request-Id": rid})
    headers = {"X-Request-Id": client_rid or stream.hex_id, "X-Pdunit-Request-Id": stream.hex_id,
               "X-Pdunit-Sample-Rate": str(fmt.sample_rate), "X-Pdunit-Prompt-Rows": str(packed.rows),
               "X-Pdunit-Cached-Rows": str(stream.cached_tokens)}  # the voice's prefix, once P cached it
    return SpeechStreamResponse(lb, stream, first, req, fmt, headers)


def speech_format(lb: SpeechHost) -> pb.AudioFormat:
    """D's AudioFormat, or the SpeechError that says why this unit cannot speak now."""
    ready, reason = lb.readiness()
    if not ready:
        code = "draining" if (lb.draining or lb.shutting_down) else "not_ready"
        raise SpeechError(503, reason, None, code, retry_after=True)
    hello = lb.hellos[0]
    assert hello is not None
    if not hello.audio_format.sample_rate:
        raise SpeechError(503, "D has no codec: it serves frames only (start D with --codec); "
                          "the frames API is POST /v1/tts/stream", None, "no_codec")
    if lb.speech.prompter is None:
        raise SpeechError(503, lb.speech.text_problem, None, "no_text")
    if lb.speech.store is None:
        raise SpeechError(503, lb.speech.voices_problem, "voice", "no_voice_store")
    return hello.audio_format


def speech_rows(prompter: CsmPrompter, text: str, voice: Voice) -> np.ndarray:
    """The voice's turn (its clip's codes and transcript) first, then the text, as its speaker."""
    from pdunit.engine.audio.csm_prompt import Turn

    turn = Turn(voice.speaker, voice.transcript, voice.codes)
    return prompter.rows(text, speaker=voice.speaker, voice=[turn])


async def read_speech_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than `limit` bytes (engine/http_body.py) as a SpeechError."""
    try:
        return await read_limited(request, limit)
    except BadContentLength as exc:
        raise SpeechError(400, str(exc), "Content-Length", "bad_header") from None
    except BodyTooLarge:
        raise SpeechError(413, f"the body is larger than {limit} bytes", "body", "body_too_large") from None


class SpeechStreamResponse(StreamResponse):
    """200 + the stream's PCM as D's chunks come (raw, WAV or SSE); always ends the stream."""

    def __init__(self, lb: SpeechHost, stream: Stream, first: list[StreamEvent], req: SpeechRequest,
                 fmt: pb.AudioFormat, headers: dict[str, str]) -> None:
        self.status_code = 200  # not Response.__init__: it would set Content-Length: 0
        self.sse = req.stream_format == "sse"
        self.media_type = SSE if self.sse else RESPONSE_FORMATS[req.response_format]
        self.background = None
        self.init_headers({**headers, "Cache-Control": "no-store"})
        self.lb, self.stream, self.first, self.fmt = lb, stream, first, fmt
        self.wav = req.response_format == "wav"
        self.outcome = "disconnected"
        self.reason = ""  # eos | length, from the finishing frame
        self.audio_frames = 0
        self.rows = 0

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        stream = self.stream
        stream.last_event, stream.writing = time.monotonic(), True  # the frame watchdog starts here
        head = wav_header(self.fmt.sample_rate) if self.wav else b""
        if head and not self.sse:
            await send({"type": "http.response.body", "body": head, "more_body": True})
            head = b""
        events = self.first
        while True:
            pcm, failure, last = self._take(events)
            out = b""
            if pcm:
                out = sse_audio_delta(head + pcm) if self.sse else pcm
                head = b""
            if failure is not None:
                self.outcome = failure.code
                if not self.sse:
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                    # Returning with the body incomplete makes the server close the connection:
                    # the client sees a cut stream, never a short one that looks whole.
                    log.warning("speech stream cut", extra={"request_id": stream.hex_id,
                                                            "code": failure.code, "reason": failure.message})
                    return
                error = {"type": "error", "error": {"message": failure.message, "type": "server_error",
                                                    "param": None, "code": failure.code}}
                out += b"data: " + json.dumps(error).encode() + b"\n\n"
            elif last:
                self.outcome = self.reason or "length"
                if self.sse:
                    out += sse_audio_done(self.stream.prefill_tokens or self.rows, stream.frames_out)
            terminal = failure is not None or last
            if out or terminal:
                await send({"type": "http.response.body", "body": out, "more_body": not terminal})
            if terminal:
                return
            event = await stream.queue.get()
            events = [event, *stream.drain_ready()]

    def _take(self, events: list[StreamEvent]) -> tuple[bytes, StreamFailure | None, bool]:
        """The PCM of `events` in order; a failure, or whether the last chunk came."""
        stream, spf = self.stream, self.fmt.samples_per_frame
        pcm: list[bytes] = []
        frames = 0
        now = now_ns()
        for event in events:
            if isinstance(event, Frames):
                n = len(event.rows)
                stream.frames_out += n
                self.lb.metrics.frames.inc(n)
                stream.stamps.setdefault("lb_first_frame_out", now)
                stream.stamps["lb_last_frame_out"] = now
                if event.finished:
                    self.reason = event.finished
            elif isinstance(event, Audio):
                if event.first_frame != self.audio_frames or len(event.pcm) != 2 * spf * event.frames:
                    return b"".join(pcm), StreamFailure(
                        "decode_protocol_error",
                        f"D sent PCM of frames {event.first_frame}..+{event.frames} ({len(event.pcm)} bytes) "
                        f"after {self.audio_frames} frames of audio; expected frame {self.audio_frames}, "
                        f"{2 * spf} bytes a frame"), False
                self.audio_frames += event.frames
                frames += event.frames
                pcm.append(event.pcm)
                if event.last:
                    self._audio_out(now, frames)
                    return b"".join(pcm), None, True
            else:
                return b"".join(pcm), event, False
        self._audio_out(now, frames)
        return b"".join(pcm), None, False

    def _audio_out(self, now: int, frames: int) -> None:
        """Stamps and the playback record (TTFA, stutter) count audio frames written out."""
        if not frames:
            return
        stamps = self.stream.stamps
        stamps.setdefault("lb_first_audio_out", now)
        stamps["lb_last_audio_out"] = now
        self.stream.frame_out_ns.append(now)
        self.stream.frame_out_counts.append(frames)


# ------------------------------------------------------------------ /v1/voices


def voice_body_limit(store: VoiceStore) -> int:
    """A voice upload's body: the clip's bytes as base64 (4/3) plus the other fields."""
    return store.limits.max_bytes * 4 // 3 + (64 << 10)


def voice_object(voice: Voice, frame_rate: float) -> dict[str, Any]:
    frames = int(voice.codes.shape[1])
    return {"id": voice.name, "object": "voice", "name": voice.name, "transcript": voice.transcript,
            "speaker": voice.speaker, "frames": frames, "seconds": round(frames / frame_rate, 3),
            "digest": voice.digest}


def _store(lb: SpeechHost) -> VoiceStore:
    if lb.speech.store is None:
        raise SpeechError(503, lb.speech.voices_problem, None, "no_voice_store")
    return lb.speech.store


VOICE_WRITE_EVENT = "voices_unauthorized"


async def authorize_voice_write(lb: SpeechHost, request: Request) -> None:
    """A voice write's caller must hold the bearer token of --voices-token-file (compared
    in constant time); SpeechError 401 without a token, 403 with a wrong one or when the LB
    has none (its store is read-only), each a security event. Checked before the body is
    parsed and before the store is looked at, so a refusal tells nothing about the store;
    the refused body is read and dropped (bounded) so its sender reads the answer."""
    token, given = lb.speech.voices_token, bearer_of(request.headers)
    if token is None:
        reason, error = "no_token_file", SpeechError(
            403, "this unit's voice store is read-only: its LB has no --voices-token-file (the file holding "
            "the bearer token that creating, replacing and deleting a voice needs)", "Authorization",
            "voice_writes_disabled")
    elif given is None:
        reason, error = "missing", SpeechError(
            401, "creating, replacing or deleting a voice needs 'Authorization: Bearer <token>', the token of "
            "the LB's --voices-token-file", "Authorization", "missing_token",
            headers={"WWW-Authenticate": "Bearer"})
    elif not same_bytes(given, token):
        reason, error = "wrong", SpeechError(
            403, "the bearer token is not the one of the LB's --voices-token-file", "Authorization",
            "invalid_token")
    else:
        return
    security_event(VOICE_WRITE_EVENT, reason=reason, method=request.method, path=request.url.path,
                   client=request.client.host if request.client else "")
    with contextlib.suppress(BodyTooLarge, BadContentLength, ClientDisconnect):
        await read_limited(request, 0)  # drops what the client still sends (engine/http_body.py)
    raise error


async def create_voice(lb: SpeechHost, request: Request) -> Response:
    """POST /v1/voices: JSON or multipart/form-data (docs/api.md), with the voices token."""
    try:
        await authorize_voice_write(lb, request)
        store = _store(lb)
        body = await read_speech_body(request, voice_body_limit(store))
        fields = parse_voice_upload(request.headers.get("content-type", ""), body)
        async with lb.speech_lock:  # one encode at a time: the codec runs on the LB's CPU
            voice = await asyncio.to_thread(lambda: store.put(**fields))
    except (FieldError, RequestError) as exc:
        return SpeechError.of(exc).response()
    except SpeechError as exc:
        return exc.response(lb.config.retry_after_s, {"Connection": "close"} if exc.status == 413 else None)
    except ClientDisconnect:
        return Response(status_code=499)
    log.info("voice stored", extra={"voice": voice.name, "frames": int(voice.codes.shape[1])})
    return JSONResponse(voice_object(voice, store.codec.frame_rate), status_code=201)


def parse_voice_upload(content_type: str, body: bytes) -> dict[str, Any]:
    """The keyword arguments of VoiceStore.put from a JSON or multipart body."""
    media = content_type.split(";", 1)[0].strip().lower()
    raw: dict[str, Any]
    if media == "application/json":
        try:
            check_json_depth(body)
            raw = json.loads(body)
        except ValueError as exc:
            raise SpeechError(400, f"the body is not JSON: {exc}", "body", "malformed_json") from None
        if not isinstance(raw, dict):
            raise SpeechError(400, "the body must be a JSON object", "body", "invalid_type")
        if isinstance(raw.get("audio"), str):
            try:
                raw["audio"] = base64.b64decode(raw["audio"], validate=True)
            except (binascii.Error, ValueError):
                raise FieldError("audio", "is not base64 (in JSON, the clip's bytes are base64)") from None
    elif media == "multipart/form-data":
        raw = _multipart(content_type, body)
    else:
        raise SpeechError(400, f"Content-Type {content_type or '(none)'!r}: send application/json or "
                          "multipart/form-data", "Content-Type", "unsupported_content_type")
    unknown = sorted(set(raw) - VOICE_FIELDS)
    if unknown:
        raise FieldError(unknown[0], f"is not a voice field; the fields are {', '.join(sorted(VOICE_FIELDS))}")
    for name in ("name", "transcript"):
        if not isinstance(raw.get(name), str):
            raise FieldError(name, "is required (a string)")
    speaker, replace = raw.get("speaker", 0), raw.get("replace", False)
    if isinstance(speaker, str):  # multipart fields are text
        speaker = int(speaker) if speaker.isdigit() else speaker
    if isinstance(replace, str) and replace.lower() in ("true", "false"):
        replace = replace.lower() == "true"
    if type(replace) is not bool:
        raise FieldError("replace", f"is {replace!r}, expected true or false")
    out: dict[str, Any] = {"name": raw["name"], "transcript": raw["transcript"], "speaker": speaker,
                           "replace": replace}
    audio, codes = raw.get("audio"), raw.get("codes")
    if (audio is None) == (codes is None):
        raise FieldError("audio", "give exactly one of audio (a WAV or PCM clip) or codes (codec codes)")
    if codes is not None:
        if isinstance(codes, str | bytes):
            try:
                codes = json.loads(codes)
            except ValueError:
                raise FieldError("codes", "is not JSON: give [[code, ...] per codebook]") from None
        try:
            out["codes"] = np.asarray(codes, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise FieldError("codes", "must be a list per codebook of integer codes") from None
        return out
    if not isinstance(audio, bytes):
        raise FieldError("audio", "must be the clip's bytes (a file part, or base64 in JSON)")
    kind = raw.get("audio_format", "wav")
    if kind not in ("wav", "pcm"):
        raise FieldError("audio_format", f"is {kind!r}: wav or pcm (16-bit LE mono at the codec's rate)")
    out[kind] = audio
    return out


def _multipart(content_type: str, body: bytes) -> dict[str, Any]:
    """multipart/form-data through the standard library's MIME parser (data only): text
    fields as str, the `audio` part as bytes."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not msg.is_multipart():
        raise SpeechError(400, "the multipart body has no parts (or no boundary)", "body", "malformed_body")
    out: dict[str, Any] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            raise SpeechError(400, "a multipart part has no name", "body", "malformed_body")
        data = part.get_payload(decode=True)
        if not isinstance(data, bytes):
            raise SpeechError(400, f"part {name!r} holds no data", name, "malformed_body")
        if name == "audio":
            out[name] = data
        else:
            try:
                out[name] = data.decode("utf-8")
            except UnicodeDecodeError:
                raise FieldError(name, "is not UTF-8 text") from None
    return out


async def list_voices(lb: SpeechHost) -> Response:
    try:
        store = _store(lb)
    except SpeechError as exc:
        return exc.response(lb.config.retry_after_s)
    voices = await asyncio.to_thread(store.list)
    return JSONResponse({"object": "list", "data": [voice_object(v, store.codec.frame_rate) for v in voices]})


async def get_voice(lb: SpeechHost, name: str) -> Response:
    try:
        store = _store(lb)
        voice = await asyncio.to_thread(store.get, name)
    except FieldError as exc:
        return SpeechError.of(exc).response()
    except SpeechError as exc:
        return exc.response(lb.config.retry_after_s)
    return JSONResponse(voice_object(voice, store.codec.frame_rate))


async def delete_voice(lb: SpeechHost, request: Request, name: str) -> Response:
    """DELETE /v1/voices/{name}, with the voices token."""
    try:
        await authorize_voice_write(lb, request)
        store = _store(lb)
        await asyncio.to_thread(store.delete, name)
    except FieldError as exc:
        return SpeechError.of(exc).response()
    except SpeechError as exc:
        return exc.response(lb.config.retry_after_s)
    log.info("voice deleted", extra={"voice": name})
    return JSONResponse({"id": name, "object": "voice", "deleted": True})
