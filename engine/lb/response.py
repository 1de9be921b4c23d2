"""The 200 response of one stream: frames as they come (NDJSON or binary), then the trailer.

Owns the wire form of a stream's body (docs/api.md): a JSON line per frame or little-endian
int32 rows, and one final record (`done` with frames, ids, token counts and the stage
stamps, or `error`), the stamps of the first and last frame out, and the watch for a
client that disconnects. Must never decide a status code (the headers went out before
the first frame) and always ends the stream in the LB (`LoadBalancer.finish`), however
the write ends: a stream left in the table would keep /v1/load from reporting empty.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdunit.engine.lb.streams import Frames, Stream, StreamEvent, StreamFailure
from pdunit.engine.observability import now_ns
from pdunit.engine.packing import pack

if TYPE_CHECKING:
    from pdunit.engine.lb.metrics import LBMetrics

NDJSON = "application/x-ndjson"
BINARY_FRAMES = "application/x-pdunit-frames"
TRAILER_MARKER = b"\xff\xff\xff\xff"  # an int32 of -1: never a valid id, so never a frame


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class StreamEnd(Protocol):
    """What a response reads of the LB (balancer.py's LoadBalancer): its metrics and
    `finish`; this module needs nothing of balancer.py, not even for its types."""

    @property
    def metrics(self) -> LBMetrics: ...

    def finish(self, stream: Stream, outcome: str, status: int) -> None: ...


class StreamResponse(Response):
    """A 200 whose chunked body a subclass's `_write` sends while the stream runs; a client
    that goes away cancels the write. Always ends the stream in the LB (`outcome`: what
    `_write` reached; "disconnected" unless it says otherwise)."""

    lb: StreamEnd
    stream: Stream
    outcome: str

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    await wait_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                await self._write(send)
                tg.cancel_scope.cancel()
        finally:
            self.lb.finish(self.stream, self.outcome, 200)

    async def _write(self, send: Send) -> None:
        raise NotImplementedError


class FrameStreamResponse(StreamResponse):
    """200 + frames as they come, then the final record; always ends the stream in the LB."""

    def __init__(
        self,
        lb: StreamEnd,
        stream: Stream,
        first: list[StreamEvent],
        binary: bool,
        headers: dict[str, str],
    ) -> None:
        # Not Response.__init__: it would set Content-Length: 0; this body is chunked.
        self.status_code = 200
        self.media_type = BINARY_FRAMES if binary else NDJSON
        self.background = None
        self.init_headers(headers)
        self.lb = lb
        self.stream = stream
        self.first = first
        self.binary = binary
        self.outcome = "disconnected"

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        events = self.first
        stream = self.stream
        stream.last_event, stream.writing = time.monotonic(), True  # the LB's frame watchdog starts here
        while True:
            chunk, terminal = self._encode(events)
            await send({"type": "http.response.body", "body": chunk, "more_body": not terminal})
            if terminal:
                return
            event = await stream.queue.get()  # a frame_timeout failure comes from the watchdog
            events = [event, *stream.drain_ready()]

    def _encode(self, events: list[StreamEvent]) -> tuple[bytes, bool]:
        stream = self.stream
        out: list[bytes] = []
        frames = 0
        trailer: dict[str, Any] | None = None
        for event in events:
            if isinstance(event, Frames):
                for row in event.rows:
                    if self.binary:
                        out.append(pack(row, "i4"))
                    else:
                        out.append(
                            b'{"i": %d, "frame": [%s]}\n'
                            % (stream.frames_out + frames, ", ".join(map(str, row)).encode())
                        )
                    frames += 1
                if event.finished:
                    self.outcome = event.finished
                    trailer = {"done": True, "reason": event.finished}
                    break
            elif isinstance(event, StreamFailure):
                self.outcome = event.code
                trailer = {"error": {"code": event.code, "message": event.message}}
                break
        now = now_ns()
        if frames:
            stream.stamps.setdefault("lb_first_frame_out", now)
            stream.stamps["lb_last_frame_out"] = now
            stream.frame_out_ns.append(now)
            stream.frame_out_counts.append(frames)
        stream.frames_out += frames
        if frames:
            self.lb.metrics.frames.inc(frames)
        if trailer is None:
            return b"".join(out), False
        if "done" in trailer:
            trailer["frames"] = stream.frames_out
            trailer["request_id"] = stream.hex_id
            trailer["prefill_tokens"] = stream.prefill_tokens
            trailer["cached_tokens"] = stream.cached_tokens
            trailer["stages"] = dict(sorted(stream.stamps.items(), key=lambda kv: kv[1]))
        text = json.dumps(trailer).encode()
        out.append(TRAILER_MARKER + text if self.binary else text + b"\n")
        return b"".join(out), True


