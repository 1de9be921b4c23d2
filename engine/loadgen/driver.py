"""The load driver: streams sent to an LB, each stream's playback judged, one row per level.

Owns issuing the synthetic workload (workload.py) closed loop or as Poisson arrivals to
`/v1/tts/stream` (`--api frames`) or `/v1/audio/speech` (`--api speech`: its voices
uploaded first), timing every frame or audio byte, the playback model (engine/playback.py:
stutter, rate, TTFA), a level's row, its pass criteria and the table. `pdunit local` and
`pdunit bench capacity` run it. The frame rate and the rate floor a stream is judged at
are the unit's (GET /v1/model) unless --fps / --min-rate are given: never assumed, so a
12.5-Hz model is not judged at 42. Never starts a unit and never writes a file (result
files are bench/'s). A 503 `rate_floor` is a refusal, not an error.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx
import numpy as np
from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator
from tqdm import tqdm

from pdunit.engine.edge import read_token_file
from pdunit.engine.loadgen.summary import Column, machine_info, percentile, percentiles
from pdunit.engine.loadgen.workload import (
    StreamSpec,
    Workload,
    WorkloadConfig,
    arrival_times,
    parse_range,
    row_rule_of,
    voice_clip,
    voice_codes,
    warm_voice,
)
from pdunit.engine.loop_lag import watch_loop_lag
from pdunit.engine.playback import DEFAULT_FPS, FLOOR_X_REAL_TIME, play_audio, stream_timing
from pdunit.engine.security import SecretFileError
from pdunit.engine.unit_layout import LB_PORT

REFUSAL_CODE = "rate_floor"  # the LB's error code of a rate-floor refusal (503 + Retry-After)


class LoadConfig(BaseModel):
    """One load against an LB (or router) URL: its levels, workload and pass criteria."""

    url: str = Field(f"http://127.0.0.1:{LB_PORT}", description="LB (or router) base URL")
    concurrency: list[int] = Field(
        [4, 8, 16], description="closed-loop levels, comma list (ignored with --rate)"
    )
    rate: list[float] = Field(
        [], description="Poisson arrival rates in requests/s, comma list; replaces --concurrency"
    )
    requests: int = Field(
        0, ge=0, description="end a level after this many streams started (0 = only --duration)"
    )
    burst_share: float = Field(
        0.0, ge=0, lt=1, description="share of requests that arrive in clumps (--rate)"
    )
    burst_size: int = Field(5, ge=1, description="requests per clump")
    duration: float = Field(60.0, gt=0, description="seconds of arrivals per level")
    warmup: float = Field(
        0.0, ge=0, description="streams started in the first seconds of a level are not counted"
    )
    ramp: float = Field(
        0.0, ge=0, description="closed loop: the workers start evenly spread over this many seconds, so a "
        "level does not open with `concurrency` simultaneous prompts (pair it with --warmup)"
    )
    drain_timeout: float = Field(
        120.0, gt=0, description="after a level, how long streams in flight may finish"
    )
    prompt_rows: tuple[int, int] = Field((1000, 2000), description="prompt rows, N or LOW-HIGH")
    frames: tuple[int, int] = Field(
        (105, 630), description="frames per stream, N or LOW-HIGH (max_frames = min_frames)"
    )
    voices: int = Field(8, ge=0, description="warm voices that requests may reuse")
    voice_reuse: float = Field(0.5, ge=0, le=1, description="share of requests using a warm voice")
    start_frames: int = Field(9, ge=1, description="frames buffered before playback starts (TTFA)")
    fps: float = Field(
        DEFAULT_FPS, gt=0, description="frames of audio per second the player consumes; unset: the unit's "
        "(GET /v1/model's frame_rate_hz: the codec's or the model's frame rate), else 21"
    )
    min_rate: float = Field(
        FLOOR_X_REAL_TIME * DEFAULT_FPS, ge=0, description="capacity: every stream's rate must reach this "
        "(frames/s at --fps); unset: 2 x --fps (2x real time, the unit's rate_floor_fps)"
    )
    ttfa_p95_ms: float = Field(500.0, gt=0, description="capacity: TTFA p95 must stay under this")
    body: str = Field("binary", description="request body: binary (int32) or json")
    api: Literal["frames", "speech"] = Field(
        "frames", description="frames: POST /v1/tts/stream (rows in, frames out); speech: POST "
        "/v1/audio/speech (text + a voice in, PCM out; --prompt-rows unused; needs a unit with a codec)"
    )
    voice_source: Literal["pcm", "codes"] = Field(
        "pcm", description="--api speech: voices uploaded as synthetic PCM clips (the LB's codec encodes "
        "them) or as synthetic codec codes (no encoding: below the audio vocabulary less CSM's 3 special ids)"
    )
    voice_seconds: float = Field(2.0, ge=1.0, le=30.0, description="--api speech: each voice's clip length")
    voices_token_file: str = Field(
        "", description="--api speech: the file holding the bearer token of the LB's --voices-token-file, sent "
        "with every voice upload and delete (never with a speech request); without it an LB refuses them")
    seed: int = Field(0, description="workload seed")
    mode_label: str = Field(
        "1p1d",
        description="mode in the results: monolith-prefill-first | monolith-chunked | 1p1d | 1p2d | ...",
    )
    gpus: int = Field(1, ge=0, description="GPUs the unit uses (capacity per GPU)")
    request_timeout: float = Field(60.0, gt=0, description="longest wait for any byte of a stream")
    max_in_flight: int = Field(1024, ge=1, description="--rate: cap on concurrent streams")
    client_procs: int = Field(1, ge=1, description="--rate: processes sending a level's requests (request i by "
                              "process i mod N), so one Python process's own delay stays out of the times; "
                              "the rows' client lag p99 says when one process is not enough")
    progress: bool = Field(True, description="progress bar on stderr")

    @field_validator("prompt_rows", "frames", mode="before")
    @classmethod
    def _range(cls, v: Any, info: ValidationInfo) -> Any:
        # "1000-2000" (flag or env, arrives as ["1000-2000"]), "500", or a (low, high) pair.
        if isinstance(v, (list, tuple)) and len(v) == 1:
            v = v[0]
        if isinstance(v, (str, int)):
            return parse_range(str(v), f"--{(info.field_name or 'range').replace('_', '-')}")
        return v

    @field_validator("concurrency", "rate", mode="before")
    @classmethod
    def _levels(cls, v: Any) -> Any:
        if isinstance(v, (int, float)):
            return [v]
        if isinstance(v, str):
            return [p for p in v.split(",") if p.strip()]
        return v

    @model_validator(mode="after")
    def _check(self) -> LoadConfig:
        for name in ("prompt_rows", "frames"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} {lo}-{hi}: expected 1 <= LOW <= HIGH")
        if not self.rate and not self.concurrency:
            raise ValueError("give --concurrency levels or --rate levels")
        if any(c < 1 for c in self.concurrency) or any(r <= 0 for r in self.rate):
            raise ValueError("concurrency levels must be >= 1 and rates > 0")
        if self.client_procs > 1 and not self.rate:
            raise ValueError("client_procs > 1 needs Poisson levels (--rate): a closed loop runs in one process")
        if self.body not in ("binary", "json"):
            raise ValueError(f"body {self.body!r}: expected binary or json")
        return self


@dataclass
class StreamResult:
    index: int
    voice: str
    reused: bool
    prompt_rows: int
    frames_requested: int
    started_s: float  # since the level started
    send_unix_ns: int  # wall clock at send: compare with the final record's stage stamps
    status: int | None = None
    error: str | None = None
    frames: int = 0
    arrivals: np.ndarray = field(default_factory=lambda: np.zeros(0))  # s since send, per frame
    final: dict[str, Any] | None = None
    ttft_s: float | None = None
    ttfa_s: float | None = None
    rate: float | None = None
    worst_window: float | None = None
    stalls: int = 0
    stall_s: float = 0.0
    last_frame_s: float | None = None  # since send: with send_unix_ns, the client's end of stream
    answered_s: float | None = None  # since send: the response's status line
    retry_after: str | None = None  # a refusal's Retry-After header
    api: str = "frames"
    # speech: seconds of PCM received, the audio-level player (on seconds, not frames),
    # and what the LB said of the prompt (None through a router, which keeps them)
    audio_s: float | None = None
    audio_stalls: int = 0
    audio_stall_s: float = 0.0
    cached_rows: int | None = None
    chunk_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # speech: per arrival

    @property
    def refused(self) -> bool:
        """Refused by rate-floor admission (503 rate_floor): the unit said no to keep
        its floor, which is no error."""
        return self.error == f"http_503:{REFUSAL_CODE}"

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def stutter(self) -> bool:
        return self.stalls > 0

    @property
    def audio_stutter(self) -> bool:
        return self.audio_stalls > 0

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("arrivals")
        d.pop("chunk_bytes")
        return d


async def stream_once(
    client: httpx.AsyncClient,
    url: str,
    spec: StreamSpec,
    body_format: str,
    start_frames: int,
    fps: float,
    level_t0: float | None = None,
) -> StreamResult:
    """One streaming request; frame arrival times are taken as NDJSON lines come in and
    played at `fps` frames a second."""
    body, headers = spec.body(body_format)
    t0 = time.perf_counter()
    res = StreamResult(
        index=spec.index,
        voice=spec.voice,
        reused=spec.reused,
        prompt_rows=spec.rows,
        frames_requested=spec.frames,
        started_s=t0 - (level_t0 or t0),
        send_unix_ns=time.time_ns(),
    )
    times: list[float] = []
    counts: list[int] = []
    last_line = b""
    try:
        async with client.stream(
            "POST", f"{url}/v1/tts/stream", content=body, headers=headers
        ) as resp:
            res.status = resp.status_code
            res.answered_s = time.perf_counter() - t0
            if resp.status_code != 200:
                res.retry_after = resp.headers.get("retry-after")
                raw = await resp.aread()
                try:
                    code = json.loads(raw)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = raw[:80].decode(errors="replace")
                res.error = f"http_{resp.status_code}:{code}"
                return res
            pending = b""
            async for chunk in resp.aiter_raw():
                now = time.perf_counter() - t0
                n = chunk.count(b"\n")
                pending += chunk
                if n:
                    times.append(now)
                    counts.append(n)
                    end = pending.rfind(b"\n")
                    last_line = pending[pending.rfind(b"\n", 0, end) + 1 : end]
                    pending = pending[end + 1 :]
    except httpx.TimeoutException:
        res.error = "timeout"
    except httpx.HTTPError as exc:
        res.error = f"transport:{type(exc).__name__}"
    lines = int(sum(counts))
    if res.error is None:
        try:
            final = json.loads(last_line) if last_line else None
        except ValueError:
            final = None
        res.final = final
        if not isinstance(final, dict):
            res.error = "truncated"  # no final record: the stream was cut
        elif "error" in final:
            res.error = f"stream:{final['error'].get('code', '?')}"
        elif final.get("frames") != lines - 1:
            res.error = f"frame_count:{lines - 1}!={final.get('frames')}"
    # The last newline ends the final record (when there is one): frames are the rest.
    frames = lines - 1 if res.final is not None else lines
    res.frames = max(0, frames)
    if res.frames:
        arrivals = np.repeat(np.asarray(times), np.asarray(counts))[: res.frames]
        res.arrivals = arrivals
        res.last_frame_s = float(arrivals[-1])
        timing = stream_timing(arrivals, start_frames, fps)
        res.ttft_s, res.ttfa_s = timing.ttft_s, timing.ttfa_s
        res.rate, res.worst_window = timing.rate, timing.worst_window
        res.stalls, res.stall_s = timing.playback.stalls, timing.playback.stall_s
    return res


@dataclass(frozen=True)
class SpeechTarget:
    """What --api speech sends with: the served model's spec (GET /v1/models), D's audio
    format (GET /v1/model's `audio`) and how voices are uploaded."""

    model: str
    sample_rate: int
    samples_per_frame: int
    frame_rate_hz: float
    n_books: int  # the codec's codebooks (the model's columns less the text one)
    code_range: int  # --voice-source codes: codes drawn in [0, code_range)
    voice_source: str = "pcm"
    voice_seconds: float = 2.0
    voices_token_file: str = ""  # the path only: a target is copied into the results and to client shards

    def voice_headers(self) -> dict[str, str]:
        """The headers of a voice upload or delete: the bearer token of voices_token_file."""
        return _voice_auth(self.voices_token_file)

    def voice_body(self, name: str) -> dict[str, Any]:
        """POST /v1/voices's body for voice `name` (replace: a rerun keeps one copy)."""
        # a transcript of its own from the first character: no voice shares a cached block with another
        tag = hashlib.sha256(name.encode()).hexdigest()[:12]
        doc: dict[str, Any] = {"name": name, "transcript": f"{tag}, a synthetic voice of the load driver.",
                               "replace": True}
        if self.voice_source == "codes":
            frames = max(1, round(self.voice_seconds * self.frame_rate_hz))
            doc["codes"] = voice_codes(name, self.n_books, self.code_range, frames)
        else:
            clip = voice_clip(name, self.sample_rate, self.voice_seconds)
            doc.update(audio=base64.b64encode(clip).decode(), audio_format="pcm")
        return doc


@functools.cache
def _voice_auth(path: str) -> dict[str, str]:
    token = read_token_file(path, "--voices-token-file")
    return {"Authorization": f"Bearer {token.decode()}"} if token else {}


async def speech_target(client: httpx.AsyncClient, url: str, model: dict[str, Any],
                        cfg: LoadConfig) -> SpeechTarget:
    """--api speech's target, from /v1/model (already read) and GET /v1/models; its token
    file is read here, so a bad one stops the run before its first level."""
    audio = model.get("audio")
    if not audio:
        raise RuntimeError(f"{url} serves no audio (GET /v1/model has no `audio`): --api speech needs a unit "
                           "whose D has --codec (pdunit local --codec ...)")
    resp = await client.get(f"{url}/v1/models")
    data = resp.json().get("data") if resp.status_code == 200 else None
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model ({resp.status_code}): --api speech needs the LB's "
                           "--model")
    n_books = int(model["n_codebooks"]) - 1  # CSM: the codebooks then the text column
    return SpeechTarget(model=str(data[0]["id"]), sample_rate=int(audio["sample_rate"]),
                        samples_per_frame=int(audio["samples_per_frame"]),
                        frame_rate_hz=float(audio["frame_rate_hz"]), n_books=n_books,
                        code_range=max(1, min(int(v) for v in model["vocab_sizes"][:n_books]) - 3),
                        voice_source=cfg.voice_source, voice_seconds=cfg.voice_seconds,
                        voices_token_file=_checked_token_file(cfg.voices_token_file))


