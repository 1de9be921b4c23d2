"""A bounded handoff between two stages of P's pipeline (engine/prefill/worker.py): the
producer waits for room before it starts work it could not hand over, so at most
`capacity` finished items ever wait, and the consumer takes them in order.

Owns no compute. One producer per handoff: `wait_for_room` then `put` never exceeds the
bound. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Handoff(Generic[T]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._cv = threading.Condition()

    def wait_for_room(self, timeout: float, stopping: threading.Event) -> bool:
        """True once there is room; False after `timeout` seconds or when stopping."""
        with self._cv:
            return self._cv.wait_for(lambda: len(self._items) < self.capacity or stopping.is_set(),
                                     timeout) and not stopping.is_set()

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

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)
