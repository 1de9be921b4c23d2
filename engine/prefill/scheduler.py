"""P's admission queue: accepts prompts while a forward runs and hands them out in FIFO
order, bounded by prompt count and rows (P's reserve stage takes one at a time and
builds the forward's batch in engine/prefill/handoff.OpenBatch). Thread-safe; owns no
compute.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdunit.engine.model.sampling import SamplingParams


@dataclass
class PrefillJob:
    request_id: int
    prompt: np.ndarray            # int64 [rows, C]
    params: SamplingParams
    deadline_unix_ms: int
    stamps: dict[str, int]
    done: Any = None              # callable(reply) resolving the Submit RPC
    cancelled: bool = False
    result: Any = field(default=None, repr=False)
    # the prompt's prefix-cache hash chain when taken at submit (the monolith: off its
    # loop thread); None: PrefixCache.acquire hashes it
    prefix_chain: list[bytes] | None = field(default=None, repr=False)


class PrefillScheduler:
    def __init__(self, max_batch_prompts: int, max_batch_rows: int) -> None:
        self.max_batch_prompts = max_batch_prompts
        self.max_batch_rows = max_batch_rows
        self._queue: deque[PrefillJob] = deque()
        self._cv = threading.Condition()

    def put(self, job: PrefillJob) -> None:
        with self._cv:
            self._queue.append(job)
            self._cv.notify()

    def put_back(self, job: PrefillJob) -> None:
        """Returns a job taken by `next_batch` to the head of the queue (the monolith: its
        prefix-cache slots are all pinned by prompts in flight for now)."""
        with self._cv:
            self._queue.appendleft(job)

    def cancel(self, request_id: int) -> PrefillJob | None:
        """Removes a queued job; returns it (None when not queued)."""
        with self._cv:
            for job in self._queue:
                if job.request_id == request_id:
                    self._queue.remove(job)
                    job.cancelled = True
                    return job
        return None

    def next_batch(self, timeout: float, max_prompts: int | None = None) -> list[PrefillJob]:
        """FIFO; at least one job even when it alone exceeds the row budget. `max_prompts`
        lowers the prompt bound (P's reserve stage takes one at a time)."""
        limit = min(self.max_batch_prompts, max_prompts or self.max_batch_prompts)
        with self._cv:
            if not self._queue:
                self._cv.wait(timeout)
            batch: list[PrefillJob] = []
            rows = 0
            while self._queue and len(batch) < limit:
                nxt = len(self._queue[0].prompt)
                if batch and rows + nxt > self.max_batch_rows:
                    break
                batch.append(self._queue.popleft())
                rows += nxt
            return batch

    def __len__(self) -> int:
        with self._cv:
            return len(self._queue)

    def request_ids(self) -> list[int]:
        with self._cv:
            return [j.request_id for j in self._queue]
