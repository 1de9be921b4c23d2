"""The LB's stream table and its subscriptions to D's frames (one per D of the unit).

Owns the map request_id -> `Stream` (registered BEFORE the prompt goes to P, so no frame
arrives for an unknown stream), dispatching each `Decode.Frames` message into the
streams' queues, and each subscription's life: reconnect with backoff when D restarts,
and on every break fail each stream it may have carried (its D's, and those whose D is
not known yet: a lost frame must never look healthy). What D must send is docs/api.md's
"In-pod contract". Never: talk HTTP, call P, or decide what a client sees (balancer.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from pdunit.engine.lb.metrics import LBMetrics
from pdunit.engine.packing import view
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.tracing import Span

FINISHED_NAMES = {1: "eos", 2: "length"}

log = logging.getLogger("pdunit.lb.streams")


@dataclass(frozen=True)
class Frames:
    """New frames of one stream; `finished` is "" while running, else eos | length."""

    rows: list[list[int]]
    finished: str = ""


@dataclass(frozen=True)
class StreamFailure:
    code: str
    message: str


@dataclass(frozen=True)
class Audio:
    """An audio stream's next PCM (an AudioChunk of D's): 16-bit LE mono of its frames
    `first_frame` .. first_frame + frames - 1; `last`: the stream's PCM is complete."""

    pcm: bytes
    first_frame: int
    frames: int
    last: bool


StreamEvent = Frames | StreamFailure | Audio