def _checked_token_file(path: str) -> str:
    try:
        _voice_auth(path)
    except SecretFileError as exc:
        raise RuntimeError(str(exc)) from None
    return path


async def upload_voice(client: httpx.AsyncClient, url: str, target: SpeechTarget, name: str) -> str | None:
    """POST /v1/voices; None when stored, else the error (status and code)."""
    try:
        resp = await client.post(f"{url}/v1/voices", json=target.voice_body(name), headers=target.voice_headers())
    except httpx.HTTPError as exc:
        return f"voice_upload:{type(exc).__name__}"
    if resp.status_code == 201:
        return None
    return f"voice_upload:{resp.status_code}:{_error_code(resp.content)}"


async def upload_warm_voices(client: httpx.AsyncClient, url: str, target: SpeechTarget, n: int) -> None:
    """The `n` warm voices, uploaded before the first level; RuntimeError when one is refused."""
    for v in range(n):
        error = await upload_voice(client, url, target, warm_voice(v))
        if error is not None:
            raise RuntimeError(f"uploading warm voice {warm_voice(v)!r} to {url}/v1/voices failed: {error}")


def _error_code(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return raw[:80].decode(errors="replace")


async def speech_once(
    client: httpx.AsyncClient,
    url: str,
    spec: StreamSpec,
    target: SpeechTarget,
    start_frames: int = 9,
    level_t0: float | None = None,
) -> StreamResult:
    """One POST /v1/audio/speech streamed as raw PCM: the arrival time and size of every
    chunk read. TTFA is the first audio byte; the frame-level timing runs on the time each
    frame's samples were complete, the audio-level player on the seconds received, both
    with a start buffer of `start_frames` frames of audio. A cold voice (not `reused`) is
    uploaded before the request is sent (outside its times) and deleted after it."""
    res = StreamResult(index=spec.index, voice=spec.voice, reused=spec.reused, prompt_rows=0,
                       frames_requested=spec.frames, started_s=0.0, send_unix_ns=0, api="speech")
    if not spec.reused:
        error = await upload_voice(client, url, target, spec.voice)
        if error is not None:
            res.error = error
            return res
    try:
        await _speech(client, url, spec, target, res, level_t0)
    finally:
        if not spec.reused:
            try:
                await client.delete(f"{url}/v1/voices/{spec.voice}", headers=target.voice_headers())
            except httpx.HTTPError:
                pass  # a leftover cold voice is replaced by a rerun's upload
    if res.frames:
        _speech_timing(res, target, start_frames)
    return res


async def _speech(client: httpx.AsyncClient, url: str, spec: StreamSpec, target: SpeechTarget,
                  res: StreamResult, level_t0: float | None) -> None:
    body = {"model": target.model, "input": spec.text, "voice": spec.voice, "response_format": "pcm",
            "stream_format": "audio", "max_frames": spec.frames, "min_frames": spec.frames, "seed": spec.seed}
    times: list[float] = []
    sizes: list[int] = []
    t0 = time.perf_counter()
    res.started_s, res.send_unix_ns = t0 - (level_t0 or t0), time.time_ns()
    try:
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as resp:
            res.status = resp.status_code
            res.answered_s = time.perf_counter() - t0
            if resp.status_code != 200:
                res.retry_after = resp.headers.get("retry-after")
                res.error = f"http_{resp.status_code}:{_error_code(await resp.aread())}"
                return
            for name in ("prompt_rows", "cached_rows"):
                value = resp.headers.get(f"x-pdunit-{name.replace('_', '-')}")
                if value is not None and value.isdigit():
                    setattr(res, name, int(value))
            async for chunk in resp.aiter_raw():
                if chunk:
                    times.append(time.perf_counter() - t0)
                    sizes.append(len(chunk))
    except httpx.TimeoutException:
        res.error = "timeout"
    except httpx.HTTPError as exc:
        res.error = f"transport:{type(exc).__name__}"  # the LB cuts a failed stream's body
    res.arrivals, res.chunk_bytes = np.asarray(times), np.asarray(sizes, dtype=np.int64)
    total = sum(sizes)
    want = spec.frames * target.samples_per_frame * 2
    if res.error is None and total != want:
        res.error = f"audio_bytes:{total}!={want}"
    res.frames = total // 2 // target.samples_per_frame


def _speech_timing(res: StreamResult, target: SpeechTarget, start_frames: int) -> None:
    times = res.arrivals
    samples = res.chunk_bytes / 2.0
    res.audio_s = float(samples.sum()) / target.sample_rate
    res.ttfa_s = float(times[0])  # the first audio byte
    # frame k is playable once its samples are all in
    need = (np.arange(res.frames) + 1) * target.samples_per_frame
    frame_arrivals = times[np.searchsorted(np.cumsum(samples), need, side="left")]
    timing = stream_timing(frame_arrivals, start_frames, target.frame_rate_hz)
    res.ttft_s, res.last_frame_s = float(frame_arrivals[0]), float(frame_arrivals[-1])
    res.rate, res.worst_window = timing.rate, timing.worst_window
    res.stalls, res.stall_s = timing.playback.stalls, timing.playback.stall_s
    audio = play_audio(times, samples / target.sample_rate, start_frames / target.frame_rate_hz)
    res.audio_stalls, res.audio_stall_s = audio.stalls, audio.stall_s


async def fetch_model(client: httpx.AsyncClient, url: str, timeout: float = 30.0) -> dict[str, Any]:
    """GET /v1/model, waiting (503) until the unit is ready."""
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        try:
            resp = await client.get(f"{url}/v1/model")
            if resp.status_code == 200:
                return dict(resp.json())
            last = f"{resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{url}/v1/model did not answer 200 within {timeout:g} s (last: {last})")


