"""P's pipeline: three stages in threads of their own, so that the GPU runs forwards
back to back, and the requests between them.
1. reserve (one thread): the next queued request, its prefix lease and its RESERVE on a D
   (links.py), into the batch the next forward takes (handoff.OpenBatch).
2. forward: one forward per batch; each request goes on with a CUDA event after which
   its rows are in P's storage.
3. transfer (`transfer_workers` threads, each on its own CUDA stream): one request's
   write, checksum, and COMMIT (handed to the commit pool), so a stalled write holds up
   only its own request. A request cancelled or past its deadline is ended between
   stages (no forward or write spent on it); stopping ends those left and tells D.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from pdunit.engine import metrics as m
from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.kv.pool import NoCapacity
from pdunit.engine.kv.prefix_cache import PrefixCache, PrefixLease
from pdunit.engine.model.prefill_graphs import PrefillGraphRunner
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.observability import now_ns
from pdunit.engine.packing import pack, unpack
from pdunit.engine.prefill.handoff import Handoff, OpenBatch
from pdunit.engine.prefill.links import DecodeLink, DecodeLinks
from pdunit.engine.prefill.runner import PrefillChunk, run_prefill
from pdunit.engine.prefill.scheduler import PrefillJob, PrefillScheduler
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.proto.sampling import sampling_to_pb
from pdunit.engine.step_loop import StepLoop
from pdunit.engine.step_pad import StepPad
from pdunit.engine.transfer.base import KVSender, TransferError

log = logging.getLogger("pdunit.prefill")

_ROOM_POLL_S = 0.005  # reserve stage: how often the queue is looked at while granted requests wait for room


@dataclass
class _Live:
    """A request reserved on a D: what its transfer and COMMIT need. The sender and stub
    are the ones of the D instance that granted the reservation (a re-handshake replaces
    the link's, never this request's)."""

    job: PrefillJob
    lease: PrefixLease
    link: DecodeLink
    sender: KVSender
    stub: pbg.DecodeStub
    dst: np.ndarray
    capability: bytes = b""  # the reservation's write capability (ReserveReply.capability)


@dataclass
class _Computed:
    """A request after its batch's forward: its first frame, its cached rows, and the
    event after which its K/V rows are in P's storage (None on the CPU)."""

    live: _Live
    frame: np.ndarray | None
    cached: int
    written: torch.cuda.Event | None