class StreamStartError(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.request_id: int | None = None  # set once the stream had an id


class ClientGone(Exception):
    """The client disconnected before its stream's first event (its stream was cancelled)."""


def hex_id(request_id: int) -> str:
    """A request id as the API shows it: 16 hex digits."""
    return f"{request_id:016x}"


@dataclass
class Stream:
    request_id: int
    stamps: dict[str, int]
    client_request_id: str = ""
    queue: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    frames_out: int = 0
    ended: bool = False  # D finished it or it failed: nothing more will be queued
    frame_out_ns: list[int] = field(default_factory=list)  # one entry per write: (time, frames)
    frame_out_counts: list[int] = field(default_factory=list)
    decode: int | None = None  # index of the D whose subscription delivered it (None: not yet)
    prefill_tokens: int = 0  # rows P computed (from SubmitReply)
    cached_tokens: int = 0  # rows P served from its prefix cache
    writing: bool = False  # its response is being written: frame_timeout_ms applies
    last_event: float = 0.0  # monotonic time of the last event queued (or of the write's start)
    audio: bool = False  # a speech stream: it ends with its last AudioChunk, not its last frame
    span: Span | None = None  # its trace span (engine/tracing.py), None when tracing is off

    @property
    def hex_id(self) -> str:
        return hex_id(self.request_id)

    def push(self, event: StreamEvent) -> None:
        if self.ended:
            return
        if isinstance(event, StreamFailure):
            self.ended = True
        elif isinstance(event, Audio):
            if not self.audio:
                return  # PCM nobody asked for: a frames stream never sees it
            self.ended = event.last
        elif event.finished and not self.audio:
            self.ended = True
        self.last_event = time.monotonic()
        self.queue.put_nowait(event)

    def silent_for(self, now: float) -> float:
        """Seconds since its last event while its response is being written (0 otherwise)."""
        return now - self.last_event if self.writing and not self.ended else 0.0

    def drain_ready(self) -> list[StreamEvent]:
        """Everything queued now, without waiting: lets a slow client catch up in one write."""
        out = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except asyncio.QueueEmpty:
                return out


class StreamTable:
    def __init__(self, metrics: LBMetrics, n_codebooks: Callable[[], int | None]) -> None:
        self._streams: dict[int, Stream] = {}
        self._metrics = metrics
        self._n_codebooks = n_codebooks
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[Stream]:
        return iter(list(self._streams.values()))

    def ids(self) -> list[int]:
        return list(self._streams)

    def open(
        self, request_id: int, stamps: dict[str, int], client_request_id: str = "", audio: bool = False
    ) -> Stream:
        if request_id in self._streams:
            raise KeyError(f"request id {request_id:016x} is already streaming")
        stream = Stream(request_id, stamps, client_request_id, audio=audio)
        self._streams[request_id] = stream
        self._empty.clear()
        self._metrics.streams_in_flight.set(len(self._streams))
        return stream

    def close(self, request_id: int) -> Stream | None:
        """Remove a stream; None when it was not (or no longer) in the table."""
        stream = self._streams.pop(request_id, None)
        self._metrics.streams_in_flight.set(len(self._streams))
        if not self._streams:
            self._empty.set()
        return stream

    async def wait_empty(self, timeout: float) -> bool:
        if self._empty.is_set():  # wait_for(..., 0) times out even on a set event
            return True
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def fail_all(self, code: str, message: str, decode: int | None = None) -> int:
        """Fail every stream (of D `decode` and of no known D yet, when given)."""
        failed = 0
        for stream in self:
            if decode is not None and stream.decode not in (None, decode):
                continue
            if not stream.ended:
                stream.push(StreamFailure(code, message))
                failed += 1
        return failed

    def dispatch(self, msg: pb.StepFrames, decode: int = 0) -> None:
        """Route one decode step's frames, errors and stamps (from D `decode`) to their streams."""
        ids = view(msg.request_ids, "u8")
        n = ids.size
        for rid, stamps in msg.stamps.items():
            stream = self._streams.get(rid)
            if stream is not None:
                stream.decode = decode
                stream.stamps.update(stamps.ns)
        if n:
            ncb = self._n_codebooks()
            if ncb is None or len(msg.frames) != n * ncb * 4 or len(msg.finished) != n:
                # A malformed step is D's bug; the streams in it cannot be trusted.
                log.error(
                    "malformed StepFrames from D",
                    extra={
                        "step": msg.step,
                        "n": n,
                        "frames_bytes": len(msg.frames),
                        "finished_bytes": len(msg.finished),
                        "n_codebooks": ncb,
                    },
                )
                for rid in ids.tolist():
                    stream = self._streams.get(rid)
                    if stream is not None:
                        stream.push(
                            StreamFailure(
                                "decode_protocol_error",
                                f"D sent a malformed frames message at step {msg.step}",
                            )
                        )
            else:
                rows = view(msg.frames, "i4", ncb).tolist()
                finished = msg.finished
                unknown = 0
                for j, rid in enumerate(ids.tolist()):
                    stream = self._streams.get(rid)
                    if stream is None:
                        unknown += 1
                        continue
                    stream.decode = decode
                    stream.push(Frames([rows[j]], FINISHED_NAMES.get(finished[j], "")))
                if unknown:
                    self._metrics.unknown_frames.inc(unknown)
        for chunk in msg.audio:  # after the frames: a last chunk comes with or after its last frame
            stream = self._streams.get(chunk.request_id)
            if stream is not None:
                stream.push(Audio(chunk.pcm, chunk.first_frame, chunk.frames, chunk.last))
        for err in msg.errors:
            stream = self._streams.get(err.request_id)
            if stream is not None:
                stream.decode = decode
                code = (
                    pb.Status.Name(err.status).lower()
                    if err.status in pb.Status.values()
                    else "internal"
                )
                stream.push(StreamFailure(code, err.message or f"decode ended the stream: {code}"))


class FrameSubscription:
    """One `Decode.Frames` call at a time; reconnects with backoff; fails streams on a break."""

    def __init__(
        self,
        table: StreamTable,
        channel: grpc.aio.Channel,
        subscriber: str,
        metrics: LBMetrics,
        backoff_s: tuple[float, float] = (0.05, 0.5),
        assume_live_s: float = 0.3,
        index: int = 0,
        name: str = "D",
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """`index`/`name`: which D of the unit (1P2D); `on_change` replaces setting the
        subscription_up gauge from this one subscription (with several, the LB sets it).
        `backoff_s`: first and longest pause between tries; a D that starts or restarts is
        subscribed to within the longest of serving (a try on a unix socket is cheap)."""
        self._table = table
        self._channel = channel
        self._assume_live_s = assume_live_s
        self._stub = pbg.DecodeStub(channel)
        self._subscriber = subscriber
        self._metrics = metrics
        self._backoff = backoff_s
        self.index = index
        self.name = name
        self._on_change = on_change
        self.up = False
        self.last_error = "not connected yet"
        self.connects = 0

    async def run(self) -> None:
        delay = self._backoff[0]
        while True:
            call = self._stub.Frames(pb.FramesRequest(subscriber=self._subscriber))
            try:
                await self._until_accepted(call)
                self._set_up(True)
                delay = self._backoff[0]
                self.connects += 1
                log.info("frames subscription live", extra={"connects": self.connects, "decode": self.name})
                async for msg in call:
                    self._table.dispatch(msg, self.index)
                reason = f"{self.name} ended the frames subscription"
            except asyncio.CancelledError:
                call.cancel()
                self._set_up(False)
                raise
            except grpc.aio.AioRpcError as exc:
                reason = f"frames subscription to {self.name} failed: {exc.code().name}: {exc.details()}"
            except _CallEnded as exc:
                reason = str(exc)
            except Exception as exc:  # noqa: BLE001 - a message the LB cannot read ends the call
                call.cancel()
                reason = f"unreadable frames message from {self.name}: {exc!r}"
                log.exception("unreadable frames message from D")
            was_up = self.up
            self._set_up(False)
            self.last_error = reason
            # Any stream in the table may have lost frames: fail it now, loudly.
            failed = self._table.fail_all("decode_unavailable", reason, decode=self.index)
            if was_up:
                self._metrics.subscription_breaks.inc()
                log.warning(
                    "frames subscription broke",
                    extra={"reason": reason, "streams_failed": failed, "decode": self.name},
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._backoff[1])

    async def _until_accepted(self, call: grpc.aio.UnaryStreamCall) -> None:
        """Return once D runs the call; raise if it failed.

        Exact when D sends initial metadata (or a first message). A D that sends nothing
        until its first step is taken as live once the call is still open on a READY
        channel after `assume_live_s`: a refused or unknown call fails faster than that
        on a unix socket.
        """
        metadata = asyncio.ensure_future(call.initial_metadata())
        metadata.add_done_callback(_retrieve)
        done, _ = await asyncio.wait({metadata}, timeout=self._assume_live_s)
        if not done and self._channel.get_state() != grpc.ChannelConnectivity.READY:
            await asyncio.wait({metadata})
        if call.done():
            code = await call.code()
            details = await call.details()
            raise _CallEnded(f"frames subscription to {self.name} failed: {code.name}: {details}")

    def _set_up(self, up: bool) -> None:
        self.up = up
        if self._on_change is not None:
            self._on_change()
        else:
            self._metrics.subscription_up.set(1 if up else 0)


class _CallEnded(Exception):
    pass


def _retrieve(fut: asyncio.Future[object]) -> None:
    # The call's own error is reported through the call; do not log it twice.
    if not fut.cancelled():
        fut.exception()