class _Progress:
    """tqdm on stderr: seconds of arrivals, or streams when levels end by --requests."""

    def __init__(self, enabled: bool, levels: int, duration: float, requests: int) -> None:
        self.by_streams = requests > 0
        total = levels * requests if self.by_streams else round(levels * duration, 1)
        self.bar = tqdm(
            total=total,
            unit="stream" if self.by_streams else "s",
            file=sys.stderr,
            disable=not enabled,
            bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} {postfix}",
        )
        self.label = ""
        self.done = 0
        self.stutter = 0
        self.errors = 0
        self.in_flight = 0

    def start_level(self, label: str) -> None:
        self.label = label
        self.done = self.stutter = self.errors = 0

    def add(self, r: StreamResult) -> None:
        self.done += 1
        self.stutter += int(r.ok and r.stutter)
        self.errors += int(not r.ok and not r.refused)
        if self.by_streams:
            self.bar.update(1)

    def tick(self, seconds: float) -> None:
        if not self.by_streams:
            self.bar.update(seconds)
        self.bar.set_postfix_str(
            f"{self.label} done={self.done} in_flight={self.in_flight} "
            f"stutter={self.stutter} errors={self.errors}",
            refresh=True,
        )

    def close(self) -> None:
        self.bar.close()


def poisson_schedule(workload: Workload, cfg: LoadConfig, rate: float) -> list[tuple[float, StreamSpec]]:
    """A Poisson level's requests: (seconds after the level starts, spec), in arrival
    order, drawn before the level starts (the client's loop only sends), cut at
    --requests when given."""
    out: list[tuple[float, StreamSpec]] = []
    for at, n in arrival_times(rate, cfg.duration, cfg.burst_share, cfg.burst_size, seed=cfg.seed):
        for _ in range(n):
            if cfg.requests and len(out) >= cfg.requests:
                return out
            out.append((at, workload.next()))
    return out