class PrefillPipeline:
    def __init__(
        self,
        model: TTSModel,
        device: str,
        storage: torch.Tensor,
        cache: PrefixCache,
        scheduler: PrefillScheduler,
        links: DecodeLinks,
        kv_check_sample: int = 1,
        transfer_workers: int = 4,
        graphs: PrefillGraphRunner | None = None,
        forward: Callable[..., list[np.ndarray | None]] | None = None,
        reserve_concurrency: int = 1,
    ) -> None:
        """`forward`: run_prefill's stand-in (`pdunit bench pipeline` times the pipeline
        around a forward of a modelled duration); the real one when None.
        `reserve_concurrency`: queued requests whose RESERVEs go out at once."""
        if transfer_workers < 1:
            raise ValueError(f"transfer_workers must be >= 1 (got {transfer_workers})")
        if reserve_concurrency < 1:
            raise ValueError(f"reserve_concurrency must be >= 1 (got {reserve_concurrency})")
        self.reserve_concurrency = reserve_concurrency
        self.model = model
        self.device = device
        self.storage = storage
        self.cache = cache
        self.scheduler = scheduler
        self.links = links
        self.graphs = graphs  # --prefill-graphs: small forwards replay a captured graph
        self._forward = forward or run_prefill
        self.kv_check_sample = kv_check_sample
        self.active: dict[int, PrefillJob] = {}  # taken from the queue, not finished
        self.cancel_reasons: dict[int, tuple[pb.Status, str]] = {}  # why an active job was cancelled
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._open: OpenBatch[_Live] = OpenBatch(scheduler.max_batch_prompts, scheduler.max_batch_rows)
        self._computed: Handoff[_Computed] = Handoff(2 * scheduler.max_batch_prompts)
        # Each stage blocks on its own queue (scheduler, OpenBatch, Handoff) until work
        # comes, so its loop must not sleep again when it comes back idle: nothing would
        # wake that second sleep (docs/performance.md: up to 50 ms at each stage).
        self.reserve_loop = StepLoop("prefill-reserve", self._reserve_once, device, idle_wait=False)
        self.forward_loop = StepLoop("prefill", self._forward_once, device, idle_wait=False)
        self.transfer_loops = [StepLoop(f"prefill-transfer-{i}", self._transfer_once, device, idle_wait=False)
                               for i in range(transfer_workers)]
        self.loops = (self.reserve_loop, self.forward_loop, *self.transfer_loops)
        self._cuda = str(device).startswith("cuda")
        self._worker_state = threading.local()  # each transfer worker's CUDA stream
        self._committer = ThreadPoolExecutor(max_workers=4, thread_name_prefix="prefill-commit")
        self._reserver = ThreadPoolExecutor(max_workers=reserve_concurrency, thread_name_prefix="prefill-reserve")
        self.forward_pad = StepPad()  # --synthetic-forward-ms (tests and benchmarks; engine/step_pad.py): off
        self._gap_from = 0  # ns: the last forward's end when the next batch was waiting for it, else 0

    # ------------------------------------------------------------------ start, stop
    def start(self) -> None:
        for loop in self.loops:
            loop.start()

    def stop(self) -> None:
        """Stops the stages front to back (nothing new is reserved, then nothing new is
        computed, then nothing new is written), ends the requests left between them
        (D frees their reservations), and waits for the COMMITs in flight."""
        self._stopping.set()
        for loop in self.loops:
            loop.stop()
        left = self._open.take(0) + [item.live for item in self._computed.take_all()]
        for live in left:
            self._abandon(live, "prefill is shutting down")
        self._committer.shutdown(wait=True)
        self._reserver.shutdown(wait=True)

    # ------------------------------------------------------------------ the requests in it
    def request_ids(self) -> list[int]:
        """The requests taken from the queue and not finished."""
        with self._lock:
            return list(self.active)

    def mark_cancelled(self, request_id: int, status: pb.Status, reason: str) -> PrefillJob | None:
        """Marks a request in the pipeline cancelled (ended at its next stage, with
        `status` and `reason`); returns it, None when it is not in the pipeline."""
        with self._lock:
            job = self.active.get(request_id)
            if job is not None:
                job.cancelled = True
                self.cancel_reasons[request_id] = (status, reason)
        return job

    def finish(self, job: PrefillJob, status: pb.Status, message: str = "", **fields: int) -> None:
        """The request's end: counted, forgotten here and by the links, answered."""
        m.P_REQUESTS.labels(outcome=pb.Status.Name(status).lower()).inc()
        with self._lock:
            self.active.pop(job.request_id, None)
            self.cancel_reasons.pop(job.request_id, None)
        self.links.forget(job.request_id)
        if job.done is not None:
            job.done(pb.SubmitReply(status=status, message=message, stamps=pb.Stamps(ns=job.stamps), **fields))

    def _cancel_reason(self, request_id: int) -> tuple[pb.Status, str]:
        with self._lock:
            return self.cancel_reasons.get(request_id, (pb.CANCELLED, "cancelled by the client"))

    def _abandon(self, live: _Live, reason: str) -> None:
        """A reserved request that will not be written: D may free its pages now."""
        self._tell_decode(live.stub, live.job.request_id, pb.CANCELLED, reason, timeout=1.0)
        self.cache.release(live.lease)
        self.finish(live.job, pb.CANCELLED, reason)

    def _still_wanted(self, live: _Live, before: str) -> bool:
        """False (and the request ended; its lease stays the caller's to release) when it
        was cancelled or its transfer deadline passed: no forward or write is spent on
        it. D fails an expired reservation by itself (same deadline) and asks for the
        abort our quiesce then proves."""
        job = live.job
        if job.cancelled:
            status, reason = self._cancel_reason(job.request_id)
            self.finish(job, status, f"{reason}, before {before}")
            return False
        if self.links.deadline(job) < int(time.time() * 1000):
            self.finish(job, pb.DEADLINE_EXCEEDED, f"transfer deadline passed before {before}")
            return False
        return True

    # ------------------------------------------------------------------ stage 1: reserve
    def _reserve_once(self) -> bool:
        """The next requests from the queue (up to `reserve_concurrency`: a clump's are
        there together), their prefix leases and their RESERVEs on a D, sent at once, then
        added to the batch the next forward takes together; this runs while the current
        forward does. D's verdict comes first: a refusal (RATE_FLOOR, NO_CAPACITY) is
        answered at once, never after a wait for room in the open batch (issue 24). The
        granted wait for room reserved; meanwhile newcomers are reserved too while fewer
        than `reserve_concurrency` wait, so a refusal waits behind a forward only when
        that many granted requests do (with 1, behind the one)."""
        job = self.scheduler.take(timeout=0.05)
        if job is None:
            m.P_QUEUE.set(len(self.scheduler))
            return False
        waiting = self._reserve_group(self._take_more([job], self.reserve_concurrency))
        while waiting:
            waiting = waiting[self._open.add_fitting(waiting):]
            if not waiting:
                break
            if len(waiting) < self.reserve_concurrency and not self._stopping.is_set() \
                    and (more := self.scheduler.take(timeout=0)) is not None:
                waiting += self._reserve_group(self._take_more([more], self.reserve_concurrency - len(waiting)))
                continue
            # with room for newcomers, look at the queue again soon (it wakes no one here)
            poll = _ROOM_POLL_S if len(waiting) < self.reserve_concurrency else 0.05
            if not self._open.wait_for_room(waiting[0][1], poll, self._stopping) and self._stopping.is_set():
                for live, _ in waiting:
                    self._abandon(live, "prefill is shutting down")
                break
        return True

    def _take_more(self, jobs: list[PrefillJob], most: int) -> list[PrefillJob]:
        """`jobs` and the queued ones after them, `most` in all, marked active."""
        while len(jobs) < most and (more := self.scheduler.take(timeout=0)) is not None:
            jobs.append(more)
        with self._lock:
            for j in jobs:
                self.active[j.request_id] = j
        m.P_QUEUE.set(len(self.scheduler))
        return jobs

    def _reserve_group(self, jobs: list[PrefillJob]) -> list[tuple[_Live, int]]:
        """Leases and RESERVEs `jobs` at once; the granted, in order, with their rows (the
        others ended here: a refusal's stamps say where its time went, docs/admission.md)."""
        taken = now_ns()
        t0 = time.perf_counter()
        leased = [(j, lease) for j in jobs if (lease := self._lease(j)) is not None]
        sent = now_ns()
        if len(leased) > 1:
            replies = list(self._reserver.map(lambda jl: self.links.reserve(jl[0]), leased))
        else:
            replies = [self.links.reserve(j) for j, _ in leased]
        reserved: list[tuple[_Live, int]] = []
        for (j, lease), r in zip(leased, replies, strict=True):
            if r.link is None or r.reply.status != pb.STATUS_OK:
                j.stamps.update(p_taken=taken, p_reserve_sent=sent, p_reserve_answered=now_ns())
                self.cache.release(lease)
                self.finish(j, r.reply.status, r.reply.message)
                continue
            assert r.sender is not None and r.stub is not None
            j.stamps["p_reserved"] = now_ns()
            reserved.append((_Live(j, lease, r.link, r.sender, r.stub, unpack(r.reply.dst_slots, "i8"),
                                   r.reply.capability), len(j.prompt)))
        for _ in reserved:
            m.P_STAGE_SECONDS.labels(stage="reserve").observe(time.perf_counter() - t0)
        return reserved

    def _lease(self, job: PrefillJob) -> PrefixLease | None:
        """The job's prefix lease, or None (and the job ended) when it was cancelled, its
        deadline passed, or P's cache is full."""
        if job.cancelled:
            self.finish(job, *self._cancel_reason(job.request_id))
            return None
        if job.deadline_unix_ms and int(time.time() * 1000) > job.deadline_unix_ms:
            self.finish(job, pb.DEADLINE_EXCEEDED, "deadline passed while queued in prefill")
            return None
        try:
            return self.cache.acquire(job.prompt)
        except NoCapacity as exc:
            self.finish(job, pb.NO_CAPACITY, f"prefill cache full: {exc}")
            return None

    # ------------------------------------------------------------------ stage 2: forward
    def _forward_once(self) -> bool:
        """One forward over a reserved batch, back to back with the next one; its rows and
        first frames go to the transfer stage."""
        if not self._computed.wait_for_room(self._open.max_items, 0.05, self._stopping):
            return True
        live = self._open.take(0.05)
        if not live:
            return False
        wanted = []
        for x in live:
            if self._still_wanted(x, "its forward"):
                wanted.append(x)
            else:
                self.cache.release(x.lease)
        live = wanted
        if not live:
            return True
        chunks = [PrefillChunk(x.job.prompt, x.lease.slots, min(x.lease.cached_tokens, len(x.job.prompt) - 1),
                               len(x.job.prompt), x.job.params) for x in live]
        t0 = now_ns()
        if self._gap_from:
            m.P_FORWARD_GAP_SECONDS.observe((t0 - self._gap_from) / 1e9)
            self._gap_from = 0
        for x in live:
            x.job.stamps["prefill_start"] = t0
        padded_from = time.perf_counter()
        frames = self._forward(self.model, self.storage, chunks, self.graphs)
        self.forward_pad.wait(padded_from, len(chunks), sum(c.end - c.start for c in chunks))
        # The rows are on the default stream; the transfer stage's stream waits for this.
        written = None
        if self.storage.is_cuda:
            written = torch.cuda.Event()
            written.record()
        t1 = now_ns()
        m.P_PREFILL_SECONDS.observe((t1 - t0) / 1e9)
        for x, chunk in zip(live, chunks, strict=True):
            x.job.stamps["prefill_end"] = t1
            m.P_PREFILL_TOKENS.labels(source="computed").inc(chunk.end - chunk.start)
            m.P_PREFILL_TOKENS.labels(source="cached").inc(chunk.start)
            self.cache.publish(x.lease, x.job.prompt)
        for x, frame, chunk in zip(live, frames, chunks, strict=True):
            self._computed.put(_Computed(x, frame, chunk.start, written))
        # The next batch already reserved once this forward's results are handed on: the
        # time to the next forward's start is P's own overhead, the GPU idle with requests
        # waiting (counted from the forward's end, so this bookkeeping is in it).
        self._gap_from = t1 if len(self._open) > 0 else 0
        return True

    # ------------------------------------------------------------------ stage 3: transfer
    def _transfer_once(self) -> bool:
        """One request's rows to its D (on CUDA on this worker's own stream), the checksum,
        and the COMMIT handed to the commit pool, beside the next forward."""
        item = self._computed.get(0.05)
        if item is None:
            return False
        t0 = time.perf_counter()
        stream = self._stream()
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None and item.written is not None:
                    stream.wait_event(item.written)
                self._transfer_and_commit(item.live, item.frame, item.cached)
        finally:
            self.cache.release(item.live.lease)
        m.P_STAGE_SECONDS.labels(stage="transfer").observe(time.perf_counter() - t0)
        return True

    def _stream(self) -> torch.cuda.Stream | None:
        if not self._cuda:
            return None
        stream = getattr(self._worker_state, "stream", None)
        if stream is None:
            stream = self._worker_state.stream = torch.cuda.Stream(self.device)
        return stream

    def _transfer_and_commit(self, live: _Live, frame: np.ndarray | None, cached: int) -> None:
        job, link, sender, stub = live.job, live.link, live.sender, live.stub
        assert frame is not None
        rid = job.request_id
        if not self._still_wanted(live, "the write started"):
            return
        job.stamps["transfer_start"] = now_ns()
        try:
            sender.write(rid, self.storage, live.lease.slots, live.dst, self.links.deadline(job),
                         capability=live.capability)
        except TransferError as exc:
            log.warning("transfer failed", extra={"request_id": rid, "error": str(exc)})
            # D holds the pages and sends ABORT; our quiesce answers it. Told from the
            # commit pool: the next request's write must not wait for this round trip.
            self._committer.submit(self._tell_decode, stub, rid, pb.TRANSFER_FAILED, f"KV transfer failed: {exc}")
            self.finish(job, pb.TRANSFER_FAILED, f"KV transfer failed: {exc}")
            return
        job.stamps["transfer_end"] = now_ns()
        m.P_TRANSFER_SECONDS.labels(mode=sender.mode).observe(
            (job.stamps["transfer_end"] - job.stamps["transfer_start"]) / 1e9)
        m.P_TRANSFER_BYTES.labels(mode=sender.mode).inc(
            self.storage[:, :, :1].numel() * self.storage.element_size() * len(live.lease.slots))
        checksum = kv_checksum(self.storage, live.lease.slots, self.kv_check_sample)
        # The rows are in D and the checksum is taken: P's storage is no longer read, so
        # the COMMIT round trip (D checks its copy) runs beside the next write/prefill.
        self._committer.submit(self._commit, job, stub, link, frame, checksum, cached)

    @staticmethod
    def _tell_decode(stub: pbg.DecodeStub, request_id: int, status: pb.Status, message: str,
                     timeout: float = 2.0) -> None:
        """Cancel to the D holding the request's reservation; unanswered, D frees it at its
        deadline (or holds it and asks for the abort our quiesce proves)."""
        try:
            stub.Cancel(pb.CancelRequest(request_id=request_id, status=status, message=message), timeout=timeout)
        except grpc.RpcError:
            pass

    def _commit(self, job: PrefillJob, stub: pbg.DecodeStub, link: DecodeLink, frame: np.ndarray,
                checksum: int, cached: int) -> None:
        rid = job.request_id
        try:
            reply = stub.Commit(pb.CommitRequest(
                request_id=rid, first_frame=pack(frame, "i4"), checksum=checksum,
                checksum_sample=self.kv_check_sample, sampling=sampling_to_pb(job.params),
                prompt_tokens=len(job.prompt), identity=self.links.identity(link.instance, job.deadline_unix_ms),
                stamps=pb.Stamps(ns=job.stamps), audio=job.audio), timeout=5.0)
        except grpc.RpcError as exc:
            self.finish(job, pb.TRANSFER_FAILED, f"commit failed: {exc.code()}")
            return
        except Exception as exc:  # a pool thread: nothing else would ever see it
            log.exception("commit crashed", extra={"request_id": rid})
            self.finish(job, pb.TRANSFER_FAILED, f"commit failed: {exc}")
            return
        if reply.status != pb.STATUS_OK:
            self.finish(job, reply.status, reply.message or pb.Status.Name(reply.status))
            return
        self.finish(job, pb.STATUS_OK, prefill_tokens=len(job.prompt) - cached, cached_tokens=cached)
