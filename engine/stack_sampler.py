"""Where each thread of an engine spends its time: every thread's Python stack sampled at
a fixed rate, written at stop as folded stacks (one line per distinct stack,
`thread;outermost;...;innermost count`, the input of flamegraph.pl and speedscope).

Why in-process: py-spy needs ptrace, which a pod (and the GPU machines' containers)
rarely grants. What it sees: the Python frame each thread is in, including the C call
it is blocked in (a lock, a CUDA sync, an RPC) as that call's Python caller; a thread
waiting for the GIL shows where it stopped. It costs its own thread about 1% of a core
at 200 Hz. Never started unless asked (`--sample-stacks PATH`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

from pydantic import BaseModel, Field


class StackSamplingFields(BaseModel):
    """The flags of every engine (P, D, the monolith)."""

    sample_stacks: str = Field("", description="sample every thread's Python stack and write them, folded (for a "
                               "flame graph), to this file when the process stops ('' = off)")
    sample_hz: float = Field(200.0, gt=0, le=2000, description="--sample-stacks: samples per second")


def _frames(frame: FrameType | None) -> list[str]:
    out = []
    while frame is not None:
        code = frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    out.reverse()
    return out


class StackSampler:
    def __init__(self, path: str | Path, hz: float = 200.0) -> None:
        if hz <= 0:
            raise ValueError(f"hz must be > 0 (got {hz})")
        self.path = Path(path)
        self.interval = 1.0 / hz
        self.stacks: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._started = 0.0
        self.seconds = 0.0  # sampled for, once stopped

    def start(self) -> StackSampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        own = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != own:
                    name = names.get(ident, f"thread-{ident}").replace(";", ",")
                    self.stacks[";".join([name, *_frames(frame)])] += 1
            self.samples += 1

    def stop(self) -> dict[str, int]:
        """Stops sampling, writes the file; returns the samples per thread."""
        self._stop.set()
        self._thread.join()
        self.seconds = time.monotonic() - self._started
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as f:
            for stack, count in self.stacks.most_common():
                f.write(f"{stack} {count}\n")
        per_thread: Counter[str] = Counter()
        for stack, count in self.stacks.items():
            per_thread[stack.split(";", 1)[0]] += count
        return dict(per_thread)


def start_sampler(fields: StackSamplingFields, log: logging.Logger) -> StackSampler | None:
    """An engine's sampler when its config asks for one, started."""
    if not fields.sample_stacks:
        return None
    log.info("sampling stacks", extra={"path": fields.sample_stacks, "hz": fields.sample_hz})
    return StackSampler(fields.sample_stacks, fields.sample_hz).start()


def stop_sampler(sampler: StackSampler | None, log: logging.Logger) -> None:
    if sampler is not None:
        per_thread = sampler.stop()
        log.info("stack samples written", extra={"path": str(sampler.path), "samples": sampler.samples,
                                                  "seconds": round(sampler.seconds, 1),
                                                  "per_thread": per_thread})