async def run_level(
    client: httpx.AsyncClient,
    cfg: LoadConfig,
    workload: Workload | None,
    progress: _Progress,
    concurrency: int | None = None,
    schedule: list[tuple[float, StreamSpec]] | None = None,
    window: Callable[[str], None] | None = None,
    t0: float | None = None,
    speech: SpeechTarget | None = None,
) -> list[StreamResult]:
    """One level: closed loop at `concurrency` (specs from `workload`), or the Poisson
    arrivals of `schedule` (poisson_schedule). `t0`: the level's start on this process's
    perf_counter (default: now; a client shard gets the start all shards share).
    `window("start")` / `window("end")` are called (in a worker thread) when the counted
    window opens (after --warmup) and when arrivals stop: a caller reads the unit's own
    metrics there, so they cover the steady state and not the ramp or the drain.
    `speech`: the streams are POST /v1/audio/speech calls (--api speech)."""
    results: list[StreamResult] = []
    t0 = time.perf_counter() if t0 is None else t0
    stop_at = t0 + cfg.duration
    marks = asyncio.ensure_future(_window_marks(window, t0 + cfg.warmup, stop_at)) if window else None
    skipped = [0]
    progress.start_level(f"c={concurrency}" if concurrency is not None else f"{len(schedule or [])} arrivals")
    started = 0

    def may_start() -> bool:
        nonlocal started
        if time.perf_counter() >= stop_at or (cfg.requests and started >= cfg.requests):
            return False
        started += 1
        return True

    async def one(spec: StreamSpec) -> StreamResult:
        progress.in_flight += 1
        try:
            if speech is not None:
                r = await speech_once(client, cfg.url, spec, speech, cfg.start_frames, level_t0=t0)
            else:
                r = await stream_once(
                    client, cfg.url, spec, cfg.body, cfg.start_frames, cfg.fps, level_t0=t0
                )
        finally:
            progress.in_flight -= 1
        if r.started_s >= cfg.warmup:
            results.append(r)
            progress.add(r)
        return r

    async def closed_worker(i: int) -> None:
        assert workload is not None and concurrency is not None
        if cfg.ramp:
            await asyncio.sleep(cfg.ramp * i / concurrency)
        while may_start():
            r = await one(workload.next())
            if r.refused:  # a client told to come back later does, not at once (nor after the level)
                await asyncio.sleep(min(retry_after_s(r.retry_after), max(0.0, stop_at - time.perf_counter())))

    async def open_arrivals() -> None:
        assert schedule is not None
        tasks: set[asyncio.Task[StreamResult]] = set()
        for at, spec in schedule:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= cfg.max_in_flight:
                skipped[0] += 1  # the client's own cap, reported in the row
                continue
            task = asyncio.ensure_future(one(spec))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks))

    driver = (
        asyncio.ensure_future(asyncio.gather(*(closed_worker(i) for i in range(concurrency))))
        if concurrency is not None
        else asyncio.ensure_future(open_arrivals())
    )
    last = t0
    deadline = stop_at + cfg.drain_timeout
    while not driver.done():
        await asyncio.wait({driver}, timeout=0.5)
        now = time.perf_counter()
        progress.tick(min(now, stop_at) - min(last, stop_at))
        last = now
        if now > deadline:
            cut = progress.in_flight  # counted before cancelling: their finally blocks reset it
            driver.cancel()
            with _suppress_cancel():
                await driver
            results.extend(_unserved("cut_at_end") for _ in range(cut))
            break
    if marks is not None:
        with _suppress_cancel():
            await marks
    if driver.done() and not driver.cancelled() and driver.exception() is not None:
        raise driver.exception()  # type: ignore[misc]
    results.extend(_unserved("client_cap") for _ in range(skipped[0]))
    return results


