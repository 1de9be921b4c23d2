"""The monolith: prefill and decode in one process on one device, the baseline PD is
measured against. Same model, same batcher, same kernels as P and D; policies
`prefill-first` (nano-vllm's scheduler), `chunked` and `budget` (`POLICIES`), optionally
with `overlap` (engine/decode/overlap.py) and a prefix cache, and rate-floor admission
(engine/decode/admission.py) in `submit`.

It never transfers KV. Without a cache, prompt rows are written in place in the pool
and go straight to decoding; with one, a prompt's rows are copied from its cache lease
into the stream's pool pages when its prefill ends (one device copy, the monolith's
"transfer").
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from pdunit.engine import metrics as m
from pdunit.engine.audio.codec_stage import NO_CODEC, CodecStage, StepCost
from pdunit.engine.batching import SeqEntry, prefill_entry
from pdunit.engine.decode.admission import AdmissionControl
from pdunit.engine.decode.batcher import DecodeBatcher, StepOutput, Stream
from pdunit.engine.decode.hub import FrameHub
from pdunit.engine.decode.overlap import OverlapScheduler, PromptRows
from pdunit.engine.decode.step_forward import StepForward
from pdunit.engine.decode.stream_lives import HeldStream, PendingPrefills
from pdunit.engine.kv.pool import NoCapacity, PagePool
from pdunit.engine.kv.prefix_cache import PrefixCache, PrefixLease, block_hashes
from pdunit.engine.model.mixed_graphs import MixedGraphRunner
from pdunit.engine.model.prefill_graphs import PrefillGraphRunner
from pdunit.engine.model.sampling import to_device
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.monolith.policy import RowBudget
from pdunit.engine.observability import now_ns
from pdunit.engine.packing import pack
from pdunit.engine.playback import real_time_fps
from pdunit.engine.prefill.runner import PrefillChunk, first_frames, run_forward
from pdunit.engine.prefill.scheduler import PrefillJob, PrefillScheduler
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto.row_rule import hello_rules
from pdunit.engine.step_loop import StepLoop, publish_step
from pdunit.engine.step_pad import StepPad
from pdunit.kernels.kv_dtype import index_copy_kv

log = logging.getLogger("pdunit.monolith")

# - `prefill-first` (the common engine default, nano-vllm's scheduler): whenever a prompt
#   waits, the iteration runs prefill only, so every decoding stream waits for it.
# - `chunked`: every iteration is one forward over all decoding streams plus prompt rows
#   up to `chunk_tokens` in total.
# - `budget`: every iteration's prompt rows are what fits in the rate floor's step budget
#   beside the decoding streams (engine/monolith/policy.py); it needs admission on.
# With `overlap` (D's pipeline) step n+1 is queued before step n's frames reach the host,
# for every policy's decode-only, mixed and prefill-only steps. With a prefix cache
# (`cache`, P's PrefixCache over a region of the storage beside the pool) a prompt is
# computed into its cache lease, as P computes it, so a reused voice skips its cached
# leading blocks.
POLICIES = ("prefill-first", "chunked", "budget")


@dataclass
class Prefilling:
    job: PrefillJob
    slots: np.ndarray  # storage slots the prefill reads and writes: the lease's, else the pool's
    done_rows: int = 0  # rows whose K/V is in `slots` (a cache hit starts past its cached rows)
    lease: PrefixLease | None = None
    planned_rows: int = -1  # rows handed to a step (queued or done); -1: done_rows

    def __post_init__(self) -> None:
        if self.planned_rows < 0:
            self.planned_rows = self.done_rows

    @property
    def in_flight(self) -> bool:
        """A queued step still writes its rows (overlap)."""
        return self.planned_rows > self.done_rows


class MonolithEngine:
    def __init__(
        self,
        model: TTSModel,
        model_spec: str,
        pool: PagePool,
        storage: torch.Tensor,
        hub: FrameHub,
        policy: str,
        chunk_tokens: int,
        max_batch: int,
        max_batch_rows: int,
        cuda_graphs: bool = True,
        prefill_graphs: PrefillGraphRunner | None = None,
        cache: PrefixCache | None = None,
        admission: AdmissionControl | None = None,
        overlap: bool = False,
        min_chunk_rows: int = 16,
        codec: CodecStage | None = None,
        audio_format: pb.AudioFormat | None = None,
        mixed_graphs: MixedGraphRunner | None = None,
    ) -> None:
        """`cache`: slot numbers count from `pool.n_slots`, the first storage slot after
        the pool's (the storage holds both). `admission`: rate-floor admission (None =
        off). `overlap`: D's overlap pipeline. `min_chunk_rows`: the budget policy's
        smallest chunk (one prefix-cache block). `codec` (--codec; None: audio requests
        are refused) decodes the frames of streams that ask for audio; `audio_format` is
        what Hello announces of it. `mixed_graphs` (--mixed-graphs): mixed steps a bucket
        pair holds replay a captured mixed step (engine/model/mixed_graphs.py)."""
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: expected one of {POLICIES}")
        if policy == "budget" and admission is None:
            raise ValueError("--policy budget sizes each step's prompt rows to the rate floor's step budget, and "
                             "the rate floor is off: give --rate-floor > 0 (frames/s per stream), or choose "
                             "--policy prefill-first or chunked")
        self.instance_id = uuid.uuid4().hex
        self.model = model
        self.prefill_graphs = prefill_graphs  # --prefill-graphs: prompt forwards that fit replay a graph
        self.mixed_graphs = mixed_graphs  # --mixed-graphs: mixed steps that fit replay a graph
        self.model_spec = model_spec
        self.pool = pool
        self.storage = storage
        self.hub = hub
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.max_batch_rows = max_batch_rows
        self.cache = cache
        self.cache_base = pool.n_slots
        if cache is not None and storage.shape[2] < self.cache_base + cache.n_slots:
            raise ValueError(f"storage has {storage.shape[2]} slots: the pool ({self.cache_base}) and the prefix "
                             f"cache ({cache.n_slots}) need {self.cache_base + cache.n_slots}")
        self.waiting = PrefillScheduler(max_batch_prompts=1 << 30, max_batch_rows=1 << 30)
        self.prefilling: list[Prefilling] = []
        self.batcher = DecodeBatcher(model, pool, storage, max_batch)
        self.step_forward = StepForward(model, storage, cuda_graphs, max_batch)
        self.overlap = (OverlapScheduler(model, self.batcher, self.step_forward, prompts=self,
                                         prefill_graphs=prefill_graphs, mixed_graphs=mixed_graphs)
                        if overlap else None)
        self.row_budget = (RowBudget(admission, min_chunk_rows, max(max_batch_rows, 1))
                           if policy == "budget" and admission is not None else None)
        self._lock = threading.Lock()
        self._step = 0
        self.admission = admission
        # Admitted prompts whose stream is not yet running (queued, prefilling, or waiting
        # for its first step): request id -> (prompt rows, max frames). One entry from
        # submit until the stream runs or fails, so a prompt moving between the queue,
        # `prefilling` and the batcher is never missed by the projection (while it
        # waits in the batcher it counts twice: the safe side).
        self._admitted: dict[int, tuple[int, int, bool]] = {}  # (prompt rows, max frames, audio)
        # Of those, the prompts whose prefill has not ended (request id -> prompt rows), in
        # admission order, and when the last decode step's frames went out (`now_ns`):
        # prefill-first's whole-life check (`_held_with_stalls`)
        self._unprefilled: dict[int, int] = {}
        self._published_ns = 0
        self._admitted_lock = threading.Lock()
        # bumped by every loop iteration that worked and every change of `_admitted`
        # (under `_admitted_lock`): the key of the cached headroom (`headroom`)
        self._held_version = 0
        # prefill-first: ms of prefill-only steps since the previous decode step while
        # streams were decoding (they waited for them): admission's stall charge
        self._stall_ms = 0.0
        self.loop = StepLoop("monolith", self._step_once, model.device)
        self.step_pad = StepPad()  # --synthetic-step-ms (tests and benchmarks; engine/step_pad.py): off
        self.codec = codec
        self.audio_format = audio_format
        self._audio: set[int] = set()  # admitted prompts whose stream wants audio, until it runs or fails
        if codec is not None:
            codec.on_fail = self._end_failed_audio

    # ------------------------------------------------------------------ requests
    # Rate-floor admission (`admission`): refuses a prompt (RATE_FLOOR, before it is
    # queued: it holds nothing) when the projected step over the monolith's streams
    # (decoding, and admitted but still queued or prefilling, as held streams) plus the new
    # one would break the floor's budget; a prompt that alone would is INVALID. Every step is
    # observed into the step model, a mixed or prefill-only step with its prompt rows (the
    # per-row term).
    def submit(self, job: PrefillJob) -> None:
        """A job with `audio` has its frames decoded to PCM too (refused, INVALID, without a codec)."""
        job.stamps["p_admitted"] = now_ns()
        if job.audio and self.codec is None:
            self._finish(job, pb.INVALID, NO_CODEC)
            return
        if self.admission is not None and not self._admit(job):
            return
        if job.audio:
            self._audio.add(job.request_id)
        if self.cache is not None:  # hashed on the caller's thread: the loop's would leave the GPU idle
            job.prefix_chain = block_hashes(job.prompt, self.cache.block_tokens)
        self.waiting.put(job)
        self.loop.work.set()

    def cancel(self, request_id: int) -> bool:
        job = self.waiting.cancel(request_id)
        if job is not None:
            self._finish(job, pb.CANCELLED, "cancelled by the client")
            return True
        with self._lock:
            for p in self.prefilling:
                if p.job.request_id == request_id:
                    p.job.cancelled = True
                    return True
        if self.batcher.cancel(request_id):
            self.loop.work.set()
            return True
        return False

    def _admit(self, job: PrefillJob) -> bool:
        """Rate-floor admission of a new prompt; a refused one is answered here."""
        assert self.admission is not None
        rows, frames = len(job.prompt), job.params.max_frames
        alone = self.admission.alone_fits(rows, frames, job.audio)
        if not alone.admit and not alone.engine_bound:  # else judged below: a 503
            self._finish(job, pb.INVALID, "rate_floor: even alone this stream would break the floor "
                         f"({alone.worst_ms:.1f} ms steps at its end, budget {alone.budget_ms:.1f} ms): "
                         "ask for fewer frames")
            return False
        with self._admitted_lock:  # two submits never both take the last room
            held: list[tuple[int, ...] | HeldStream]
            if self.policy == "prefill-first":
                held, new_stall_ms = self._held_with_stalls(rows)
            else:
                held = [*self.batcher.lifetimes(audio=True), *self._admitted.values()]
                new_stall_ms = 0.0
            verdict = self.admission.judge(held, rows, frames, self.prefill_rows_per_step(), audio=job.audio,
                                           new_stall_ms=new_stall_ms)
            if verdict.admit:
                self._admitted[job.request_id] = (rows, frames, job.audio)
                self._unprefilled[job.request_id] = rows
                self._held_version += 1
        if not verdict.admit:
            log.info("stream refused: rate floor", extra={
                "request_id": job.request_id, "worst_ms": round(verdict.worst_ms, 2),
                "budget_ms": round(verdict.budget_ms, 2), "at_step": verdict.at_step})
            self._finish(job, pb.RATE_FLOOR, verdict.reason())
        return verdict.admit

    def _held_with_stalls(self, new_rows: int) -> tuple[list[tuple[int, ...] | HeldStream], float]:
        """Under `_admitted_lock`, prefill-first: every held stream with its life so far
        and the prefill-only steps of admitted prompts it will wait for, and what the new
        prompt's prefill (`new_rows`) adds to their wait (`_pending_prefills`)."""
        assert self.admission is not None
        held, new_stall_ms = self._pending_prefills().held(self.admission.model.prefill_coefficients, new_rows)
        return list(held), new_stall_ms

    def _pending_prefills(self) -> PendingPrefills:
        """Under `_admitted_lock`, prefill-first: the held streams and the prefills they
        will wait for (the whole-life check, engine/decode/stream_lives.py). Prompts
        prefill in FIFO steps of up to `max_batch_rows`: those in a step now (planned)
        form one step, the unplanned ones the next steps. A decoding stream, and a prompt
        prefilled and about to run, waits for all of them; an admitted prompt for the
        steps after its own with the overlap pipeline (it publishes a first frame after
        the next step), for none in the plain loop (after every queued prompt's)."""
        with self._lock:
            planned = {p.job.request_id: (p.planned_rows, p.done_rows) for p in self.prefilling}
        in_step_rows = unplanned_rows = 0
        in_step: set[int] = set()
        for rid, rows in self._unprefilled.items():
            done_planned = planned.get(rid)
            if done_planned is not None and done_planned[0] > done_planned[1]:
                in_step.add(rid)
                in_step_rows += done_planned[0] - done_planned[1]
                unplanned_rows += rows - done_planned[0]
            else:
                unplanned_rows += rows - (done_planned[0] if done_planned is not None else 0)
        last = self._published_ns
        waiting_all: list[HeldStream] = []
        for s in self.batcher.held():
            first = s.stamps.get("first_frame_step")
            started = first is not None and s.frames_out > 0
            waiting_all.append(HeldStream(s.prompt_tokens + s.frames_out, max(0, s.params.max_frames - s.frames_out),
                                          s.audio, s.frames_out if started else 0,
                                          max(0.0, (last - first) / 1e6) if started and first is not None else 0.0))
        waiting_in_step: list[HeldStream] = []
        unplanned: list[HeldStream] = []
        for rid, (rows, frames, audio) in self._admitted.items():
            stream = HeldStream(rows, frames, audio)
            if rid not in self._unprefilled:  # prefilled, its stream about to run: it waits for all
                waiting_all.append(stream)
            else:
                (waiting_in_step if rid in in_step else unplanned).append(stream)
        return PendingPrefills(tuple(waiting_all), tuple(waiting_in_step), tuple(unplanned), in_step_rows,
                               unplanned_rows, max(self.max_batch_rows, 1),
                               first_frames_after_queue=self.overlap is None)

    def prefill_rows_per_step(self) -> float:
        """The prompt rows admission charges every projected step whatever its streams:
        under `budget`, one minimum chunk (the policy shrinks a step's prompt rows to what
        the floor leaves, so only the chunk that always runs is load). The other policies'
        prompts are charged per projected stream as measured, each held stream bringing
        its refill's (a closed loop at capacity): `prefill-first`'s prefill-only steps,
        whose whole time (base and rows) the decoding streams wait for
        (AdmissionControl.observe_stall), `chunked`'s rows in the steps its decoding
        streams are in (AdmissionControl.observe_rows)."""
        if self.row_budget is not None:
            return float(self.row_budget.block_rows)
        return 0.0

    def _lifetimes(self) -> list[tuple[int, ...]]:
        """(context, frames to come, audio) of every stream the monolith holds: decoding
        or waiting for the batch, and admitted prompts not yet there."""
        with self._admitted_lock:
            admitted: list[tuple[int, ...]] = list(self._admitted.values())
        return self.batcher.lifetimes(audio=True) + admitted

    def _judged_as_held(self) -> list[tuple[int, ...]] | PendingPrefills:
        """The held streams as its verdicts judge them: prefill-first's with their lives
        and the prefills they will wait for, the other policies' `_lifetimes`."""
        if self.policy == "prefill-first":
            with self._admitted_lock:
                return self._pending_prefills()
        return self._lifetimes()

    def headroom(self) -> int:
        """Streams like the recent ones it would still admit one after another (-1:
        admission off), computed at most once per loop iteration that worked and change
        of the admitted prompts."""
        if self.admission is None:
            return -1
        return self.admission.export_for(self._held_version, self._judged_as_held)

    def _forget(self, request_ids: list[int]) -> None:
        """Streams that run now, or that ended before they ran, leave `_admitted`."""
        with self._admitted_lock:
            for rid in request_ids:
                self._admitted.pop(rid, None)
                self._unprefilled.pop(rid, None)
            self._held_version += 1

    def _finish(self, job: PrefillJob, status: pb.Status, message: str = "", **fields: int) -> None:
        """The prompt's answer; a failed one leaves `_admitted` (a served one when its
        stream runs)."""
        if status != pb.STATUS_OK:
            self._forget([job.request_id])
            self._audio.discard(job.request_id)
        if job.done is not None:
            job.done(pb.SubmitReply(status=status, message=message, stamps=pb.Stamps(ns=job.stamps), **fields))

    # ------------------------------------------------------------------ the loop
    def _admit_waiting(self) -> None:
        """Queued prompts into `prefilling` (their pool pages and cache lease taken) while
        fewer than `max_batch_rows` prompt rows wait there: the next forward's worth.
        The rest stay queued, holding nothing: a backlog pinning every cache slot and
        pool page at once would refuse requests that a moment later would fit. A prompt
        whose cache lease cannot be had while others are in flight waits at the head of
        the queue for their slots; one that cannot fit an idle cache is refused."""
        while self._pending_rows() < self.max_batch_rows:
            job = self.waiting.take(timeout=0)
            if job is None:
                return
            rows = len(job.prompt)
            if job.deadline_unix_ms and time.time() * 1000 > job.deadline_unix_ms:
                self._finish(job, pb.DEADLINE_EXCEEDED, "deadline passed while queued")
                continue
            # The cache lease first: a prompt waiting for cache slots retries each
            # iteration, and must not take and give back its pool pages every time.
            lease = None
            if self.cache is not None:
                try:
                    lease = self.cache.acquire(job.prompt, job.prefix_chain)
                except NoCapacity as exc:
                    with self._lock:
                        in_flight = bool(self.prefilling)
                    if in_flight:  # their leases come back as their prefills end
                        self.waiting.put_back(job)
                        return
                    self._finish(job, pb.NO_CAPACITY, f"prefix cache full: {exc}")
                    continue
            try:
                self.pool.reserve(job.request_id, rows, rows + job.params.max_frames)
            except NoCapacity as exc:
                if self.cache is not None and lease is not None:
                    self.cache.release(lease)
                self._finish(job, pb.NO_CAPACITY, str(exc))
                continue
            if lease is None:
                entry = Prefilling(job, self.pool.slots(job.request_id, rows))
            else:  # the last row is always computed: its logits give the first frame
                entry = Prefilling(job, lease.slots + self.cache_base, min(lease.cached_tokens, rows - 1), lease)
            with self._lock:
                self.prefilling.append(entry)

    def _pending_rows(self) -> int:
        """Prompt rows admitted and not yet prefilled."""
        with self._lock:
            return sum(len(p.job.prompt) - p.done_rows for p in self.prefilling)

    def _drop_reservation(self, request_id: int) -> None:
        # No writer other than this thread exists: the pages can go straight back.
        self.pool.mark_filled(request_id)
        self.pool.start_decoding(request_id)
        self.pool.finish(request_id)

    def _drop_cancelled_prefills(self) -> None:
        with self._lock:  # one a queued step still writes goes once that step completed
            gone = [p for p in self.prefilling if p.job.cancelled and not p.in_flight]
            self.prefilling = [p for p in self.prefilling if p not in gone]
        for p in gone:
            self._drop_reservation(p.job.request_id)
            if p.lease is not None and self.cache is not None:
                self.cache.release(p.lease)
            self._finish(p.job, pb.CANCELLED, "cancelled")

    def _unplanned(self) -> bool:
        """Some prompt has rows no step was handed yet."""
        with self._lock:
            return any(p.planned_rows < len(p.job.prompt) and not p.job.cancelled for p in self.prefilling)

    def _plan_chunks(self, budget: int) -> list[tuple[Prefilling, PrefillChunk]]:
        """Up to `budget` prompt rows, FIFO, from where each prompt's planned rows end."""
        plan = []
        with self._lock:
            for p in self.prefilling:
                if budget <= 0:
                    break
                rows = len(p.job.prompt)
                if p.planned_rows >= rows or p.job.cancelled:
                    continue
                end = min(rows, p.planned_rows + budget)
                plan.append((p, PrefillChunk(p.job.prompt, p.slots, p.planned_rows, end, p.job.params)))
                budget -= end - p.planned_rows
                p.planned_rows = end
        t = now_ns()
        for p, _ in plan:
            p.job.stamps.setdefault("prefill_start", t)
        return plan

    def _prompt_budget(self, streams: int, context_tokens: int) -> int:
        """Prompt rows a step beside `streams` decoding streams carries (prefill-first: none)."""
        if self.policy == "chunked":
            return self.chunk_tokens - streams
        if self.row_budget is not None:
            return self.row_budget.rows(streams, context_tokens)
        return 0

    def _complete_prefills(self, plan: list[tuple[Prefilling, PrefillChunk]], logits: torch.Tensor | None) -> None:
        if not plan:
            return
        assert logits is not None
        frames = first_frames(self.model, logits, [c for _, c in plan])
        for (p, chunk), frame in zip(plan, frames, strict=True):
            p.done_rows = chunk.end
            if frame is not None:
                self._prompt_ready(p, frame)

    def _prompt_ready(self, p: Prefilling, frame: np.ndarray) -> None:
        """A prompt's last row is computed: its stream joins the batcher with its first
        frame (a prompt cancelled meanwhile is left to _drop_cancelled_prefills)."""
        job = p.job
        if job.cancelled:
            return
        job.stamps["prefill_end"] = now_ns()
        rows = len(job.prompt)
        cached = self._take_from_cache(p)
        self.pool.mark_filled(job.request_id)
        self.pool.start_decoding(job.request_id)
        with self._lock:
            self.prefilling.remove(p)
        with self._admitted_lock:
            self._unprefilled.pop(job.request_id, None)
        audio = job.request_id in self._audio
        self._audio.discard(job.request_id)
        if audio and self.codec is not None:
            self.codec.open(job.request_id)
        self.batcher.admit(Stream(job.request_id, rows, job.params, frame.astype(np.int32),
                                  stamps=dict(job.stamps), audio=audio))
        m.P_PREFILL_TOKENS.labels(source="computed").inc(rows - cached)
        m.P_PREFILL_TOKENS.labels(source="cached").inc(cached)
        self._finish(job, pb.STATUS_OK, prefill_tokens=rows - cached, cached_tokens=cached)

    # ------------------------------------------------------------------ the overlap pipeline's PromptSource
    def compose_step(self, batch: list[Stream]) -> tuple[list[Stream], PromptRows | None]:
        """The next queued step under the policy: prefill-first runs prompt rows alone
        while any wait; chunked and budget add prompt rows to the decode rows."""
        if self.policy == "prefill-first":
            if self._unplanned():
                return [], self._prompt_rows(self._plan_chunks(max(self.max_batch_rows, 1)))
            return batch, None
        assert self.overlap is not None
        context = sum(s.prompt_tokens + self.overlap.scheduled_frames(s.request_id) for s in batch)
        plan = self._plan_chunks(self._prompt_budget(len(batch), context))
        return batch, self._prompt_rows(plan) if plan else None

    def prompts_done(self, prompts: PromptRows, first_frames: np.ndarray) -> None:
        plan: list[tuple[Prefilling, PrefillChunk]] = prompts.plan
        for p, chunk in plan:
            p.done_rows = chunk.end
        for i, frame in zip(prompts.ending, first_frames, strict=True):
            self._prompt_ready(plan[i][0], frame)

    @staticmethod
    def _prompt_rows(plan: list[tuple[Prefilling, PrefillChunk]]) -> PromptRows:
        ending = [i for i, (_, c) in enumerate(plan) if c.is_last]
        return PromptRows([prefill_entry(c.prompt, c.slots, c.start, c.end) for _, c in plan], ending,
                          [plan[i][1].params for i in ending], plan)

    def _take_from_cache(self, p: Prefilling) -> int:
        """A prompt prefilled in its cache lease: its full blocks become cache entries and
        its rows are copied into its pool pages; the lease is released. Returns the rows
        that came from the cache (0 without a lease)."""
        if p.lease is None:
            return 0
        assert self.cache is not None
        prompt = p.job.prompt
        self.cache.publish(p.lease, prompt)
        device = self.storage.device
        # astype copies (the pool's slot arrays are read-only views, which from_numpy warns
        # of); to_device queues the copy without waiting for the step in flight (overlap)
        src = to_device(p.slots.astype(np.int64), device)
        dst = to_device(self.pool.slots(p.job.request_id, len(prompt)).astype(np.int64), device)
        # Same thread and stream as the forwards: ordered after the one that wrote the rows
        # and before the first decode step that reads them.
        index_copy_kv(self.storage, 2, dst, self.storage.index_select(2, src))
        self.cache.release(p.lease)
        return min(p.lease.cached_tokens, len(prompt) - 1)

    def _step_once(self) -> bool:
        worked = self._step_once_inner()
        if worked:
            with self._admitted_lock:
                self._held_version += 1
        return worked

    def _step_once_inner(self) -> bool:
        if self.overlap is not None:
            return self._overlap_step_once()
        dropped = self.batcher.take_cancelled()
        self._forget(dropped)
        if self.codec is not None:
            self.codec.drop(dropped)
        self._admit_waiting()
        self._drop_cancelled_prefills()
        if self.model.device.type != "cuda":
            return self._run_step()
        # The device time of the step (CUDA events around it; the step ends synchronized by
        # host sampling): the monolith's GPU busy share, comparable with D's.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        worked = self._run_step()
        end.record()
        if worked:
            end.synchronize()
            m.D_GPU_BUSY_SECONDS.inc(start.elapsed_time(end) / 1000)
        return worked

    def _run_step(self) -> bool:
        t0 = time.perf_counter()
        if self.policy == "prefill-first" and self._unplanned():
            decoding = len(self.batcher)  # the streams this prefill-only step makes wait
            plan = self._plan_chunks(max(self.max_batch_rows, 1))
            logits: torch.Tensor | None = run_forward(self.model, self.storage,
                                 [prefill_entry(c.prompt, c.slots, c.start, c.end) for _, c in plan],
                                 self.prefill_graphs)
            rows = sum(c.end - c.start for _, c in plan)
            self.step_pad.wait(t0, 0, rows)  # in the forward's place: before any stream changes
            self._complete_prefills(plan, logits)
            seconds = time.perf_counter() - t0
            m.P_PREFILL_SECONDS.observe(seconds)
            self._observe(0, 0, seconds, rows, waiting=decoding)
            return True
        new = self.batcher.take_incoming()
        streams, entries = self.batcher.decode_entries()
        tokens = sum(s.prompt_tokens + s.frames_out for s in streams)
        plan = self._plan_chunks(self._prompt_budget(len(streams), tokens))
        if not streams and not new and not plan:
            self._sweep_audio()
            return False
        if plan:  # a mixed batch: a mixed-step graph, else a prefill graph when it fits one, else eager
            logits = self._mixed_forward(entries, [prefill_entry(c.prompt, c.slots, c.start, c.end) for _, c in plan])
        else:  # decode only: the same graph path as D, so the comparison is fair
            logits = self.step_forward(entries) if entries else None
        n_dec = len(streams)
        rows = sum(c.end - c.start for _, c in plan)
        self.step_pad.wait(t0, n_dec, rows)  # in the forward's place: before any stream changes
        out = self.batcher.apply(streams, logits[:n_dec] if logits is not None else None, new)
        self._forget([s.request_id for s in new])  # running now: the batcher counts them
        self._complete_prefills(plan, logits[n_dec:] if logits is not None else None)
        cost = None
        if len(out.request_ids):
            self._step += 1
            cost = publish_step(self.hub, self._step, out, self.codec)
            self._published_ns = now_ns()
            m.D_FRAMES.inc(len(out.request_ids))
            m.D_STEP_BATCH.observe(len(out.request_ids))
            self._observe_delivery(out)
        seconds = time.perf_counter() - t0
        m.D_STEP_SECONDS.observe(seconds)
        m.D_STREAMS.set(len(self.batcher))
        self._observe(n_dec, tokens, seconds, rows, cost)
        return True

    def _mixed_forward(self, decode: list[SeqEntry], chunks: list[SeqEntry]) -> torch.Tensor:
        """The plain loop's forward of decode rows (`decode`, one row each) and prompt
        chunks: a replay of the mixed-step graphs when a bucket pair holds it, else
        `run_forward` (a prefill graph when one fits: few streams, a small chunk)."""
        if decode:
            out = None
            if self.mixed_graphs is not None:
                out = self.mixed_graphs.run(
                    np.concatenate([e.tokens for e in decode]).astype(np.int64),
                    np.concatenate([e.positions for e in decode]).astype(np.int64),
                    np.concatenate([e.write_slots for e in decode]).astype(np.int64),
                    [e.context_slots for e in decode], chunks)
            m.MONO_MIXED_STEPS.labels(path="eager" if out is None else "graph").inc()
            if out is not None:
                m.P_PREFILL_FORWARDS.labels(path="graph").inc()
                return out
        return run_forward(self.model, self.storage, decode + chunks, self.prefill_graphs)

    def _overlap_step_once(self) -> bool:
        """One iteration of the overlap pipeline: queues step n+1 (compose_step), then
        publishes step n's frames; its prompts' streams join the batcher (prompts_done)."""
        assert self.overlap is not None
        self._admit_waiting()
        self._drop_cancelled_prefills()
        t0 = time.perf_counter()
        worked, out = self.overlap.step_once()
        self._forget(self.overlap.dropped + ([s.request_id for s in out.started] if out is not None else []))
        if self.codec is not None:
            self.codec.drop(self.overlap.dropped)
        if not worked:
            self._sweep_audio()
            return False
        cost = None
        if out is not None:
            self._step += 1
            cost = publish_step(self.hub, self._step, out, self.codec)
            self._published_ns = now_ns()
            m.D_FRAMES.inc(len(out.request_ids))
            m.D_STEP_BATCH.observe(len(out.request_ids))
            self._observe_delivery(out)
        done = self.overlap.completed
        rows = done.prompts.rows if done is not None and done.prompts is not None else 0
        self.step_pad.wait(t0, len(done.streams) if done is not None else 0, rows)
        seconds = time.perf_counter() - t0
        m.D_STEP_SECONDS.observe(seconds)
        m.D_STREAMS.set(len(self.batcher))
        if done is not None:  # one pipeline period: the step time its streams see
            self._observe(len(done.streams), self.batcher.context_tokens(), seconds, rows, cost)
        return True

    def _sweep_audio(self) -> None:
        """Idle: no codec slot outlives its stream (the loop thread opens them too)."""
        if self.codec is not None and len(self.codec):
            gone = self.codec.retain(self.batcher.request_ids())
            if gone:
                log.warning("codec slots of streams no longer decoding freed", extra={"request_ids": gone})

    def _end_failed_audio(self, request_id: int) -> None:
        """The codec failed on a stream (its StreamError is out): it ends as a cancelled one."""
        if self.batcher.cancel(request_id):
            self.loop.work.set()

    def _observe_delivery(self, out: StepOutput) -> None:
        """A published step's ended streams, and now and then the running ones: the rates
        they delivered feed admission's budget (engine/decode/rate_feedback.py)."""
        if self.admission is not None:
            self.admission.observe_delivery(out.ended, self.batcher.running.values)

    def _observe(self, streams: int, context_tokens: int, seconds: float, rows: int,
                 codec: StepCost | None = None, waiting: int = 0) -> None:
        """One step into the step model: its decoding streams, their context, the prompt
        rows it computed (a mixed or prefill-only step's per-row cost) and its codec cost;
        `waiting`: the streams that were decoding when a prefill-only step began (its
        own prompts' streams never count: their first frame waits, not their rate)."""
        if self.row_budget is not None:
            self.row_budget.observe(rows)
        if self.admission is not None:
            if not streams and waiting:  # a prefill-only step its decoding streams wait for
                self._stall_ms += seconds * 1000
            if streams:
                if self.policy == "prefill-first":
                    self.admission.observe_stall(self._stall_ms, streams)
                elif self.policy == "chunked":  # the rows beside them (a step without streams stalls no one)
                    self.admission.observe_rows(rows, streams)
                self._stall_ms = 0.0
            self.admission.observe(streams, context_tokens, seconds * 1000, rows, codec=codec)

    # ------------------------------------------------------------------ info
    def info(self) -> pb.InfoReply:
        with self._lock:
            ids = [p.job.request_id for p in self.prefilling]
        ids += self.waiting.request_ids() + self.batcher.request_ids()
        return pb.InfoReply(
            role="monolith", instance_id=self.instance_id, peer_instance_id=self.instance_id,
            queue=len(self.waiting) + len(self.prefilling), in_flight=len(self.batcher),
            held_pages=self.pool.held_pages, pool_pages=self.pool.n_pages, free_pages=self.pool.free_pages,
            transfer_mode="none", headroom_streams=self.headroom(),
            request_ids=pack(np.array(sorted(set(ids)), dtype=np.uint64), "u8"),
        )

    def hello(self) -> pb.HelloReply:
        mc = self.model.config
        return pb.HelloReply(
            instance_id=self.instance_id, n_codebooks=mc.n_codebooks,
            vocab_sizes=pack(np.array(mc.vocab_sizes, dtype=np.int64), "i8"), eos_id=mc.eos_id,
            model=self.model_spec, audio_format=self.audio_format,
            **hello_rules(self.model.row_rule, self.model.depth_sampling),
            frame_rate_hz=real_time_fps(self.audio_format.frame_rate_hz if self.audio_format else None,
                                        self.model.frame_rate_hz),
        )
