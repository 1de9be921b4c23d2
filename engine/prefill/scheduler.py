"""What P runs next: its admission queue (FIFO, accepts while a forward runs) and the
batching decision of a forward (`joins_batch`: prompt count and rows), which
handoff.OpenBatch applies as P's reserve stage fills the next forward's batch. The
monolith takes its prompts from the same queue. Thread-safe; owns no compute and
never reorders: a prompt is never overtaken by a later one.
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
    audio: bool = False           # the stream wants PCM (SubmitRequest.audio): D's codec decodes it
    span: Any = None              # its trace span (engine/tracing.Span): RESERVE carries its context to D


def joins_batch(prompts: int, rows: int, next_rows: int, max_prompts: int, max_rows: int) -> bool:
    """Whether the next prompt (`next_rows` rows) joins a forward's batch that holds
    `prompts` prompts of `rows` rows in all. A prompt alone always makes a batch, even
    one over `max_rows`."""
    return prompts == 0 or (prompts < max_prompts and rows + next_rows <= max_rows)


class PrefillScheduler:
    """The admission queue, and the bounds (`max_batch_prompts`, `max_batch_rows`) that
    P's forwards keep to through `joins_batch`."""

    def __init__(self, max_batch_prompts: int, max_batch_rows: int) -> None:
        if max_batch_prompts < 1 or max_batch_rows < 1:
            raise ValueError(f"max_batch_prompts and max_batch_rows must be >= 1 "
                             f"(got {max_batch_prompts}, {max_batch_rows})")
        self.max_batch_prompts = max_batch_prompts
        self.max_batch_rows = max_batch_rows
        self._queue: deque[PrefillJob] = deque()
        self._cv = threading.Condition()

    def put(self, job: PrefillJob) -> None:
        with self._cv:
            self._queue.append(job)
            self._cv.notify()

    def put_back(self, job: PrefillJob) -> None:
        """Returns a job taken by `take` to the head of the queue (the monolith: its
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

    def take(self, timeout: float) -> PrefillJob | None:
        """The oldest queued job, waiting up to `timeout` seconds for one; None if none."""
        with self._cv:
            if not self._queue:
                self._cv.wait(timeout)
            return self._queue.popleft() if self._queue else None

    def __len__(self) -> int:
        with self._cv:
            return len(self._queue)

    def request_ids(self) -> list[int]:
        with self._cv:
            return [j.request_id for j in self._queue]