# ------------------------------------------------------------------ client shards
# One Python process reading thousands of frames a second is late by itself (its loop
# lag is in every row): --client-procs spreads a Poisson level's requests over processes
# of their own, as real listeners are spread over machines.


def _shard_main(conn: Any, cfg_doc: dict[str, Any], schedule: list[tuple[float, StreamSpec]],
                speech: SpeechTarget | None = None) -> None:
    """A client shard (a spawned process): says ready, waits for the shared start (wall
    clock), sends its schedule, returns (results, loop lags) or ("error", traceback)."""
    import traceback

    try:
        cfg = LoadConfig.model_validate(cfg_doc)
        conn.send("ready")
        start_wall = conn.recv()
        conn.send(asyncio.run(_run_shard(cfg, schedule, start_wall, speech)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, which raises
        conn.send(("error", traceback.format_exc()))


async def _run_shard(cfg: LoadConfig, schedule: list[tuple[float, StreamSpec]],
                     start_wall: float, speech: SpeechTarget | None = None) -> tuple[list[StreamResult], list[float]]:
    lags: list[float] = []
    probe = asyncio.ensure_future(watch_loop_lag(lags.append))
    try:
        async with _client(cfg) as client:
            t0 = time.perf_counter() + (start_wall - time.time())
            results = await run_level(client, cfg, None, _Progress(False, 1, cfg.duration, 0), schedule=schedule,
                                      t0=t0, speech=speech)
    finally:
        probe.cancel()
    return results, lags


async def run_level_sharded(cfg: LoadConfig, schedule: list[tuple[float, StreamSpec]],
                            window: Callable[[str], None] | None,
                            speech: SpeechTarget | None = None) -> tuple[list[StreamResult], list[float]]:
    """A Poisson level sent by --client-procs processes, request i by shard i % n, all
    starting at one wall-clock instant; their results and loop lags merged."""
    import multiprocessing

    n = cfg.client_procs
    ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and an event loop
    doc = cfg.model_copy(update={"max_in_flight": -(-cfg.max_in_flight // n), "progress": False}).model_dump()
    shards = []
    try:
        for k in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_shard_main, args=(child, doc, schedule[k::n], speech), daemon=True)
            proc.start()
            shards.append((proc, parent))
        for k, (_, conn) in enumerate(shards):
            reply = await asyncio.to_thread(_recv, conn, 120.0, f"client shard {k} did not start")
            if reply != "ready":
                raise RuntimeError(f"client shard {k} failed to start:\n{reply[1]}")
        start_wall = time.time() + 0.2
        t0 = time.perf_counter() + 0.2
        for _, conn in shards:
            conn.send(start_wall)
        marks = asyncio.ensure_future(_window_marks(window, t0 + cfg.warmup, t0 + cfg.duration)) if window else None
        limit = cfg.duration + cfg.drain_timeout + 30.0
        results: list[StreamResult] = []
        lags: list[float] = []
        for k, (_, conn) in enumerate(shards):
            reply = await asyncio.to_thread(_recv, conn, limit, f"client shard {k} sent no results in {limit:g} s")
            if isinstance(reply, tuple) and reply and reply[0] == "error":
                raise RuntimeError(f"client shard {k} failed:\n{reply[1]}")
            results += reply[0]
            lags += reply[1]
        if marks is not None:
            await marks
        return results, lags
    finally:
        for proc, _ in shards:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


def _recv(conn: Any, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise RuntimeError(what)
    return conn.recv()


def _client(cfg: LoadConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                             timeout=httpx.Timeout(cfg.request_timeout, connect=10.0))


async def _window_marks(window: Callable[[str], None], start_at: float, end_at: float) -> None:
    if start_at >= end_at:
        return  # no steady window: the caller keeps its level-wide view
    for name, at in (("start", start_at), ("end", end_at)):
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        await asyncio.to_thread(window, name)


def retry_after_s(header: str | None) -> float:
    """A Retry-After header's seconds (1 when absent or not a number of seconds)."""
    try:
        return max(0.0, float(header)) if header is not None else 1.0
    except ValueError:
        return 1.0


def _unserved(error: str) -> StreamResult:
    """A stream the benchmark counts as failed without a response to measure."""
    return StreamResult(
        index=-1,
        voice="",
        reused=False,
        prompt_rows=0,
        frames_requested=0,
        started_s=0.0,
        send_unix_ns=0,
        error=error,
    )


class _suppress_cancel:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return exc_type is asyncio.CancelledError


def summarize_level(
    results: list[StreamResult],
    cfg: LoadConfig,
    concurrency: int | None,
    rate: float | None,
    elapsed_s: float,
    speech: SpeechTarget | None = None,
) -> dict[str, Any]:
    """A level's row. With `speech` the streams' frames are the codec's, so --min-rate
    (frames/s at --fps) is judged as the same multiple of real time at the codec's frame
    rate, and audio stalls fail the level as frame stalls do; TTFA is the first audio byte."""
    ok = [r for r in results if r.ok]
    fps = speech.frame_rate_hz if speech is not None else cfg.fps
    floor = cfg.min_rate * fps / cfg.fps
    refused = [r for r in results if r.refused]
    rates = [r.rate for r in ok if r.rate is not None]
    windows = [r.worst_window for r in ok if r.worst_window is not None]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    ttfa = [r.ttfa_s * 1000 for r in ok if r.ttfa_s is not None]
    errors: dict[str, int] = {}
    for r in results:
        if r.error and not r.refused:
            errors[r.error] = errors.get(r.error, 0) + 1
    stutters = sum(r.stutter for r in ok)
    # streams that met the floor: every frame at >= --min-rate and no stall
    good = [r for r in ok if r.rate is not None and r.rate >= floor and not r.stutter and not r.audio_stutter]
    row: dict[str, Any] = {
        "mode": cfg.mode_label,
        "gpus": cfg.gpus,
        "concurrency": concurrency,
        "rate": rate,
        "streams": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok) - len(refused),
        "error_kinds": errors,
        "refused": len(refused),
        "refused_share": (len(refused) / len(results)) if results else None,
        "refusal_p99_ms": percentile([r.answered_s * 1000 for r in refused if r.answered_s is not None], 99),
        "refused_without_retry_after": sum(r.retry_after is None for r in refused),
        "goodput_fps": round(sum(r.frames for r in good) / elapsed_s, 1) if elapsed_s > 0 else None,
        "stutter_share": (stutters / len(ok)) if ok else None,
        "stalls": sum(r.stalls for r in ok),
        "min_rate": min(rates) if rates else None,
        "p1_rate": percentile(rates, 1),
        "p50_rate": percentile(rates, 50),
        "worst_window": min(windows) if windows else None,
        "frames_total": sum(r.frames for r in ok),
        # Poisson levels: how many listeners this arrival rate is, each hearing its audio
        # in real time (rate x mean audio length): the load in streams, independent of
        # how fast the server generates (a fast server finishes streams early).
        "realtime_streams": (round(rate * sum(r.frames for r in ok) / len(ok) / fps, 1)
                             if rate is not None and ok else None),
        "elapsed_s": round(elapsed_s, 3),
        "gpu_busy": None,  # measured by the unit's own metrics, not from the client side
    }
    for name, values in (("ttft", ttft), ("ttfa", ttfa)):
        for key, value in percentiles(values).items():
            row[f"{name}_{key}_ms"] = value
    row.update(audio_row(ok, speech, floor))
    # the admitted streams' verdict: what rate-floor admission promises (a refusal is the
    # unit's right under overload); an overload level is judged by it
    row["admitted_kept_floor"] = bool(
        ok
        and row["errors"] == 0
        and stutters == 0
        and not row.get("audio_stalls")
        and row["min_rate"] is not None
        and row["min_rate"] >= floor
        and row["ttfa_p95_ms"] is not None
        and row["ttfa_p95_ms"] <= cfg.ttfa_p95_ms
    )
    # a capacity level's verdict: every arrival served within the criteria; a level the unit
    # refused part of is above its capacity (refusing the excess passes at any rate)
    row["passed"] = row["admitted_kept_floor"] and not refused
    return row


def audio_row(ok: list[StreamResult], speech: SpeechTarget | None, floor: float) -> dict[str, Any]:
    """A speech level's audio fields (None for a frames level): seconds of audio, the
    audio-level player's stutter beside the frame-level one, the rate floor the streams
    were judged at (frames/s of the codec), and the voices' prefix-cache hits as the LB
    reported them (`X-Pdunit-Cached-Rows`; None through a router, which keeps them)."""
    keys = ("api", "rate_floor", "audio_s_total", "audio_stutter_share", "audio_stalls", "warm_cache_hit_share",
            "cold_cache_hit_share", "cached_rows_share")
    if speech is None:
        return {k: None for k in keys} | {"api": "frames"}
    warm = [r for r in ok if r.reused and r.cached_rows is not None]
    cold = [r for r in ok if not r.reused and r.cached_rows is not None]
    told = [r for r in ok if r.cached_rows is not None and r.prompt_rows]
    rows = sum(r.prompt_rows for r in told)
    return {
        "api": "speech",
        "rate_floor": round(floor, 3),
        "audio_s_total": round(sum(r.audio_s or 0.0 for r in ok), 3),
        "audio_stutter_share": (sum(r.audio_stutter for r in ok) / len(ok)) if ok else None,
        "audio_stalls": sum(r.audio_stalls for r in ok),
        "warm_cache_hit_share": (sum(bool(r.cached_rows) for r in warm) / len(warm)) if warm else None,
        "cold_cache_hit_share": (sum(bool(r.cached_rows) for r in cold) / len(cold)) if cold else None,
        "cached_rows_share": round(sum(r.cached_rows or 0 for r in told) / rows, 4) if rows else None,
    }


CLIENT_LAG_WARN_MS = 20.0


def client_lag(lags: list[float], mode: str, level: float | None) -> dict[str, Any]:
    """The load generator's own event-loop delay over a level (engine/loop_lag.py). Every
    client-side time of the level (send, first frame, TTFA) includes it, so a level
    whose p99 passes CLIENT_LAG_WARN_MS says so loudly: its TTFA is partly the client's."""
    p99 = percentile([x * 1e3 for x in lags], 99)
    out = {"client_lag_p99_ms": None if p99 is None else round(p99, 2),
           "client_lag_max_ms": round(max(lags) * 1e3, 2) if lags else None}
    if p99 is not None and p99 > CLIENT_LAG_WARN_MS:
        print(f"WARNING {mode} at {level:g}: the load generator's event loop ran {p99:.0f} ms late at p99 "
              f"(> {CLIENT_LAG_WARN_MS:g} ms): its TTFA and frame times include that delay", flush=True)
    return out


COLUMNS = [
    Column("mode", "mode"),
    Column("concurrency", "conc"),
    Column("rate", "rate/s", "{:g}"),
    Column("repeat", "run"),
    Column("realtime_streams", "rt streams", "{:g}"),
    Column("streams", "streams"),
    Column("errors", "errors"),
    Column("refused_share", "refused", "{:.1%}"),
    Column("goodput_fps", "goodput fps", "{:.0f}"),
    Column("stutter_share", "stutter", "{:.1%}"),
    Column("audio_stutter_share", "audio stutter", "{:.1%}"),
    Column("min_rate", "min fps", "{:.1f}"),
    Column("p1_rate", "p1 fps", "{:.1f}"),
    Column("worst_window", "worst 1s", "{:.0f}"),
    Column("ttft_p50_ms", "TTFT p50", "{:.0f}"),
    Column("ttft_p95_ms", "p95", "{:.0f}"),
    Column("ttft_p99_ms", "p99", "{:.0f}"),
    Column("ttfa_p50_ms", "TTFA p50", "{:.0f}"),
    Column("ttfa_p95_ms", "p95", "{:.0f}"),
    Column("ttfa_p99_ms", "p99", "{:.0f}"),
    Column("warm_cache_hit_share", "warm hit", "{:.0%}"),
    Column("client_lag_p99_ms", "client lag p99", "{:.0f}"),
    Column("passed", "pass"),
]


def resolve_rates(cfg: LoadConfig, model: dict[str, Any]) -> tuple[LoadConfig, dict[str, str]]:
    """The frame rate the player plays at and the rate floor a stream must keep: each one
    given (flag, env or field) wins; else --fps is the unit's real-time frame rate (GET
    /v1/model's frame_rate_hz; DEFAULT_FPS from an LB older than that field) and
    --min-rate FLOOR_X_REAL_TIME x --fps (the unit's rate_floor_fps when --fps is its).
    Returns the config and, per field, where its value came from."""
    given = cfg.model_fields_set
    update: dict[str, float] = {}
    source = {"fps": "given", "min_rate": "given"}
    if "fps" not in given:
        unit_fps = model.get("frame_rate_hz")
        update["fps"] = float(unit_fps or DEFAULT_FPS)
        source["fps"] = ("the unit's frame rate (GET /v1/model)" if unit_fps
                         else f"{DEFAULT_FPS:g}: GET /v1/model names no frame rate")
    if "min_rate" not in given:
        update["min_rate"] = FLOOR_X_REAL_TIME * update.get("fps", cfg.fps)
        source["min_rate"] = f"{FLOOR_X_REAL_TIME:g} x fps"
    return cfg.model_copy(update=update), source


def pass_criteria(config: dict[str, Any]) -> str:
    """What a row's pass column checks (summarize_level's `passed`), in words."""
    speech = config.get("speech")
    source = config.get("rate_source") or {}
    rates = (f"; fps {config['fps']:g}: {source.get('fps', 'given')}, min_rate {config['min_rate']:g}: "
             f"{source.get('min_rate', 'given')}")
    if speech:
        floor = config["min_rate"] * speech["frame_rate_hz"] / config["fps"]
        return (f"every stream ends without an error or a stall (frame- or audio-level) at >= {floor:g} codec "
                f"frames/s ({config['min_rate']:g} / {config['fps']:g} x real time), and TTFA (first audio byte) "
                f"p95 <= {config['ttfa_p95_ms']:g} ms{rates}")
    return (f"every stream ends without an error or a stall (stutter) at >= {config['min_rate']:g} frames/s, and "
            f"TTFA p95 <= {config['ttfa_p95_ms']:g} ms{rates}")


async def run_load_async(
    cfg: LoadConfig, keep_streams: bool = False, window: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every level of `cfg` against its URL: {"machine", "config" (cfg, its --fps and
    --min-rate resolved against the unit's by `resolve_rates`, where they came from as
    `rate_source`, and the unit's /v1/model), "rows"} and, with `keep_streams`, "streams"
    (one record per stream). `window`: see `run_level`."""
    url = cfg.url.rstrip("/")
    cfg = cfg.model_copy(update={"url": url})
    levels_c = [] if cfg.rate else list(cfg.concurrency)
    levels_r = list(cfg.rate)
    machine = machine_info()
    rows: list[dict[str, Any]] = []
    streams: list[dict[str, Any]] = []
    async with _client(cfg) as client:
        model = await fetch_model(client, url)
        cfg, rate_source = resolve_rates(cfg, model)
        speech = await speech_target(client, url, model, cfg) if cfg.api == "speech" else None
        if speech is not None:
            await upload_warm_voices(client, url, speech, cfg.voices)
        workload = Workload(
            WorkloadConfig(
                n_codebooks=int(model["n_codebooks"]),
                vocab_sizes=tuple(model["vocab_sizes"]),
                prompt_rows=cfg.prompt_rows,
                frames=cfg.frames,
                voices=cfg.voices,
                voice_reuse=cfg.voice_reuse,
                seed=cfg.seed,
                speech=speech is not None,
                row_rule=row_rule_of(model),
            )
        )
        levels: list[tuple[int | None, float | None]] = [(c, None) for c in levels_c] + [
            (None, r) for r in levels_r
        ]
        progress = _Progress(cfg.progress, len(levels), cfg.duration, cfg.requests)
        try:
            for c, r in levels:
                t = time.perf_counter()
                lags: list[float] = []
                schedule = poisson_schedule(workload, cfg, r) if r is not None else None
                if schedule is not None and cfg.client_procs > 1:
                    print(f"rate={r:g}/s: {len(schedule)} arrivals over {cfg.client_procs} client processes",
                          file=sys.stderr, flush=True)
                    results, lags = await run_level_sharded(cfg, schedule, window, speech)
                else:
                    probe = asyncio.ensure_future(watch_loop_lag(lags.append))
                    try:
                        results = await run_level(client, cfg, workload, progress, concurrency=c, schedule=schedule,
                                                  window=window, speech=speech)
                    finally:
                        probe.cancel()
                row = summarize_level(results, cfg, c, r, time.perf_counter() - t, speech)
                rows.append(row | client_lag(lags, row["mode"], c if c is not None else r))
                if keep_streams:
                    # the level as `concurrency` / `arrival_rate` (a stream's own `rate` is its frames/s)
                    streams.extend({**s.record(), "concurrency": c, "arrival_rate": r} for s in results)
        finally:
            progress.close()
    config = {**cfg.model_dump(), "rate_source": rate_source, "model": model}
    if speech is not None:
        config["speech"] = asdict(speech)
    doc: dict[str, Any] = {"machine": machine, "config": config, "rows": rows}
    if keep_streams:
        doc["streams"] = streams
    return doc


def run_load(
    cfg: LoadConfig, keep_streams: bool = False, window: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """`run_load_async` on an event loop of its own."""
    return asyncio.run(run_load_async(cfg, keep_streams, window))
