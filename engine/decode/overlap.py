"""Overlap scheduling for D (`pdunit decode --overlap`): the host prepares and queues
decode step n+1 while the device runs step n; step n's frames reach the host
asynchronously and are published one iteration later. Same frames as without overlap.
The monolith (`pdunit monolith --overlap`) runs the same pipeline with a `PromptSource`.

Owns: the in-flight step, per-stream scheduled-frame counts, deferred page frees and
the overlap metrics. Must never publish a frame computed after its stream ended, and
never free pages a queued step may still write (a stream's pages return to the pool
only after the last queued step that writes them has completed: its event).
The iteration and its rules: the comment above `OverlapScheduler`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from prometheus_client import Counter, Gauge, Histogram

from pdunit.engine import metrics as m
from pdunit.engine.batching import SeqEntry
from pdunit.engine.decode.batcher import RUNNING, DecodeBatcher, StepOutput, Stream
from pdunit.engine.decode.step_forward import StepForward
from pdunit.engine.model.mixed_graphs import MixedGraphRunner
from pdunit.engine.model.prefill_graphs import PrefillGraphRunner
from pdunit.engine.model.sampling import SamplingParams, sampling_batch, to_device
from pdunit.engine.model.transformer import ForwardBatch, TTSModel
from pdunit.engine.prefill.runner import run_forward

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)

HOST_SECONDS = m.role_metric(Histogram(
    "pdunit_decode_host_seconds",
    "Host time to prepare and queue one decode step with overlap (hidden while it is under the device's step time)",
    buckets=_FAST, registry=None), "decode", "monolith")
WAIT_SECONDS = m.role_metric(Histogram(
    "pdunit_decode_device_wait_seconds",
    "Host time blocked on the previous step's frames with overlap (near 0: the host is the bottleneck)",
    buckets=_FAST, registry=None), "decode", "monolith")
GPU_BUSY_RATIO = m.role_metric(Gauge(
    "pdunit_decode_gpu_busy_ratio",
    "Share of device time spent in decode steps over the last steps of a busy period (CUDA only)", registry=None), "decode", "monolith")
DISCARDED_ROWS = m.role_metric(Counter(
    "pdunit_decode_discarded_rows_total",
    "Rows computed for streams that had already ended (EOS seen one step late, or cancelled)", registry=None), "decode", "monolith")

BUSY_WINDOW = 64


@dataclass
class PromptRows:
    """Prompt rows one step carries beside its decode rows: one host entry per prompt
    chunk; `ending` the entries whose chunk ends its prompt (their last row's logits
    give the prompt's first frame, sampled with `params`, one per ending entry).
    `plan` is the caller's, handed back when the step completes."""

    entries: list[SeqEntry]
    ending: list[int]
    params: list[SamplingParams]
    plan: Any = None

    @property
    def rows(self) -> int:
        return sum(len(e.tokens) for e in self.entries)


# The monolith's prompt rows: each step may also carry prompt rows (a mixed step, or a
# prefill-only one), computed in the same forward from host tokens; a prompt's first
# frame is sampled on the device at frame index 0 beside the decode rows and handed back
# when the step completes.
class PromptSource(Protocol):
    """What the monolith gives the pipeline: each step's composition, and the prompts'
    first frames when a step completes."""

    def compose_step(self, batch: list[Stream]) -> tuple[list[Stream], PromptRows | None]:
        """The decode streams (a subset of `batch`, the streams with frames to go) and the
        prompt rows of the step about to be queued."""
        ...

    def prompts_done(self, prompts: PromptRows, first_frames: np.ndarray) -> None:
        """A completed step's prompt rows; `first_frames` int32 [len(ending), C]."""
        ...


@dataclass
class _Step:
    number: int
    streams: list[Stream]
    rows: dict[int, int]                  # request id -> row of this step
    frames_dev: torch.Tensor              # int32 [n, C] on the device: the next step's input (then first frames)
    frames_host: torch.Tensor             # int32 [n, C] (pinned on CUDA)
    started: torch.cuda.Event | None = None
    copied: torch.cuda.Event | None = None
    prompts: PromptRows | None = None     # the prompt rows it computed (the monolith)


# One iteration:
# 1. drop cancelled streams, admit new ones (their first frames, computed by P, go out
#    with this iteration's message);
# 2. build step n+1 on the host: positions, write slots, slot tables and the sampling
#    draws depend only on how many frames each stream has been scheduled for, never on
#    the sampled values. Its input tokens are step n's sampled frames, which stay on the
#    device: one device-side gather (rows of step n's output, plus the first frames of
#    new streams) fills the step's token buffer, with no host round-trip;
# 3. queue step n+1 (forward, device sampling, an async copy of its frames into pinned
#    memory, a CUDA event);
# 4. wait for step n's copy (the device is busy with n+1 by then), apply step n's frames
#    (EOS, length), publish one StepFrames message.
#
# EOS is seen one step late: a stream whose frame of step n was EOS is already in step
# n+1; that row is computed and discarded, never published. Its K/V row lands inside the
# stream's own reservation: a stream is scheduled only while it has fewer than
# `max_frames` frames, so the extra row's position is at most prompt + max_frames - 2,
# the bound without overlap (the pool reserves prompt + max_frames tokens). The length
# end is known up front and costs no extra step.
#
# On CPU the same code runs with CPU tensors; the "async" copy and the event are then
# no-ops, so the pipeline, the one-step-late publication and the page rule are what the
# CPU tests exercise.
@dataclass
class OverlapScheduler:
    model: TTSModel
    batcher: DecodeBatcher
    step_forward: StepForward
    prompts: PromptSource | None = None   # the monolith's prompt rows (None: D, decode rows only)
    prefill_graphs: PrefillGraphRunner | None = None  # the monolith's prompt-only steps replay these when they fit
    mixed_graphs: MixedGraphRunner | None = None  # the monolith's mixed steps replay these when they fit
    completed: _Step | None = None        # the step the last iteration read back (None: none)
    dropped: list[int] = field(default_factory=list)  # the streams the last iteration dropped (cancelled)
    _inflight: _Step | None = None
    _scheduled: dict[int, int] = field(default_factory=dict)    # request id -> frames scheduled
    _last_step: dict[int, int] = field(default_factory=dict)    # request id -> last step writing its pages
    _free_after: list[tuple[int, int]] = field(default_factory=list)  # (step number, request id)
    _launched: int = 0
    _completed: int = 0
    _busy: deque = field(default_factory=lambda: deque(maxlen=BUSY_WINDOW))

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    @property
    def queued_step(self) -> _Step | None:
        """The step queued and not yet read back (its `started`/`copied` CUDA events time
        it on the device): what `pdunit bench step` reads."""
        return self._inflight

    def scheduled_frames(self, request_id: int) -> int:
        """Frames a stream has been scheduled for: its next step attends over its prompt
        plus these."""
        return self._scheduled[request_id]

    def step_once(self) -> tuple[bool, StepOutput | None]:
        """One iteration; returns (did any work, the message's content or None)."""
        t0 = time.perf_counter()
        b = self.batcher
        self.completed = None
        self.dropped = b.take_cancelled(free=False)
        for rid in self.dropped:
            self._scheduled.pop(rid, None)
            self._release(rid)
        new = b.take_incoming()
        first_ids, first_frames, first_codes, ended = [], [], [], []
        for s in new:
            s.frames_out = 1
            code = b.finish_code(s, s.last_frame)
            if not s.first_out:  # else published at COMMIT (and RUNNING)
                first_ids.append(s.request_id)
                first_frames.append(s.last_frame)
                first_codes.append(code)
            if code == RUNNING:
                b.running[s.request_id] = s
                self._scheduled[s.request_id] = 1
            else:
                ended.append(s)
                b.pool.finish(s.request_id)  # never in a step
        b.joined()
        prev = self._inflight
        batch = [s for s in b.running.values() if self._scheduled[s.request_id] < s.params.max_frames]
        prompts = None
        if self.prompts is not None:
            batch, prompts = self.prompts.compose_step(batch)
        self._inflight = self._launch(batch, prev, prompts) if batch or prompts is not None else None
        if self._inflight is not None:
            HOST_SECONDS.observe(time.perf_counter() - t0)
        if prev is None and not new:
            return self._inflight is not None, None
        ids: list[int] = []
        frames: list[np.ndarray] = []
        codes: list[int] = []
        if prev is not None:
            self._complete(prev)
            self.completed = prev
            host = prev.frames_host.numpy()
            for row, s in enumerate(prev.streams):
                if b.running.get(s.request_id) is not s:
                    DISCARDED_ROWS.inc()
                    continue
                frame = host[row].copy()
                s.last_frame = frame
                s.frames_out += 1
                code = b.finish_code(s, frame)
                ids.append(s.request_id)
                frames.append(frame)
                codes.append(code)
                if code != RUNNING:
                    b.running.pop(s.request_id)
                    self._scheduled.pop(s.request_id, None)
                    ended.append(s)
                    self._release(s.request_id)
            if prev.prompts is not None:
                assert self.prompts is not None
                self.prompts.prompts_done(prev.prompts, host[len(prev.streams):].copy())
        ids += first_ids
        frames += first_frames
        codes += first_codes
        if self._inflight is None:
            self._busy.clear()  # the busy period ended: the next one starts a new window
        if not ids:
            return True, None
        n_cols = self.model.config.n_codebooks
        return True, StepOutput(
            request_ids=np.array(ids, dtype=np.uint64),
            frames=np.stack(frames).astype(np.int32) if frames else np.zeros((0, n_cols), np.int32),
            finished=np.array(codes, dtype=np.uint8),
            started=[s for s in new if not s.first_out],
            ended=ended,
        )

    # ------------------------------------------------------------------ internals
    def _launch(self, batch: list[Stream], prev: _Step | None, prompts: PromptRows | None = None) -> _Step:
        """Queues one step for `batch` (and `prompts`' rows after them); decode tokens
        come from `prev`'s device frames for streams in `prev`, from the host's newest
        frame for the others."""
        dev = self.device
        pool = self.batcher.pool
        n_prev = prev.frames_dev.shape[0] if prev is not None else 0
        src = np.empty(len(batch), dtype=np.int64)
        host_rows: list[np.ndarray] = []
        positions = np.empty(len(batch), dtype=np.int64)
        write_slots = np.empty(len(batch), dtype=np.int64)
        context: list[np.ndarray] = []
        frame_index: list[int] = []
        for j, s in enumerate(batch):
            row = prev.rows.get(s.request_id) if prev is not None else None
            if row is None:
                src[j] = n_prev + len(host_rows)
                host_rows.append(s.last_frame)
            else:
                src[j] = row
            sched = self._scheduled[s.request_id]
            pos = s.prompt_tokens + sched - 1
            positions[j] = pos
            write_slots[j] = pool.slot_of(s.request_id, pos)
            context.append(pool.slots(s.request_id, pos + 1))
            frame_index.append(sched)
        n_cols = self.model.config.n_codebooks
        if host_rows:
            first = to_device(np.stack(host_rows).astype(np.int32), dev)
            rows = torch.cat([prev.frames_dev, first]) if prev is not None else first
        elif batch:
            assert prev is not None
            rows = prev.frames_dev
        else:  # prompt rows only
            rows = torch.zeros((0, n_cols), dtype=torch.int32, device=dev)
        tokens = rows.index_select(0, to_device(src, dev))
        params = [s.params for s in batch]
        if prompts is not None:
            params += prompts.params
            frame_index += [0] * len(prompts.ending)
        sb = sampling_batch(params, frame_index, n_cols, dev)
        cuda = dev.type == "cuda"
        started = torch.cuda.Event(enable_timing=True) if cuda else None
        copied = None
        # `started` is recorded just before the forward is queued: recorded here, an idle
        # GPU waiting for the host's staging would count as busy.
        if prompts is None:
            logits = self.step_forward.launch(tokens.to(torch.int64), positions, write_slots, context, started)
        else:
            logits = self._prompt_forward(tokens.to(torch.int64), positions, write_slots, context, prompts, started)
            keep = list(range(len(batch))) + [len(batch) + i for i in prompts.ending]
            logits = logits.index_select(0, to_device(np.array(keep, dtype=np.int64), dev))
        if len(params):
            frames_dev = self.model.frames_device(logits, sb)
        else:  # no decode row and no prompt ends in this step
            frames_dev = torch.zeros((0, n_cols), dtype=torch.int32, device=dev)
        if cuda:
            frames_host = torch.empty(frames_dev.shape, dtype=torch.int32, pin_memory=True)
            frames_host.copy_(frames_dev, non_blocking=True)
            copied = torch.cuda.Event(enable_timing=True)
            copied.record()
        else:
            frames_host = frames_dev
        self._launched += 1
        for s in batch:
            self._scheduled[s.request_id] += 1
            self._last_step[s.request_id] = self._launched
        return _Step(self._launched, batch, {s.request_id: j for j, s in enumerate(batch)},
                     frames_dev, frames_host, started, copied, prompts)

    def _prompt_forward(self, tokens: torch.Tensor, positions: np.ndarray, write_slots: np.ndarray,
                        context: list[np.ndarray], prompts: PromptRows,
                        started: torch.cuda.Event | None) -> torch.Tensor:
        """One forward over the decode rows (`tokens` on the device) and then the prompt
        chunks (host tokens); logits [streams + chunks, C, V] on the device. A step of
        prompt rows only goes through the prefill graphs when given (its tokens are all
        on the host), a mixed step through the mixed-step graphs when given and a bucket
        pair holds it; otherwise it runs eagerly, its host arrays sent without a sync."""
        entries = prompts.entries
        if not len(positions) and self.prefill_graphs is not None:
            if started is not None:
                started.record()
            return run_forward(self.model, self.batcher.storage, entries, self.prefill_graphs)
        if len(positions) and self.mixed_graphs is not None:
            out = self.mixed_graphs.run(tokens, positions, write_slots, context, entries, started)
            m.MONO_MIXED_STEPS.labels(path="eager" if out is None else "graph").inc()
            if out is not None:
                m.P_PREFILL_FORWARDS.labels(path="graph").inc()
                return out
        elif len(positions):
            m.MONO_MIXED_STEPS.labels(path="eager").inc()
        m.P_PREFILL_FORWARDS.labels(path="eager").inc()
        dev = self.device
        prompt_tokens = to_device(np.concatenate([e.tokens for e in entries]).astype(np.int64), dev)
        batch = ForwardBatch(
            tokens=torch.cat([tokens, prompt_tokens]),
            positions=to_device(np.concatenate([positions] + [e.positions for e in entries]).astype(np.int64), dev),
            write_slots=to_device(np.concatenate([write_slots] + [e.write_slots for e in entries]).astype(np.int64),
                                  dev),
            query_lens=[1] * len(positions) + [len(e.tokens) for e in entries],
            # on the host, as StepForward.launch keeps them
            context_slots=[torch.from_numpy(c.astype(np.int64)) for c in context + [e.context_slots for e in entries]],
        )
        if started is not None:
            started.record()
        with torch.inference_mode():
            return self.model.forward(batch, self.batcher.storage)

    def _complete(self, step: _Step) -> None:
        """Waits for `step`'s frames on the host; frees pages no queued step writes."""
        t0 = time.perf_counter()
        if step.copied is not None:
            step.copied.synchronize()
            assert step.started is not None
            busy_ms = step.started.elapsed_time(step.copied)
            m.D_GPU_BUSY_SECONDS.inc(busy_ms / 1000)
            self._busy.append((step.started, step.copied, busy_ms))
            if len(self._busy) > 1:
                first, last = self._busy[0][0], self._busy[-1][1]
                span = first.elapsed_time(last)
                if span > 0:
                    GPU_BUSY_RATIO.set(min(1.0, sum(b for _, _, b in self._busy) / span))
        WAIT_SECONDS.observe(time.perf_counter() - t0)
        self._completed = step.number
        keep = []
        for number, rid in self._free_after:
            if number <= self._completed:
                self.batcher.pool.finish(rid)
            else:
                keep.append((number, rid))
        self._free_after = keep

    def _release(self, request_id: int) -> None:
        """The stream ended or was cancelled: its pages go back now, or after the last
        queued step that writes them."""
        last = self._last_step.pop(request_id, 0)
        if last <= self._completed:
            self.batcher.pool.finish(request_id)
        else:
            self._free_after.append((last, request_id))
