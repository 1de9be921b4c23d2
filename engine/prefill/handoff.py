"""Handoffs between the stages of P's pipeline (engine/prefill/pipeline.py).

- `OpenBatch` (reserve -> forward): the next forward's batch, growing one reserved
  request at a time (as scheduler.joins_batch decides) until the forward takes it whole.
- `Handoff` (forward -> transfer workers): a bounded FIFO of requests; the producer
  waits for room for a whole batch before it starts a forward it could not hand over.

Own no compute and decide nothing about batching themselves. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from pdunit.engine.prefill.scheduler import joins_batch

T = TypeVar("T")

_STOP_CHECK_S = 0.05  # setting `stopping` notifies no one: it is looked at this often


def _wait(cv: threading.Condition, ready: Callable[[], bool], timeout: float, stopping: threading.Event) -> bool:
    """With `cv` held: True once `ready()`; False after `timeout` or once stopping."""
    deadline = time.monotonic() + timeout
    while not stopping.is_set():
        if ready():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        cv.wait(min(left, _STOP_CHECK_S))
    return False


class Handoff(Generic[T]):
    """Bounded FIFO: `wait_for_room(n)`, then `put` of those n items, never exceeds
    `capacity` (except a group larger than `capacity`, accepted into an empty handoff).
    One producer; any number of consumers."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._cv = threading.Condition()

    def wait_for_room(self, n: int, timeout: float, stopping: threading.Event) -> bool:
        """True once `n` more items fit; False after `timeout` seconds or when stopping."""
        with self._cv:
            return _wait(self._cv, lambda: not self._items or len(self._items) + n <= self.capacity, timeout,
                         stopping)

    def put(self, item: T) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()

    def get(self, timeout: float) -> T | None:
        """The oldest item, waiting up to `timeout` seconds; None if there is none."""
        with self._cv:
            if not self._cv.wait_for(lambda: bool(self._items), timeout):
                return None
            item = self._items.popleft()
            self._cv.notify_all()
            return item

    def take_all(self) -> list[T]:
        with self._cv:
            items = list(self._items)
            self._items.clear()
            self._cv.notify_all()
            return items


class OpenBatch(Generic[T]):
    """The batch the next forward will take, filled one reserved request at a time while
    the current forward runs: every request reserved before the forward stage comes back
    goes into its next forward (not one forward later), up to the batch bounds.

    One producer (`wait_for_room`, then `add`), one consumer (`take`). Thread-safe.
    """

    def __init__(self, max_items: int, max_rows: int) -> None:
        if max_items < 1 or max_rows < 1:
            raise ValueError(f"max_items and max_rows must be >= 1 (got {max_items}, {max_rows})")
        self.max_items, self.max_rows = max_items, max_rows
        self._items: list[T] = []
        self._rows = 0
        self._cv = threading.Condition()

    def _fits(self, rows: int) -> bool:
        return joins_batch(len(self._items), self._rows, rows, self.max_items, self.max_rows)

    def wait_for_room(self, rows: int, timeout: float, stopping: threading.Event) -> bool:
        """True once an item of `rows` rows fits; False after `timeout` or when stopping."""
        with self._cv:
            return _wait(self._cv, lambda: self._fits(rows), timeout, stopping)

    def add(self, item: T, rows: int) -> None:
        with self._cv:
            self._items.append(item)
            self._rows += rows
            self._cv.notify_all()

    def add_fitting(self, items: list[tuple[T, int]]) -> int:
        """Adds (item, rows) pairs in order while each fits, in one step (a consumer
        waking on the first sees them all: a group reserved together goes into one
        forward); returns how many were added."""
        with self._cv:
            n = 0
            for item, rows in items:
                if not self._fits(rows):
                    break
                self._items.append(item)
                self._rows += rows
                n += 1
            if n:
                self._cv.notify_all()
            return n

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)

    def take(self, timeout: float) -> list[T]:
        """Every item added so far (waiting up to `timeout` for the first); [] if none."""
        with self._cv:
            if not self._cv.wait_for(lambda: bool(self._items), timeout):
                return []
            items, self._items, self._rows = self._items, [], 0
            self._cv.notify_all()
            return items
