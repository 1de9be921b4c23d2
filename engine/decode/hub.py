"""Fan-out of step messages from the step-loop thread to every Frames subscriber (LB).

Thread-safe publish into asyncio queues of the server's loop. A subscriber that falls
behind by more than `max_queue` messages is dropped (its LB reconnects and fails the
affected streams loudly) rather than letting D's memory grow without bound. A stream
nobody can receive any more is handed to the engine to end (orphans, on `FrameHub`).

The hub never ends a stream itself and never decides anything about pages.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable

from prometheus_client import Counter as PromCounter

from pdunit.engine.metrics import role_metric
from pdunit.engine.packing import view
from pdunit.engine.proto import pdunit_pb2 as pb

log = logging.getLogger("pdunit.decode.hub")

ORPHANED_STREAMS = role_metric(PromCounter(
    "pdunit_decode_orphaned_streams_total",
    "Streams ended because no frames subscriber that could receive them stayed connected", registry=None),
    "decode", "monolith")


# Orphans (with `end_orphans_with`): a stream belongs to the subscribers (by their
# `FramesRequest.subscriber` name) that were connected when its first frame went out.
# When none of them is connected any more for `orphan_grace_s`, nobody can receive its
# frames (the LB fails every stream of a subscription that breaks; an LB restarted under
# a new name never knew them), so the hub hands it to the engine to end, counted and
# logged: no stream decodes to max frames for nobody. A subscriber of the same name
# connected again within the grace keeps its streams.
class FrameHub:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_queue: int = 10_000, orphan_grace_s: float = 2.0) -> None:
        self.loop = loop
        self.max_queue = max_queue
        self.orphan_grace_s = orphan_grace_s
        self._subscribers: set[asyncio.Queue[pb.StepFrames | None]] = set()
        self._names: Counter[str] = Counter()  # connected subscribers by name
        self._current: frozenset[str] = frozenset()  # the names connected now (owners of a new stream)
        # Set by end_orphans_with; None: streams are not tracked (nothing would end them).
        self._end: Callable[[list[int]], int] | None = None
        self._live: Callable[[], list[int]] | None = None
        self._owners: dict[int, frozenset[str]] = {}  # running stream -> subscribers at its first frame
        self._orphaned: dict[int, float] = {}  # stream -> loop.time() since no owner is connected
        self._reap_handle: asyncio.TimerHandle | None = None
        self._not_live: set[int] = set()  # tracked but not running at the last prune
        self._prune_above = 64  # entries in `_owners` that start the next prune
        self._closed = False

    def end_orphans_with(self, end: Callable[[list[int]], int], live: Callable[[], list[int]]) -> None:
        """Tracks which subscribers own each stream from now on. `end(request_ids)` ends
        streams nobody can receive and returns how many it ended; `live()` lists the
        streams still running (streams cancelled without a last frame are forgotten by
        it). Both are called on the hub's loop."""
        self._end, self._live = end, live

    def publish(self, message: pb.StepFrames) -> None:
        """Callable from any thread."""
        self.loop.call_soon_threadsafe(self._fan_out, message)

    def publish_error(self, request_id: int, status: pb.Status, message: str) -> None:
        self.publish(pb.StepFrames(errors=[pb.StreamError(request_id=request_id, status=status, message=message)]))

    def _fan_out(self, message: pb.StepFrames) -> None:
        if self._end is not None:
            self._track(message)
        for queue in list(self._subscribers):
            if queue.qsize() >= self.max_queue:
                log.error("frames subscriber too slow: dropping it", extra={"queued": queue.qsize()})
                self._subscribers.discard(queue)
                queue.put_nowait(None)
                continue
            queue.put_nowait(message)

    def subscribe(self, subscriber: str = "") -> AsyncIterator[pb.StepFrames]:
        """Registers a subscriber NOW (every later message reaches it) and returns its
        iterator, so the caller can confirm the subscription before the first message.
        `subscriber` is its name (FramesRequest.subscriber): streams whose first frame it
        saw are its own, and a subscriber of the same name takes them over."""
        queue: asyncio.Queue[pb.StepFrames | None] = asyncio.Queue()
        self._subscribers.add(queue)
        self._names[subscriber] += 1
        self._current = frozenset(self._names)

        async def messages() -> AsyncIterator[pb.StepFrames]:
            try:
                while True:
                    item = await queue.get()
                    if item is None:
                        return
                    yield item
            finally:
                self._subscribers.discard(queue)
                self._gone(subscriber)

        return messages()

    def close(self) -> None:
        self._closed = True
        if self._reap_handle is not None:
            self._reap_handle.cancel()
        for queue in list(self._subscribers):
            queue.put_nowait(None)
        self._subscribers.clear()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    # ------------------------------------------------------------------ orphans
    def _track(self, message: pb.StepFrames) -> None:
        """Owners of streams whose first frame is in `message`; forgets ended ones."""
        for err in message.errors:
            self._forget(err.request_id)
        if not message.request_ids:
            return
        ids = view(message.request_ids, "u8")
        finished = view(message.finished, "u1")
        if finished.size != ids.size:
            return  # malformed: the LB fails these streams itself
        for rid in ids[finished != 0].tolist():
            self._forget(rid)
        born = [rid for rid in ids[finished == 0].tolist() if rid not in self._owners]
        if not born:
            return
        owners = self._current
        for rid in born:
            self._owners[rid] = owners
        if not owners & self._names.keys():
            now = self.loop.time()
            for rid in born:  # its first frame reached nobody
                self._orphaned[rid] = now
            self._schedule_reap()
        if len(self._owners) > self._prune_above:
            self._prune()

    def _forget(self, request_id: int) -> None:
        self._owners.pop(request_id, None)
        self._orphaned.pop(request_id, None)

    def _prune(self) -> None:
        """Drops streams that are gone without a last frame (cancelled), once seen not
        running at two prunes in a row (a stream is published before it is admitted)."""
        assert self._live is not None
        live = set(self._live())
        not_live = {rid for rid in self._owners if rid not in live}
        for rid in not_live & self._not_live:
            self._forget(rid)
        self._not_live = not_live - self._not_live
        # The next prune after as many new streams as are running (64 at least): each
        # costs time in proportion to the streams it drops or keeps.
        self._prune_above = len(self._owners) + max(64, len(self._owners) - len(self._not_live))

    def _gone(self, subscriber: str) -> None:
        self._names[subscriber] -= 1
        if self._names[subscriber] <= 0:
            del self._names[subscriber]
        self._current = frozenset(self._names)
        if self._end is None or self._closed or subscriber in self._names:
            return
        now = self.loop.time()
        connected = self._names.keys()
        for rid, owners in self._owners.items():
            if rid not in self._orphaned and not owners & connected:
                self._orphaned[rid] = now
        if self._orphaned:
            log.warning("frames subscriber gone: its streams end unless it comes back", extra={
                "subscriber": subscriber, "streams": len(self._orphaned), "grace_s": self.orphan_grace_s})
            self._schedule_reap()

    def _schedule_reap(self) -> None:
        if self._reap_handle is None and not self._closed:
            self._reap_handle = self.loop.call_later(self.orphan_grace_s, self._reap)

    def _reap(self) -> None:
        self._reap_handle = None
        assert self._end is not None
        now = self.loop.time()
        connected = self._names.keys()
        due, later = [], False
        for rid, since in list(self._orphaned.items()):
            owners = self._owners.get(rid)
            if owners is None or owners & connected:  # ended meanwhile, or taken over
                del self._orphaned[rid]
            elif now - since >= self.orphan_grace_s - 0.001:
                due.append(rid)
                self._forget(rid)
            else:
                later = True
        if due:
            ended = self._end(due)
            ORPHANED_STREAMS.inc(ended)
            log.warning("streams ended: no frames subscriber can receive them", extra={
                "streams": ended, "request_ids": [f"{rid:016x}" for rid in due[:32]],
                "grace_s": self.orphan_grace_s})
        if later:
            self._schedule_reap()
