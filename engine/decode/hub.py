"""Fan-out of step messages from the step-loop thread to every Frames subscriber (LB).

Thread-safe publish into asyncio queues of the server's loop. A subscriber that falls
behind by more than `max_queue` messages is dropped (its LB reconnects and fails the
affected streams loudly) rather than letting D's memory grow without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from pdunit.engine.proto import pdunit_pb2 as pb

log = logging.getLogger("pdunit.decode.hub")


class FrameHub:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_queue: int = 10_000) -> None:
        self.loop = loop
        self.max_queue = max_queue
        self._subscribers: set[asyncio.Queue[pb.StepFrames | None]] = set()

    def publish(self, message: pb.StepFrames) -> None:
        """Callable from any thread."""
        self.loop.call_soon_threadsafe(self._fan_out, message)

    def publish_error(self, request_id: int, status: int, message: str) -> None:
        self.publish(pb.StepFrames(errors=[pb.StreamError(request_id=request_id, status=status, message=message)]))

    def _fan_out(self, message: pb.StepFrames) -> None:
        for queue in list(self._subscribers):
            if queue.qsize() >= self.max_queue:
                log.error("frames subscriber too slow: dropping it", extra={"queued": queue.qsize()})
                self._subscribers.discard(queue)
                queue.put_nowait(None)
                continue
            queue.put_nowait(message)

    def subscribe(self) -> AsyncIterator[pb.StepFrames]:
        """Registers a subscriber NOW (every later message reaches it) and returns its
        iterator, so the caller can confirm the subscription before the first message."""
        queue: asyncio.Queue[pb.StepFrames | None] = asyncio.Queue()
        self._subscribers.add(queue)

        async def messages() -> AsyncIterator[pb.StepFrames]:
            try:
                while True:
                    item = await queue.get()
                    if item is None:
                        return
                    yield item
            finally:
                self._subscribers.discard(queue)

        return messages()

    def close(self) -> None:
        for queue in list(self._subscribers):
            queue.put_nowait(None)
        self._subscribers.clear()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)
