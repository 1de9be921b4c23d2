"""The LoadBalancer: one unit's LB state and the life of one stream up to its 200.

Owns admission (ready, not draining), validate + pack (validate.py), a random
unit-unique request id registered in the stream table BEFORE the prompt goes to P,
`Prefill.Submit` and the wait for the first frame, so that every failure before it is a
proper HTTP error the router may retry elsewhere; then the frames (response.py) and the
stream's end: cancelled in P and D unless it ended normally. With several D's (1P2D) it
asks each Hello (one model), is ready only when each is, and sums them in /v1/load.
Never: run the model, hold KV, or retry a stream after its first byte went out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import secrets
import time
from dataclasses import asdict
from typing import Any

import grpc
import numpy as np
from fastapi import Request
from prometheus_client import REGISTRY, CollectorRegistry
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from pdunit.engine.edge import request_id_problem
from pdunit.engine.http_body import BadContentLength, BodyTooLarge, read_limited
from pdunit.engine.lb.config import LBConfig, parse_vocab_sizes
from pdunit.engine.lb.load import LoadDocument, build_load_document
from pdunit.engine.lb.metrics import LBMetrics
from pdunit.engine.lb.response import BINARY_FRAMES, FrameStreamResponse, wait_disconnect
from pdunit.engine.lb.speech import Speech
from pdunit.engine.lb.streams import (
    ClientGone,
    FrameSubscription,
    Stream,
    StreamEvent,
    StreamFailure,
    StreamStartError,
    StreamTable,
    hex_id,
)
from pdunit.engine.lb.unit import UnitClient
from pdunit.engine.lb.validate import (
    Limits,
    PackedRequest,
    RequestError,
    body_too_large,
    parse_request,
)
from pdunit.engine.loop_lag import watch_loop_lag
from pdunit.engine.observability import now_ns
from pdunit.engine.packing import view
from pdunit.engine.playback import DEFAULT_FPS, FLOOR_X_REAL_TIME, stream_timing
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto.row_rule import row_rule_from_hello
from pdunit.engine.security import security_event
from pdunit.engine.tracing import LB_STAGES, Tracing
from pdunit.engine.unit_layout import decode_names

log = logging.getLogger("pdunit.lb")

NORMAL_END = ("eos", "length")
UNREADY_PROBE_S = 0.2  # the probe period while the unit is not ready (else --probe-interval-s)

# P's Submit status -> (HTTP status, add Retry-After). Everything else is 502.
SUBMIT_STATUS_HTTP: dict[int, tuple[int, bool]] = {
    pb.NO_CAPACITY: (429, True),
    pb.DRAINING: (503, True),
    pb.RATE_FLOOR: (503, True),  # another unit (or this one later) has room: the router retries elsewhere
    pb.INVALID: (422, False),
    pb.DEADLINE_EXCEEDED: (504, False),
}
# A stream failure reported before the first frame -> HTTP status.
FAILURE_HTTP: dict[str, tuple[int, bool]] = {
    "no_capacity": (429, True),
    "draining": (503, True),
    "rate_floor": (503, True),
    "decode_unavailable": (503, True),
    "deadline_exceeded": (504, False),
    "invalid": (422, False),
}


class RequestIds:
    """uint64 request ids: 64 random bits each, never a counter, so that one response's
    X-Pdunit-Request-Id tells nothing about any other stream's id.

    Unique in the unit: an id equal to 0 or to one of this LB's last `RECENT` ids (which
    holds every stream in flight: they are bounded by --max-connections) is drawn again;
    an id a previous LB left held in P or D repeats with odds of (held ids) / 2^64.
    """

    RECENT = 1 << 16

    def __init__(self) -> None:
        self._recent: collections.deque[int] = collections.deque(maxlen=self.RECENT)
        self._seen: set[int] = set()

    def next(self) -> int:
        while True:
            rid = secrets.randbits(64)
            if rid and rid not in self._seen:
                break
        if len(self._recent) == self.RECENT:
            self._seen.discard(self._recent[0])
        self._recent.append(rid)
        self._seen.add(rid)
        return rid


class LoadBalancer:
    """State shared by every request of one LB process."""

    def __init__(self, config: LBConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else REGISTRY
        self.metrics = LBMetrics(self.registry)
        self.unit_name = config.resolved_unit_name()
        self.instance_id = secrets.token_hex(16)
        self.ids = RequestIds()
        self.limits: Limits | None = None
        self.frame_rate_hz: float | None = None  # D's real-time frame rate (Hello): streams play at it
        self.decode_names = decode_names(len(config.decode_sockets()))
        self.hellos: list[pb.HelloReply | None] = [None] * len(self.decode_names)
        self.hello_error = "D's Hello not answered yet"
        self.config_error = ""
        self.draining = False
        self.shutting_down = False
        self.table = StreamTable(
            self.metrics, lambda: self.limits.n_codebooks if self.limits else None
        )
        self.unit: UnitClient | None = None
        self.subscriptions: list[FrameSubscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.speech = Speech.load(config)  # text, codec and voices (speech.py); ValueError naming the flag
        self.speech_lock = asyncio.Lock()  # one voice encode at a time
        self.tracing = Tracing("lb", config.otlp_endpoint, self.instance_id)

    def _subscriptions_changed(self) -> None:
        up = bool(self.subscriptions) and all(s.up for s in self.subscriptions)
        self.metrics.subscription_up.set(1 if up else 0)

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        cfg = self.config
        rows = cfg.max_rows * (cfg.n_codebooks or 64) * 8
        self.unit = UnitClient(
            cfg.prefill_socket,
            cfg.decode_sockets(),
            cfg.proxy_socket,
            self.metrics,
            max_message_bytes=max(8 << 20, 2 * rows),
            late_grace_s=self.stale_after_s(),
        )
        several = len(self.decode_names) > 1
        self.subscriptions = [
            FrameSubscription(
                self.table,
                channel,
                f"lb:{self.unit_name}:{self.instance_id[:8]}",
                self.metrics,
                index=i,
                name=self.decode_names[i] if several else "D",
                on_change=self._subscriptions_changed if several else None,
            )
            for i, channel in enumerate(self.unit.decode_channels)
        ]
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(sub.run()) for sub in self.subscriptions]
        self._tasks.append(loop.create_task(self._probe_loop()))
        self._tasks.append(loop.create_task(self._frame_watchdog()))
        self._tasks.append(loop.create_task(watch_loop_lag(self.metrics.loop_lag_seconds.observe)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.unit is not None:
            await self.unit.wait_background(timeout=self.config.cancel_timeout_ms / 1000)
            await self.unit.close()
        self.tracing.shutdown()

    async def shutdown(self, timeout: float) -> int:
        """SIGTERM: refuse new streams, let those in flight finish; returns how many were cut."""
        self.shutting_down = True
        self._refresh_gauges()
        log.info(
            "shutting down: waiting for streams",
            extra={"streams": len(self.table), "timeout_s": timeout},
        )
        if await self.table.wait_empty(timeout):
            return 0
        cut = self.table.fail_all(
            "shutdown", f"the unit shut down; the stream was cut after {timeout:g} s"
        )
        log.warning("streams cut at shutdown", extra={"streams_cut": cut})
        await self.table.wait_empty(2.0)
        return cut

    async def _frame_watchdog(self) -> None:
        """Fails every stream whose response is being written and that had no event from
        D for --frame-timeout-ms. One timer for all streams: a timeout around each wait
        for a frame cost a task and a timer handle per frame (~20% of the LB's time
        relaying ~10k frames/s)."""
        timeout = self.config.frame_timeout_ms / 1000
        while True:
            await asyncio.sleep(min(0.1, timeout / 4))
            now = time.monotonic()
            for stream in list(self.table):
                if stream.silent_for(now) > timeout:
                    stream.push(StreamFailure(
                        "frame_timeout",
                        f"no frame from D for {self.config.frame_timeout_ms} ms (--frame-timeout-ms); "
                        "the stream was cancelled"))

    async def _probe_loop(self) -> None:
        assert self.unit is not None
        interval = self.config.probe_interval_s
        while True:
            for i, hello in enumerate(self.hellos):
                if hello is None:
                    await self._try_hello(timeout=interval, index=i)
            snap = await self.unit.probe(timeout=interval)
            for i, info in enumerate(snap.decodes):
                hello = self.hellos[i]
                if (
                    hello is not None
                    and info is not None
                    and info.instance_id
                    and info.instance_id != hello.instance_id
                ):
                    # D restarted: it may serve another model now. Validate against the new one.
                    log.info(
                        "D instance changed: asking Hello again",
                        extra={
                            "old": hello.instance_id,
                            "new": info.instance_id,
                            "decode": self.decode_names[i],
                        },
                    )
                    await self._try_hello(timeout=interval, index=i)
            self._refresh_gauges()
            # Sooner while P, D or the proxy keep the unit from being ready (it starts, one
            # restarted): ready within UNREADY_PROBE_S of their answer, not an interval later.
            waiting = not (self.readiness()[0] or self.draining or self.shutting_down)
            await asyncio.sleep(min(interval, UNREADY_PROBE_S) if waiting else interval)

    async def _try_hello(self, timeout: float, index: int = 0) -> None:
        assert self.unit is not None
        who = "D" if len(self.decode_names) == 1 else self.decode_names[index]
        try:
            reply = await self.unit.hello(timeout, index)
        except grpc.aio.AioRpcError as exc:
            self.hello_error = f"{who}'s Hello failed: {exc.code().name}: {exc.details()}"
            return
        self.hellos[index] = reply
        first = self.hellos[0]
        if first is None:
            return  # checked against the first D once it answers
        try:
            limits = self._limits_from(first)
            frame_rate_hz = hello_frame_rate(first)
            for i, other in enumerate(self.hellos[1:], start=1):
                if other is not None:
                    self._same_model(first, other, i)
            self.limits = limits
            self.frame_rate_hz = frame_rate_hz
            self.metrics.frame_rate_hz.set(self.frame_rate_hz)
            self.config_error = ""
        except ValueError as exc:
            self.config_error = str(exc)
            log.error("configuration does not match D", extra={"reason": self.config_error})
            return
        log.info(
            "D answered Hello",
            extra={
                "decode_instance": reply.instance_id,
                "decode": self.decode_names[index],
                "n_codebooks": limits.n_codebooks,
                "vocab_sizes": list(limits.vocab_sizes),
                "model": reply.model,
                "frame_rate_hz": self.frame_rate_hz,
            },
        )

    def _same_model(self, first: pb.HelloReply, other: pb.HelloReply, index: int) -> None:
        """Every D of a unit must serve the first D's model: the LB validates against one."""
        mine = (first.model, first.n_codebooks, first.vocab_sizes, first.eos_id,
                first.audio_format.SerializeToString(deterministic=True),
                first.row_rule.SerializeToString(deterministic=True), first.depth_decoder_sampling,
                hello_frame_rate(first))
        theirs = (other.model, other.n_codebooks, other.vocab_sizes, other.eos_id,
                  other.audio_format.SerializeToString(deterministic=True),
                  other.row_rule.SerializeToString(deterministic=True), other.depth_decoder_sampling,
                  hello_frame_rate(other))
        if mine != theirs:
            raise ValueError(
                f"{self.decode_names[index]} serves model {other.model!r} ({other.n_codebooks} "
                f"codebooks, eos {other.eos_id}, {hello_frame_rate(other):g} frames/s) but "
                f"{self.decode_names[0]} serves {first.model!r} ({first.n_codebooks} codebooks, eos "
                f"{first.eos_id}, {hello_frame_rate(first):g} frames/s): every D of a unit must run "
                f"the same model and codec"
            )

    def _limits_from(self, reply: pb.HelloReply) -> Limits:
        """The model's shape from D's Hello; flags given explicitly must agree with it."""
        cfg = self.config
        ncb = reply.n_codebooks
        if ncb < 1:
            raise ValueError(f"D's Hello reports n_codebooks={ncb}: D is misconfigured")
        if cfg.n_codebooks is not None and cfg.n_codebooks != ncb:
            raise ValueError(
                f"--n-codebooks is {cfg.n_codebooks} but D serves {ncb} codebooks: "
                f"fix --n-codebooks or leave it unset"
            )
        if cfg.model and reply.model != cfg.model:
            raise ValueError(
                f"--model is {cfg.model!r} but D serves {reply.model!r}: give the LB the spec D serves"
            )
        if cfg.codec and reply.audio_format.codec != cfg.codec:
            has = f"decodes with {reply.audio_format.codec!r}" if reply.audio_format.sample_rate else "has no codec"
            raise ValueError(f"--codec is {cfg.codec!r} but D {has}: give D and the LB the same --codec")
        from_d = tuple(view(reply.vocab_sizes, "i8").tolist())
        if cfg.vocab_sizes:
            try:
                vocab = parse_vocab_sizes(cfg.vocab_sizes, ncb)
            except ValueError as exc:
                raise ValueError(f"--vocab-sizes: {exc}") from None
            if from_d and from_d != vocab:
                raise ValueError(
                    f"--vocab-sizes {list(vocab)} differs from D's model {list(from_d)}: "
                    f"leave --vocab-sizes unset to use D's"
                )
        elif from_d:
            vocab = from_d
        else:
            raise ValueError("D's Hello carries no vocab sizes: set --vocab-sizes")
        try:
            row_rule = row_rule_from_hello(reply)
        except ValueError as exc:
            raise ValueError(f"D's Hello carries a bad row rule: {exc}") from None
        if row_rule is not None and row_rule.width != ncb:
            raise ValueError(f"D's Hello carries a row rule for rows of {row_rule.width} ids, "
                             f"its model's rows have {ncb}: D is misconfigured")
        return Limits(
            n_codebooks=ncb,
            vocab_sizes=vocab,
            max_rows=cfg.max_rows,
            max_body_bytes=cfg.max_body_bytes,
            max_frames_limit=cfg.max_frames_limit,
            default_max_frames=cfg.default_max_frames,
            row_rule=row_rule,
            depth_sampling=reply.depth_decoder_sampling,
        )

    # ------------------------------------------------------------ state

    def stale_after_s(self) -> float:
        """How old the oldest probe answer may be before the unit is not ready."""
        return 2 * self.config.probe_interval_s + 0.5

    def readiness(self) -> tuple[bool, str]:
        if self.shutting_down:
            return False, "the LB is shutting down"
        if self.draining:
            return False, "the unit is draining"
        if self.config_error:
            return False, self.config_error
        if self.limits is None or any(h is None for h in self.hellos):
            return False, self.hello_error
        if not self.subscriptions:
            return False, "no live frames subscription to D: not started"
        several = len(self.subscriptions) > 1
        for sub in self.subscriptions:
            if not sub.up:
                who = sub.name if several else "D"
                return False, f"no live frames subscription to {who}: {sub.last_error}"
        assert self.unit is not None
        snap = self.unit.snapshot
        age = time.monotonic() - snap.oldest_answer()
        if age > self.stale_after_s():
            late = next(iter(snap.late.values()), "")
            if late:
                return False, f"{late} (its last answer {age:.1f} s ago)"
            return False, f"P and D last answered their probe {age:.1f} s ago"
        for target in ("prefill", *self.decode_names, "proxy"):
            if target in snap.errors:
                return False, snap.errors[target]
        if snap.prefill is not None and snap.prefill.unready:
            return False, f"P is not ready: {snap.prefill.unready}"
        for name, info in zip(self.decode_names, snap.decodes, strict=False):
            if info is not None and info.unready:
                return False, f"{name if several else 'D'} is not ready: {info.unready}"
        for name, info in zip(self.decode_names, snap.decodes, strict=False):
            if info is not None and info.draining:
                who = name if several else "D"
                return False, f"{who} is draining (held pages above its threshold, or shutting down)"
        if snap.prefill is not None and snap.prefill.draining:
            return False, "P is draining"
        return True, "ready"

    def _refresh_gauges(self) -> None:
        self.metrics.ready.set(1 if self.readiness()[0] else 0)
        self.metrics.draining.set(1 if self.draining else 0)

    def set_draining(self, draining: bool) -> None:
        if draining != self.draining:
            log.info(
                "drain state changed", extra={"draining": draining, "streams": len(self.table)}
            )
        self.draining = draining
        self._refresh_gauges()

    async def load_document(self) -> LoadDocument:
        assert self.unit is not None
        snap = await self.unit.fresh_snapshot(
            self.config.load_cache_ms / 1000, self.config.probe_interval_s
        )
        ready, reason = self.readiness()
        return build_load_document(self, snap, ready, reason)

    def model_document(self) -> dict[str, Any] | None:
        if self.limits is None:
            return None
        rule = self.limits.row_rule  # the family's, from D's Hello: its fields as RowRule has them
        return {
            "n_codebooks": self.limits.n_codebooks,
            "vocab_sizes": list(self.limits.vocab_sizes),
            "eos_id": self.config.eos_id
            if self.config.eos_id is not None
            else self.hellos[0].eos_id
            if self.hellos[0] is not None
            else None,
            "max_rows": self.limits.max_rows,
            "max_frames_limit": self.limits.max_frames_limit,
            "default_max_frames": self.limits.default_max_frames,
            "audio": self._audio_document(),
            # frames a second of real-time audio, and the rate floor 2x it that a stream
            # must keep (the load generator's default --fps and --min-rate)
            "frame_rate_hz": self.frame_rate_hz,
            "rate_floor_fps": None if self.frame_rate_hz is None else FLOOR_X_REAL_TIME * self.frame_rate_hz,
            "row_rule": None if rule is None else {"width": rule.width, **asdict(rule),
                                                   "description": rule.describe()},
        }

    def _audio_document(self) -> dict[str, Any] | None:
        """D's PCM (AudioFormat), None when D has no codec (the unit serves frames only)."""
        hello = self.hellos[0]
        if hello is None or not hello.audio_format.sample_rate:
            return None
        fmt = hello.audio_format
        return {"sample_rate": fmt.sample_rate, "samples_per_frame": fmt.samples_per_frame,
                "frame_rate_hz": fmt.frame_rate_hz, "codec": fmt.codec}

    # ------------------------------------------------------------ one stream

    async def handle_stream(self, request: Request) -> Response:
        received = now_ns()
        client_rid = request.headers.get("x-request-id", "")
        problem = request_id_problem(client_rid) if client_rid else None
        if problem:
            security_event("bad_request_id", length=len(client_rid))
            self.metrics.requests.labels(code="400", outcome="rejected").inc()
            error = RequestError(400, "bad_header", problem, field="X-Request-Id")
            return JSONResponse(error.body(), status_code=400)
        ready, reason = self.readiness()
        if not ready:
            code = "draining" if (self.draining or self.shutting_down) else "not_ready"
            return self._reject(StreamStartError(503, code, reason, retry_after=True), client_rid)
        limits = self.limits  # one model for the whole request, even if D changes meanwhile
        assert limits is not None and self.unit is not None
        try:
            body = await read_body(request, limits)
        except ClientDisconnect:
            # gone before its body arrived (or cut by --body-timeout-s, already answered)
            self.metrics.requests.labels(code="499", outcome="disconnected").inc()
            return Response(status_code=499)
        except RequestError as exc:
            self.metrics.requests.labels(code=str(exc.status), outcome="rejected").inc()
            # past the limit only a bounded rest was read: the connection carries no more
            headers = {"Connection": "close"}
            if client_rid:
                headers["X-Request-Id"] = client_rid
            return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
        try:
            t0 = time.perf_counter()
            packed = parse_request(
                request.headers.get("content-type"), request.headers, body, limits
            )
            self.metrics.validate_seconds.labels(packed.body_format).observe(
                time.perf_counter() - t0
            )
        except RequestError as exc:
            self.metrics.requests.labels(code=str(exc.status), outcome="rejected").inc()
            return JSONResponse(
                exc.body(),
                status_code=exc.status,
                headers={"X-Request-Id": client_rid} if client_rid else None,
            )
        stamps = {"lb_received": received, "lb_validated": now_ns()}
        try:
            stream, first = await self.open_stream(request, packed, stamps, client_rid)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client is gone
        except StreamStartError as exc:
            rid = exc.request_id or 0
            return self._reject(exc, client_rid or hex_id(rid), request_id=rid)
        binary = BINARY_FRAMES in request.headers.get("accept", "")
        headers = {
            "X-Request-Id": client_rid or stream.hex_id,
            "X-Pdunit-Request-Id": stream.hex_id,
        }
        return FrameStreamResponse(self, stream, first, binary, headers)

    async def open_stream(
        self, request: Request, packed: PackedRequest, stamps: dict[str, int], client_rid: str,
        audio: bool = False,
    ) -> tuple[Stream, list[StreamEvent]]:
        """Registers a stream, submits it to P (with `audio`: D decodes it to PCM) and waits
        for its first event. Raises ClientGone when the client left first, StreamStartError
        (its `request_id` set) when the stream failed before it; either way the stream has
        left the table. The caller writes the 200 and must `finish` the stream."""
        rid = self.ids.next()
        stream = self.table.open(rid, stamps, client_rid, audio=audio)
        stream.span = self.tracing.start("lb.stream", stamps["lb_received"], request.headers.items(),
                                         request_id=stream.hex_id, audio=audio)
        deadline_ns = stamps["lb_received"] + self.config.request_deadline_ms * 1_000_000
        starting = asyncio.ensure_future(self._start_stream(stream, packed, deadline_ns, audio))
        gone = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait({starting, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Cancelled (server stopping) or a bug: never leave a stream in the table,
            # or /v1/load could never report the unit empty.
            starting.cancel()
            self.finish(stream, "internal_error", 500)
            raise
        finally:
            gone.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, StreamStartError):
                await starting
            self.finish(stream, "disconnected", 499)
            raise ClientGone
        try:
            first = starting.result()
        except StreamStartError as exc:
            self.finish(stream, exc.code, exc.status)
            exc.request_id = rid
            raise
        except Exception:
            log.exception("stream start failed unexpectedly", extra={"request_id": stream.hex_id})
            self.finish(stream, "internal_error", 500)
            raise
        return stream, first

    async def _start_stream(
        self, stream: Stream, packed: PackedRequest, deadline_ns: int, audio: bool = False
    ) -> list[StreamEvent]:
        """Submit to P and wait for the first frame; StreamStartError on any failure."""
        assert self.unit is not None
        stream.stamps["lb_submitted"] = now_ns()
        req = pb.SubmitRequest(
            request_id=stream.request_id,
            prompt=packed.prompt_bytes,
            rows=packed.rows,
            cols=packed.cols,
            sampling=packed.sampling,
            deadline_unix_ms=deadline_ns // 1_000_000,
            stamps=pb.Stamps(ns=stream.stamps),
            audio=audio,
        )
        remaining = max(0.001, (deadline_ns - now_ns()) / 1e9)
        traced = {"metadata": stream.span.metadata()} if stream.span is not None else {}  # engine/tracing.py
        submit = asyncio.ensure_future(self.unit.prefill.Submit(req, timeout=remaining, **traced))
        first_event = asyncio.ensure_future(stream.queue.get())
        try:
            # D may fail the transfer (and say so on the frames stream) while P is stopped
            # and cannot answer Submit: the client hears at once (PROTOCOL.md 3.4).
            await asyncio.wait({submit, first_event}, timeout=remaining,
                               return_when=asyncio.FIRST_COMPLETED)
            early = first_event.result() if first_event.done() else None
            if isinstance(early, StreamFailure):
                raise self._failure(early)
            if not submit.done():
                # the first frame is already here (or the deadline passed): P's answer
                # follows the commit at once; wait for it for its stamps and counts
                await asyncio.wait({submit}, timeout=max(0.001, (deadline_ns - now_ns()) / 1e9))
            if not submit.done():
                raise StreamStartError(
                    504, "deadline_exceeded",
                    f"P did not answer within the request deadline ({self.config.request_deadline_ms} ms)",
                )
            reply = self._submit_reply(submit, stream)
            stream.prefill_tokens, stream.cached_tokens = reply.prefill_tokens, reply.cached_tokens
            if not first_event.done():
                await asyncio.wait({first_event}, timeout=max(0.001, (deadline_ns - now_ns()) / 1e9))
            if not first_event.done():
                raise StreamStartError(
                    504, "deadline_exceeded",
                    f"no first frame within the request deadline ({self.config.request_deadline_ms} ms)",
                )
            event = first_event.result()
            if isinstance(event, StreamFailure):
                raise self._failure(event)
            return [event, *stream.drain_ready()]
        finally:
            for task in (submit, first_event):
                if not task.done():
                    task.cancel()

    @staticmethod
    def _failure(event: StreamFailure) -> StreamStartError:
        status, retry = FAILURE_HTTP.get(event.code, (502, False))
        return StreamStartError(status, event.code, event.message, retry)

    def _submit_reply(self, submit: asyncio.Future, stream: Stream) -> pb.SubmitReply:
        """P's answer, or the StreamStartError that says why there is none. An answer's
        stamps (a refusal's too) join the stream's."""
        try:
            reply = submit.result()
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise StreamStartError(
                    504,
                    "deadline_exceeded",
                    f"P did not accept the prompt within the request deadline "
                    f"({self.config.request_deadline_ms} ms)",
                ) from None
            if code == grpc.StatusCode.UNAVAILABLE:
                raise StreamStartError(
                    503,
                    "prefill_unavailable",
                    f"P is unreachable: {exc.details()}",
                    retry_after=True,
                ) from None
            raise StreamStartError(
                502, "prefill_error", f"P's Submit failed: {code.name}: {exc.details()}"
            ) from None
        stream.stamps["lb_submit_returned"] = now_ns()
        stream.stamps.update(reply.stamps.ns)
        if reply.status != pb.STATUS_OK:
            status, retry = SUBMIT_STATUS_HTTP.get(reply.status, (502, False))
            name = (
                pb.Status.Name(reply.status).lower()
                if reply.status in pb.Status.values()
                else "unknown"
            )
            raise StreamStartError(
                status, name, reply.message or f"P refused the request: {name}", retry
            )
        return reply

    def finish(self, stream: Stream, outcome: str, status: int) -> None:
        """A stream ended (any way): leave the table, cancel in P and D unless it ended normally."""
        if self.table.close(stream.request_id) is None:
            return  # already finished
        assert self.unit is not None
        # a unit that answered RATE_FLOOR holds nothing for the stream (docs/admission.md):
        # no Cancel for it, two RPCs fewer per refusal to an engine that is full
        refused = outcome == "rate_floor" and "lb_submit_returned" in stream.stamps
        if outcome not in NORMAL_END and not refused:
            self.unit.cancel(
                stream.request_id, self.config.cancel_timeout_ms / 1000, decode=stream.decode
            )
        self.metrics.requests.labels(code=str(status), outcome=outcome).inc()
        stamps = stream.stamps
        if stream.span is not None:
            stream.span.end(stamps, LB_STAGES, now_ns(), "" if outcome in NORMAL_END else outcome,
                            outcome=outcome, status=status, frames=stream.frames_out)
            stream.span = None
        extra: dict[str, Any] = {
            "request_id": stream.hex_id,
            "client_request_id": stream.client_request_id,
            "outcome": outcome,
            "status": status,
            "frames": stream.frames_out,
        }
        if "lb_first_frame_out" in stamps:
            ttft = (stamps["lb_first_frame_out"] - stamps["lb_received"]) / 1e9
            self.metrics.ttft_seconds.observe(ttft)
            extra["ttft_ms"] = round(ttft * 1000, 3)
        if outcome == "rate_floor":
            self._observe_refusal(stream, extra)
        if outcome in NORMAL_END:
            self.metrics.observe_stages(stamps)
            self._observe_playback(stream, extra)
            log.info("stream ended", extra=extra)
        else:
            log.warning("stream failed", extra=extra)

    def _observe_refusal(self, stream: Stream, extra: dict[str, Any]) -> None:
        """A rate-floor refusal: how long it took (`pdunit_lb_refusal_seconds`) and, in its
        log line, the gap to each stage stamp (LB, P / the monolith, D) on its way."""
        stamps = stream.stamps
        now = now_ns()
        self.metrics.refusal_seconds.observe(max(0, now - stamps["lb_received"]) / 1e9)
        ordered = sorted([*stamps.items(), ("lb_answered", now)], key=lambda kv: kv[1])
        extra["stages_ms"] = {name: round((at - before) / 1e6, 3)
                              for (_, before), (name, at) in zip(ordered, ordered[1:], strict=False)}

    def _observe_playback(self, stream: Stream, extra: dict[str, Any]) -> None:
        """What the stream's listener heard, played at D's real-time frame rate."""
        if not stream.frame_out_ns or "lb_received" not in stream.stamps or self.frame_rate_hz is None:
            return
        arrivals = np.repeat(
            (np.asarray(stream.frame_out_ns, dtype=np.int64) - stream.stamps["lb_received"]) / 1e9,
            stream.frame_out_counts,
        )
        timing = stream_timing(arrivals, self.config.start_frames, self.frame_rate_hz)
        if timing.ttfa_s is not None:
            self.metrics.ttfa_seconds.observe(timing.ttfa_s)
            extra["ttfa_ms"] = round(timing.ttfa_s * 1000, 3)
        if timing.rate is not None:
            self.metrics.stream_rate.observe(timing.rate)
            extra["rate_fps"] = round(timing.rate, 2)
        if timing.worst_window is not None:
            self.metrics.stream_worst_window.observe(timing.worst_window)
        if timing.playback.stalls:
            self.metrics.stutters.inc()
            extra["stalls"] = timing.playback.stalls

    def _reject(
        self, exc: StreamStartError, client_rid: str, request_id: int | None = None
    ) -> JSONResponse:
        if request_id is None:  # finish() counts the requests that reached the table
            self.metrics.requests.labels(code=str(exc.status), outcome=exc.code).inc()
        headers = {}
        if exc.retry_after:
            headers["Retry-After"] = str(self.config.retry_after_s)
        if client_rid:
            headers["X-Request-Id"] = client_rid
        if request_id is not None:
            headers["X-Pdunit-Request-Id"] = hex_id(request_id)
        return JSONResponse(
            {"error": {"code": exc.code, "message": exc.message}},
            status_code=exc.status,
            headers=headers,
        )



def hello_frame_rate(reply: pb.HelloReply) -> float:
    """D's real-time frame rate; DEFAULT_FPS from a D older than the field (0). ValueError
    naming the field for one no clock can run at (not finite, or negative): the player's
    clock is never set by whatever answered on D's socket. (No upper bound: tiny test
    codecs run at thousands of frames a second.)"""
    hz = reply.frame_rate_hz
    if hz == 0:
        return DEFAULT_FPS
    if not (0 < hz < math.inf):  # NaN fails this too
        raise ValueError(f"D's Hello names frame_rate_hz {hz!r}: expected a finite positive frame rate in Hz")
    return hz


async def read_body(request: Request, limits: Limits) -> bytes:
    """The body, refusing more than --max-body-bytes (engine/http_body.py)."""
    try:
        return await read_limited(request, limits.max_body_bytes)
    except BadContentLength as exc:
        raise RequestError(400, "bad_header", str(exc), field="Content-Length") from None
    except BodyTooLarge as exc:
        raise body_too_large(exc.size, limits) from None

