"""Continuous batching of decoding streams over one paged pool (D and the monolith).

Owns the running streams: which frame each emitted last, where its next token's K/V
goes, when it ends (EOS or length). Every step covers every running stream, and its
result is one message with every stream's new frame. It never allocates or frees
transfer pages itself except `pool.finish` of its own finished/cancelled streams.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pdunit.engine import metrics as m
from pdunit.engine.batching import SeqEntry
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.model.transformer import TTSModel

RUNNING, FINISHED_EOS, FINISHED_LENGTH = 0, 1, 2


@dataclass
class Stream:
    request_id: int
    prompt_tokens: int
    params: SamplingParams
    last_frame: np.ndarray            # int32 [C]: the newest frame (the next step's input)
    frames_out: int = 0               # frames emitted so far (the first frame counts)
    stamps: dict[str, int] = field(default_factory=dict)
    first_out: bool = False           # its first frame already went out (D publishes it at COMMIT)
    admitted_at: float = 0.0          # perf_counter() at `DecodeBatcher.admit`
    audio: bool = False               # its frames are decoded to PCM (engine/audio/codec_stage.py)


@dataclass
class StepOutput:
    request_ids: np.ndarray           # uint64 [n]
    frames: np.ndarray                # int32 [n, C]
    finished: np.ndarray              # uint8 [n]
    started: list[Stream]             # streams whose first frame is in this step
    ended: list[Stream]               # streams that finished in this step


class DecodeBatcher:
    def __init__(self, model: TTSModel, pool: PagePool, storage: torch.Tensor, max_batch: int) -> None:
        self.model = model
        self.pool = pool
        self.storage = storage
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._incoming: list[Stream] = []
        self._joining: list[Stream] = []  # taken by `take_incoming`, not yet in `running` (see `joined`)
        self._cancelled: set[int] = set()
        self.running: dict[int, Stream] = {}

    # -- called from any thread -------------------------------------------------------
    def admit(self, stream: Stream) -> None:
        """The stream's pages are DECODING and hold its prompt KV; it joins the next step
        with room for it (`max_batch`)."""
        stream.admitted_at = time.perf_counter()
        with self._lock:
            self._incoming.append(stream)

    def cancel(self, request_id: int) -> bool:
        with self._lock:
            known = request_id in self.running or any(s.request_id == request_id for s in self._incoming)
            if known:
                self._cancelled.add(request_id)
            return known

    def request_ids(self) -> list[int]:
        with self._lock:
            return list(self.running) + [s.request_id for s in self._incoming]

    def held(self) -> list[Stream]:
        """Every stream it holds, running or waiting (one between take_incoming and
        `running` too)."""
        with self._lock:
            return list({s.request_id: s for s in [*self.running.values(), *self._joining, *self._incoming]}.values())

    def lifetimes(self, audio: bool = False) -> list[tuple[int, ...]]:
        """(context tokens now, frames still to come) of every stream it holds, running or
        waiting: what rate-floor admission projects (engine/decode/admission.py); with
        `audio`, whether each stream is decoded to audio as a third element."""
        streams = self.held()
        if audio:
            return [(s.prompt_tokens + s.frames_out, max(0, s.params.max_frames - s.frames_out), s.audio)
                    for s in streams]
        return [(s.prompt_tokens + s.frames_out, max(0, s.params.max_frames - s.frames_out)) for s in streams]

    def context_tokens(self) -> int:
        """Context tokens of the running streams (their next step attends over these)."""
        return sum(s.prompt_tokens + s.frames_out for s in list(self.running.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(self.running) + len(self._incoming)

    # -- called from the step loop only -----------------------------------------------
    def take_cancelled(self, free: bool = True) -> list[int]:
        """Drops cancelled streams; their pages return to the pool unless `free` is
        False (the overlap scheduler frees them once no queued step can write them)."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            incoming = [s for s in self._incoming if s.request_id not in cancelled]
            dropped = [s.request_id for s in self._incoming if s.request_id in cancelled]
            self._incoming = incoming
        for rid in cancelled:
            if self.running.pop(rid, None) is not None:
                dropped.append(rid)
        if free:
            for rid in dropped:
                self.pool.finish(rid)
        return dropped

    def take_incoming(self) -> list[Stream]:
        """The admitted streams the next step has room for, oldest first; each one's wait
        since `admit` goes to `pdunit_decode_admit_wait_seconds` (long waits: the batch
        was full)."""
        with self._lock:
            room = max(0, self.max_batch - len(self.running))
            new, self._incoming = self._incoming[:room], self._incoming[room:]
            self._joining = list(new)
        now = time.perf_counter()
        for s in new:
            m.D_ADMIT_WAIT_SECONDS.observe(now - s.admitted_at)
        return new

    def joined(self) -> None:
        """The streams `take_incoming` handed out are in `running` (or ended) now."""
        with self._lock:
            self._joining = []

    def decode_entries(self) -> tuple[list[Stream], list[SeqEntry]]:
        """One entry per running stream: its newest frame at the next position."""
        streams = list(self.running.values())
        entries = []
        for s in streams:
            pos = s.prompt_tokens + s.frames_out - 1
            entries.append(SeqEntry(
                tokens=s.last_frame.astype(np.int64)[None, :],
                positions=np.array([pos], dtype=np.int64),
                write_slots=np.array([self.pool.slot_of(s.request_id, pos)], dtype=np.int64),
                context_slots=self.pool.slots(s.request_id, pos + 1),
            ))
        return streams, entries

    def apply(self, streams: list[Stream], out: torch.Tensor | None, new: list[Stream]) -> StepOutput:
        """Makes the decoded streams' next frames (`TTSModel.frames`), emits the new streams' first frames,
        retires finished streams. `out` (the step's `TTSModel.forward` output) has one
        row per stream of `streams`."""
        ids: list[int] = []
        frames: list[np.ndarray] = []
        finished: list[int] = []
        ended: list[Stream] = []
        if streams:
            assert out is not None
            sampled = self.model.frames(out, [s.params for s in streams], [s.frames_out for s in streams])
            for s, frame in zip(streams, sampled, strict=True):
                s.last_frame = frame
                s.frames_out += 1
                ids.append(s.request_id)
                frames.append(frame)
                finished.append(self.finish_code(s, frame))
        for s in new:
            s.frames_out = 1
            self.running[s.request_id] = s
            if s.first_out:
                continue  # published at COMMIT, and it did not end the stream
            ids.append(s.request_id)
            frames.append(s.last_frame)
            finished.append(self.finish_code(s, s.last_frame))
        self.joined()
        for rid, code in zip(ids, finished, strict=True):
            if code != RUNNING:
                ended.append(self.running.pop(rid))
                self.pool.finish(rid)
        n_cols = self.model.config.n_codebooks
        return StepOutput(
            request_ids=np.array(ids, dtype=np.uint64),
            frames=np.stack(frames).astype(np.int32) if frames else np.zeros((0, n_cols), np.int32),
            finished=np.array(finished, dtype=np.uint8),
            started=[s for s in new if not s.first_out],
            ended=ended,
        )

    def finish_code(self, s: Stream, frame: np.ndarray) -> int:
        """Whether `frame`, the stream's newest, ends it: the model's end of stream (the
        family's EOS frame) once min_frames are out, or max_frames."""
        if self.model.ends_stream(frame) and s.frames_out >= s.params.min_frames:
            return FINISHED_EOS
        if s.frames_out >= s.params.max_frames:
            return FINISHED_LENGTH
        return RUNNING
