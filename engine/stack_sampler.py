"""Where each thread of an engine spends its time: every thread's Python stack sampled at
a fixed rate, written at stop as folded stacks (one line per distinct stack,
`thread;outermost;...;innermost count`, the input of flamegraph.pl and speedscope).

Why in-process: py-spy needs ptrace, which a pod rarely grants. What it sees: the Python
frame each thread is in, a blocked C call as its Python caller. It never walks another
thread's frame objects from Python (CPython 3.11 can crash there: the GIL switches between
bytecodes while that thread pops the frames): faulthandler writes every thread's stack in
one C call that holds the GIL (100 frames and 100 threads at most). Never started unless
asked (`--sample-stacks PATH`).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path

from pydantic import BaseModel, Field


class StackSamplingFields(BaseModel):
    """The flags of every engine (P, D, the monolith)."""

    sample_stacks: str = Field("", description="sample every thread's Python stack and write them, folded (for a "
                               "flame graph), to this file when the process stops ('' = off)")
    sample_hz: float = Field(50.0, gt=0, le=2000, description="--sample-stacks: samples per second")


_THREAD = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-f]+) ")
_FRAME = re.compile(r'^  File "(.*)", line (?:\d+|\?\?\?) in (.*)$')


def parse_dump(text: str) -> dict[int, list[str]]:
    """faulthandler's all-threads dump as {thread ident: [file:function, outermost first]}."""
    stacks: dict[int, list[str]] = {}
    frames: list[str] | None = None
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            frames = stacks.setdefault(int(head[1], 16), [])
            continue
        frame = _FRAME.match(line)
        if frame and frames is not None:
            frames.append(f"{os.path.basename(frame[1])}:{frame[2]}")
    for frames in stacks.values():
        frames.reverse()
    return stacks


def all_stacks(fd: int) -> dict[int, list[str]]:
    """Every thread's stack now, through `fd` (a file faulthandler writes into)."""
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    faulthandler.dump_traceback(fd, all_threads=True)
    size = os.lseek(fd, 0, os.SEEK_CUR)
    return parse_dump(os.pread(fd, size, 0).decode(errors="replace"))


class StackSampler:
    def __init__(self, path: str | Path, hz: float = 50.0) -> None:
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
        dump = os.memfd_create("stack-sampler")  # a file in memory, rewritten every sample
        try:
            while not self._stop.wait(self.interval):
                names = {t.ident: t.name for t in threading.enumerate()}
                for ident, frames in all_stacks(dump).items():
                    if ident != own:
                        name = names.get(ident, f"thread-{ident}").replace(";", ",")
                        self.stacks[";".join([name, *frames])] += 1
                self.samples += 1
        finally:
            os.close(dump)

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
