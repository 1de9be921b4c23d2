"""P: the prefill engine of a unit. Admits prompts while a forward runs, serves reused
voices from the prefix cache, computes KV + first frame, and hands both to D through
RESERVE -> write -> COMMIT(checksum) (PROTOCOL.md section 3).

P answers D's ABORT with ABORT_ACK only when its transport proves that no write of that
request can land any more (batch quiesce). It never answers from a timeout. When it
holds `max_held_aborts` unanswered aborts it exits on purpose: its restart (a new
instance id) is the proof D needs for all of them.

Threads: gRPC handlers on the asyncio loop, and a pipeline of three stages so that the
GPU runs forwards back to back:
1. reserve (one thread): takes queued requests one at a time, leases their prefix and
   RESERVEs them on a D, into the batch the next forward takes (handoff.OpenBatch), while
   the current forward runs. A request's transfer deadline, fixed at RESERVE, therefore
   covers its wait for the forward in progress and its own forward.
2. forward (the step loop): one forward per batch; each request goes on to stage 3 with
   a CUDA event after which its rows are in P's storage.
3. transfer (`transfer_workers` threads, each on a CUDA stream of its own): one
   request's write, checksum, and its COMMIT handed to the commit pool. Several workers
   so that a stalled write holds up only its own request.
A request cancelled or past its deadline between stages is ended there (no forward or
write spent on it); stopping P ends the requests left between stages and tells D.

P never injects faults itself: the fault-injection suite wraps the sender it attaches
(`attach_sender`, in pdunit.bench.fault_injection), so no test hook sits on this path.

Several D's (1P2D, `--decode-socket a.sock,b.sock`): P handshakes with each (one
`DecodeLink`: stub, sender, D instance id, load as last reported) and picks one D per
request at RESERVE: not unresponsive, not draining, most free pages, fewest streams
(from Reserve replies and a periodic Info probe). NO_CAPACITY, DRAINING, RATE_FLOOR or
an unreachable D before any write moves the request to the next D; after the first write a
request never changes D. Every guarantee of PROTOCOL.md holds per D: identities are
checked per D instance, an ABORT is answered with the quiesce proof of the sender of the
D that sent it (every sender when the D is unknown), and it cancels the request only
when that D is the one it was routed to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from prometheus_client import Counter

from pdunit.engine import metrics as m
from pdunit.engine.grpc_server import sync_channel
from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.kv.pool import NoCapacity
from pdunit.engine.kv.prefix_cache import PrefixCache, PrefixLease
from pdunit.engine.model.config import dtype_name
from pdunit.engine.model.prefill_graphs import PrefillGraphRunner
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.observability import now_ns
from pdunit.engine.packing import pack, unpack
from pdunit.engine.prefill.handoff import Handoff, OpenBatch
from pdunit.engine.prefill.runner import PrefillChunk, run_prefill
from pdunit.engine.prefill.scheduler import PrefillJob, PrefillScheduler
from pdunit.engine.prefill.submit import serve_submit
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.settings import decode_names, parse_decode_sockets
from pdunit.engine.step_loop import StepLoop
from pdunit.engine.transfer.base import (
    Descriptor,
    KVSender,
    PoolGeometry,
    TransferError,
)
from pdunit.engine.transfer.factory import make_sender

log = logging.getLogger("pdunit.prefill")

EXIT_HELD_ABORTS = 75  # P exits on purpose: its restart proves every held abort

P_ROUTED = m.role_metric(Counter("pdunit_prefill_decode_routed_total", "Requests P reserved on each D", ["decode"],
                                 registry=None), "prefill")
P_FALLBACKS = m.role_metric(Counter("pdunit_prefill_decode_fallbacks_total",
                                    "Reservations moved to another D before any write, by the first D's answer",
                                    ["decode", "reason"], registry=None), "prefill")


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


class PeerMismatch(RuntimeError):
    """P and D disagree on the model or pool geometry: no transfer can be correct."""


@dataclass
class DecodeLink:
    """One D that P feeds: its channel, P's sender into its pool, its instance id, and its
    load as last reported (Info probe, Reserve replies). Only the reserve thread (and
    `connect` before it starts) replaces `stub`, `sender` and `instance`; a request keeps
    the sender and stub it was reserved with (`_Live`)."""

    index: int
    socket: str
    name: str
    stub: pbg.DecodeStub | None = None
    sender: KVSender | None = None
    instance: str = ""
    page_size: int = 1
    pool_pages: int = 0
    free_pages: int = 0
    streams: int = 0                 # decoding + reserved in D, as last reported
    draining: bool = False
    responsive: bool = True          # False from a failed RPC until a probe answers again
    routed: set[int] = field(default_factory=set)  # P's requests reserved here, not finished
    reserved_total: int = 0          # tie-break: equal D's take turns

    def order_key(self) -> tuple:
        """Smaller is better: responsive, not draining, most free pages, fewest streams."""
        return (not self.responsive, self.draining, -self.free_pages, self.streams + len(self.routed),
                self.reserved_total, self.index)

    def observe(self, info: pb.InfoReply) -> None:
        self.pool_pages, self.free_pages = info.pool_pages, info.free_pages
        self.streams = info.in_flight + info.queue
        self.draining = info.draining
        self.responsive = True


class PrefillEngine:
    def __init__(
        self,
        model: TTSModel,
        model_spec: str,
        device: str,
        storage: torch.Tensor,
        cache: PrefixCache,
        scheduler: PrefillScheduler,
        decode_socket: str,
        transfer: str,
        sender_options: dict[str, str],
        kv_check_sample: int = 1,
        max_held_aborts: int = 3,
        held_abort_grace_s: float = 1.0,
        transfer_deadline_ms: int = 0,
        decode_probe_interval_s: float = 0.5,
        transfer_workers: int = 4,
        graphs: PrefillGraphRunner | None = None,
        forward: Callable[..., list[np.ndarray | None]] | None = None,
    ) -> None:
        """`forward`: run_prefill's stand-in (`pdunit bench pipeline` times P's pipeline
        around a forward of a modelled duration); the real one when None."""
        if transfer_workers < 1:
            raise ValueError(f"transfer_workers must be >= 1 (got {transfer_workers})")
        self.instance_id = uuid.uuid4().hex
        self.model = model
        self.graphs = graphs  # --prefill-graphs: small forwards replay a captured graph
        self._forward = forward or run_prefill
        self.model_spec = model_spec
        self.device = device
        self.storage = storage
        self.cache = cache
        self.scheduler = scheduler
        self.decode_socket = decode_socket
        self.transfer = transfer
        self.sender_options = sender_options
        self.kv_check_sample = kv_check_sample
        self.max_held_aborts = max_held_aborts
        self.held_abort_grace_s = held_abort_grace_s
        self.transfer_deadline_ms = transfer_deadline_ms
        self.transfer_deadlines: dict[int, int] = {}  # request id -> deadline sent in RESERVE
        self.cancel_reasons: dict[int, tuple[int, str]] = {}  # why an active job was cancelled
        sockets = parse_decode_sockets(decode_socket)
        self.links = [DecodeLink(i, sock, name)
                      for i, (sock, name) in enumerate(zip(sockets, decode_names(len(sockets)), strict=True))]
        self.routes: dict[int, DecodeLink] = {}  # request id -> the D it was reserved on
        self.decode_probe_interval_s = decode_probe_interval_s
        self.active: dict[int, PrefillJob] = {}
        self.held_aborts: dict[tuple[str, int], float] = {}  # (D instance, request id) -> since
        self._lock = threading.Lock()
        self._probe_stop = threading.Event()
        self._probe_thread: threading.Thread | None = None
        # Three stages in threads of their own: RESERVE of batch n+1's requests (as they
        # arrive) and the transfers of batch n-1 run while batch n's forward does. The
        # transfers run in `transfer_workers` threads, one request each, so a write that
        # stalls holds up only its own request, not every request reserved behind it.
        self._stopping = threading.Event()
        self._open: OpenBatch[_Live] = OpenBatch(scheduler.max_batch_prompts, scheduler.max_batch_rows)
        self._computed: Handoff[_Computed] = Handoff(2 * scheduler.max_batch_prompts)
        # Each stage blocks on its own queue (scheduler, OpenBatch, Handoff) until work
        # comes, so its loop must not sleep again when it comes back idle: that second
        # sleep, which nothing wakes, held a request up to 50 ms at each stage (a
        # request at an idle P: ~12 ms more at p50 before its RESERVE and again before
        # its forward, found with --sample-stacks against bench plan's model of P).
        self.reserve_loop = StepLoop("prefill-reserve", self._reserve_once, device, idle_wait=False)
        self.loop = StepLoop("prefill", self._step_once, device, idle_wait=False)
        self.transfer_loops = [StepLoop(f"prefill-transfer-{i}", self._transfer_once, device, idle_wait=False)
                               for i in range(transfer_workers)]
        self.loops = (self.reserve_loop, self.loop, *self.transfer_loops)
        self._cuda = str(device).startswith("cuda")
        self._worker_state = threading.local()  # each transfer worker's CUDA stream
        self._committer = ThreadPoolExecutor(max_workers=4, thread_name_prefix="prefill-commit")
        self._gap_from = 0  # ns: the last forward's end when the next batch was waiting for it, else 0

    # One D (the 1P1D unit): the names the rest of the process used before 1P2D.
    @property
    def sender(self) -> KVSender | None:
        return self.links[0].sender

    @property
    def d_instance(self) -> str:
        return ",".join(link.instance for link in self.links)

    @property
    def transfer_mode(self) -> str:
        modes = [link.sender.mode for link in self.links if link.sender is not None]
        return ",".join(dict.fromkeys(modes))

    # ------------------------------------------------------------------ handshake
    def connect(self, timeout_s: float = 120.0) -> None:
        """Hello to every D until it answers; checks model and geometry; attaches a
        sender per D. P serves only once every D answered."""
        for link in self.links:
            self._connect_link(link, timeout_s)

    def _connect_link(self, link: DecodeLink, timeout_s: float = 120.0) -> None:
        if link.stub is None:
            link.stub = pbg.DecodeStub(sync_channel(link.socket))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                hello = link.stub.Hello(pb.HelloRequest(sender_instance=self.instance_id), timeout=2.0)
                break
            except grpc.RpcError as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"decode at {link.socket} did not answer Hello: {exc.code()}") from None
                time.sleep(0.2)
        mc = self.model.config
        g = hello.geometry
        if hello.model != self.model_spec:
            raise PeerMismatch(f"P runs model {self.model_spec!r} but D at {link.socket} runs {hello.model!r}")
        if (g.n_layers, g.n_kv_heads, g.head_dim) != (mc.n_layers, mc.n_kv_heads, mc.head_dim):
            raise PeerMismatch(f"D pool geometry {g} at {link.socket} does not match the model {mc.name}")
        if g.dtype != dtype_name(self.storage.dtype):
            raise PeerMismatch(f"D pool dtype {g.dtype} at {link.socket} != P pool dtype {dtype_name(self.storage.dtype)}: "
                               "run P and D with the same --dtype and --kv-cache-dtype")
        geometry = PoolGeometry(g.n_layers, g.n_kv_heads, g.head_dim, self.storage.dtype, g.n_slots, g.page_size)
        offered = [Descriptor(t.mode, dict(t.params), t.handle) for t in hello.transports]
        if link.sender is not None:
            link.sender.close()
        link.sender = self.attach_sender(offered, geometry)
        if self.transfer not in ("auto", link.sender.mode):
            raise PeerMismatch(f"asked for transfer {self.transfer!r} but D at {link.socket} offers "
                               f"{[d.mode for d in offered]}")
        m.P_TRANSFER_MODE.labels(decode=link.name).state(link.sender.mode)
        link.instance = hello.instance_id
        link.page_size = max(1, g.page_size)
        link.pool_pages = link.free_pages = max(0, g.n_slots // link.page_size)
        link.responsive = True
        log.info("connected to decode", extra={"decode": link.name, "socket": link.socket,
                                               "d_instance": link.instance, "transfer": link.sender.mode})

    def attach_sender(self, offered: list[Descriptor], geometry: PoolGeometry) -> KVSender:
        """The sender to one D among the transports it offered: `--transfer`'s, or D's
        best for auto."""
        return make_sender(offered if self.transfer == "auto" else
                           [d for d in offered if d.mode == self.transfer] or offered,
                           geometry, self.device, self.sender_options)

    # ------------------------------------------------------------------ D load probe
    def start_probe(self) -> None:
        """With several D's: a thread asks every D for Info each `decode_probe_interval_s`
        (free pages, streams, draining, responsiveness) for the choice at RESERVE."""
        if len(self.links) < 2 or self._probe_thread is not None:
            return
        self._probe_thread = threading.Thread(target=self._probe_loop, name="decode-probe", daemon=True)
        self._probe_thread.start()

    def stop_probe(self) -> None:
        self._probe_stop.set()
        if self._probe_thread is not None:
            self._probe_thread.join(timeout=5)

    def _probe_loop(self) -> None:
        while not self._probe_stop.wait(self.decode_probe_interval_s):
            for link in self.links:
                self.probe_decode(link)

    def probe_decode(self, link: DecodeLink) -> None:
        stub = link.stub
        if stub is None:
            return
        try:
            info = stub.Info(pb.Empty(), timeout=max(0.2, min(1.0, 2 * self.decode_probe_interval_s)))
        except grpc.RpcError as exc:
            if link.responsive:
                log.warning("decode does not answer Info: new requests go to the other decoders first",
                            extra={"decode": link.name, "code": str(exc.code())})
            link.responsive = False
            return
        if not link.responsive:
            log.info("decode answers again", extra={"decode": link.name})
        link.observe(info)

    def _ordered_links(self) -> list[DecodeLink]:
        return sorted(self.links, key=DecodeLink.order_key)

    # ------------------------------------------------------------------ requests
    def submit(self, job: PrefillJob) -> None:
        job.stamps["p_admitted"] = now_ns()
        self.scheduler.put(job)
        m.P_QUEUE.set(len(self.scheduler))

    def cancel(self, request_id: int, status: int = pb.CANCELLED, reason: str = "cancelled by the client") -> bool:
        job = self.scheduler.cancel(request_id)
        if job is not None:
            self._finish(job, status, reason)
            return True
        with self._lock:
            job = self.active.get(request_id)
            if job is not None:
                job.cancelled = True
                self.cancel_reasons[request_id] = (status, reason)
            link = self.routes.get(request_id)
        if job is not None:
            # Reserved on a D: only that D's sender can hold a write of it. Not reserved
            # yet: none can, and the worker checks `cancelled` before RESERVE and before
            # the write; quiescing every sender keeps a late RESERVE from writing anyway.
            for target in [link] if link is not None else self.links:
                if target.sender is not None:
                    target.sender.quiesce(request_id)
        return job is not None

    def abort(self, request: pb.AbortRequest) -> pb.AbortReply:
        rid = request.request_id
        addressed = request.identity.receiver_instance
        if addressed and addressed != self.instance_id:
            # Meant for an earlier P (D has not seen this instance yet): this process never
            # wrote that request, and our id in the reply is D's proof (b) for it.
            return pb.AbortReply(ack=False, instance_id=self.instance_id)
        d_instance = request.identity.sender_instance
        # The D that sent the ABORT; unknown (an older D, or none named): every sender must
        # prove quiescence, since any of them could have written the request.
        links = [link for link in self.links if d_instance and link.instance == d_instance] or list(self.links)
        with self._lock:
            routed = self.routes.get(rid)
        if routed is None or routed in links:
            # A request moved to another D before any write (the first D's RESERVE timed
            # out) must not be cancelled by the first D's ABORT: it is alive elsewhere.
            self.cancel(rid, pb.TRANSFER_FAILED, "decode aborted the transfer (it failed there: deadline, "
                        "checksum or cancel)")
        ack = True
        for link in links:  # every one is asked: quiesce also bars later writes
            ack = (link.sender.quiesce(rid) if link.sender is not None else True) and ack
        key = (d_instance, rid)
        now = time.monotonic()
        with self._lock:
            if ack:
                self.held_aborts.pop(key, None)
            else:
                self.held_aborts.setdefault(key, now)
            overdue = [r for (_, r), t in self.held_aborts.items() if now - t >= self.held_abort_grace_s]
            m.P_HELD_ABORTS.set(len(self.held_aborts))
        m.P_ABORTS.labels(answer="ack" if ack else "held").inc()
        if len(overdue) >= self.max_held_aborts:
            log.critical("exiting on purpose: too many held aborts (the restart proves them all)", extra={
                "held_aborts": overdue, "limit": self.max_held_aborts, "event": "PrefillHeldAbortExit"})
            logging.shutdown()
            os._exit(EXIT_HELD_ABORTS)
        return pb.AbortReply(ack=ack, instance_id=self.instance_id)

    def _cancel_reason(self, request_id: int) -> tuple[int, str]:
        with self._lock:
            return self.cancel_reasons.get(request_id, (pb.CANCELLED, "cancelled by the client"))

    def _finish(self, job: PrefillJob, status: int, message: str = "", **fields: int) -> None:
        m.P_REQUESTS.labels(outcome=pb.Status.Name(status).lower()).inc()
        with self._lock:
            self.active.pop(job.request_id, None)
            self.transfer_deadlines.pop(job.request_id, None)
            self.cancel_reasons.pop(job.request_id, None)
            link = self.routes.pop(job.request_id, None)
            if link is not None:
                link.routed.discard(job.request_id)
        if job.done is not None:
            job.done(pb.SubmitReply(status=status, message=message, stamps=pb.Stamps(ns=job.stamps), **fields))

    # ------------------------------------------------------------------ the worker loop
    def _identity(self, link: DecodeLink, deadline_ms: int) -> pb.Identity:
        return pb.Identity(sender_instance=self.instance_id, receiver_instance=link.instance,
                           budget_ms=max(0, deadline_ms - int(time.time() * 1000)))

    def _transfer_deadline(self, job: PrefillJob) -> int:
        """The transfer's deadline, fixed at RESERVE: D enforces the same one (it fails
        the reservation when the deadline passes without COMMIT)."""
        deadline = job.deadline_unix_ms
        if self.transfer_deadline_ms:
            deadline = min(deadline or 2**62, int(time.time() * 1000) + self.transfer_deadline_ms)
        return deadline

    def _reserve(self, job: PrefillJob) -> tuple[DecodeLink | None, pb.ReserveReply]:
        """RESERVE on the best D; on NO_CAPACITY, DRAINING, RATE_FLOOR or an unreachable D, the next
        one (nothing was written yet, so the request may still change D). Returns the D
        that answered last and its reply; the D is None when none answered."""
        rows = len(job.prompt)
        deadline = self._transfer_deadline(job)
        with self._lock:
            self.transfer_deadlines[job.request_id] = deadline
        failure: pb.ReserveReply | None = None
        for link in self._ordered_links():
            try:
                reply = self._reserve_on(link, job, rows, deadline)
            except grpc.RpcError as exc:
                link.responsive = False
                failure = pb.ReserveReply(status=pb.TRANSFER_FAILED, message=f"decode unreachable: {exc.code()}")
                if len(self.links) > 1:
                    P_FALLBACKS.labels(decode=link.name, reason="unreachable").inc()
                    log.warning("decode did not answer RESERVE: trying the next one", extra={
                        "request_id": job.request_id, "decode": link.name, "code": str(exc.code())})
                continue
            if reply.status == pb.STATUS_OK:
                pages = -(-(rows + job.params.max_frames) // link.page_size)
                link.free_pages = max(0, link.free_pages - pages)
                link.reserved_total += 1
                with self._lock:
                    self.routes[job.request_id] = link
                    link.routed.add(job.request_id)
                P_ROUTED.labels(decode=link.name).inc()
                return link, reply
            if reply.status not in (pb.NO_CAPACITY, pb.DRAINING, pb.RATE_FLOOR):
                return link, reply
            if reply.status == pb.NO_CAPACITY:
                link.free_pages = 0
            elif reply.status == pb.DRAINING:
                link.draining = True
            failure = reply
            if len(self.links) > 1:
                P_FALLBACKS.labels(decode=link.name, reason=pb.Status.Name(reply.status).lower()).inc()
        assert failure is not None
        return None, failure

    def _reserve_on(self, link: DecodeLink, job: PrefillJob, rows: int, deadline: int) -> pb.ReserveReply:
        assert link.stub is not None
        for attempt in range(2):
            reply = link.stub.Reserve(pb.ReserveRequest(
                request_id=job.request_id, n_tokens=rows, total_tokens=rows + job.params.max_frames,
                deadline_unix_ms=deadline, identity=self._identity(link, deadline)),
                timeout=5.0)
            if reply.status != pb.STALE_INSTANCE or attempt:
                return reply
            log.warning("decode restarted: handshaking again", extra={"request_id": job.request_id,
                                                                      "decode": link.name})
            self._connect_link(link)
        return reply

    # ------------------------------------------------------------------ the pipeline
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

    def _abandon(self, live: _Live, reason: str) -> None:
        """A reserved request that will not be written: D may free its pages now."""
        self._tell_decode(live.stub, live.job.request_id, pb.CANCELLED, reason, timeout=1.0)
        self.cache.release(live.lease)
        self._finish(live.job, pb.CANCELLED, reason)

    def _reserve_once(self) -> bool:
        """Stage 1 (its own thread): the next request from the queue, its prefix lease and
        its RESERVE on a D, added to the batch the next forward takes; this runs while
        the current forward does."""
        jobs = self.scheduler.next_batch(timeout=0.05, max_prompts=1)
        m.P_QUEUE.set(len(self.scheduler))
        if not jobs:
            return False
        job = jobs[0]
        with self._lock:
            self.active[job.request_id] = job
        rows = len(job.prompt)
        while not self._open.wait_for_room(rows, 0.05, self._stopping):
            if self._stopping.is_set():
                self._finish(job, pb.CANCELLED, "prefill is shutting down")
                return True
        t0 = time.perf_counter()
        if job.cancelled:
            self._finish(job, *self._cancel_reason(job.request_id))
            return True
        if job.deadline_unix_ms and int(time.time() * 1000) > job.deadline_unix_ms:
            self._finish(job, pb.DEADLINE_EXCEEDED, "deadline passed while queued in prefill")
            return True
        try:
            lease = self.cache.acquire(job.prompt)
        except NoCapacity as exc:
            self._finish(job, pb.NO_CAPACITY, f"prefill cache full: {exc}")
            return True
        link, reply = self._reserve(job)
        if link is None or reply.status != pb.STATUS_OK:
            self.cache.release(lease)
            self._finish(job, reply.status, reply.message)
            return True
        assert link.sender is not None and link.stub is not None
        job.stamps["p_reserved"] = now_ns()
        self._open.add(_Live(job, lease, link, link.sender, link.stub, unpack(reply.dst_slots, "i8"),
                             reply.capability), rows)
        m.P_STAGE_SECONDS.labels(stage="reserve").observe(time.perf_counter() - t0)
        return True

    def _step_once(self) -> bool:
        """Stage 2 (the step loop): one forward over a reserved batch, back to back with
        the next one; its rows and first frames go to the transfer stage."""
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
        frames = self._forward(self.model, self.storage, chunks, self.graphs)
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

    def _transfer_once(self) -> bool:
        """Stage 3 (each transfer worker; on CUDA its own stream): one request's rows to
        its D, the checksum, and the COMMIT handed to the commit pool, beside the next
        forward."""
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

    def _still_wanted(self, live: _Live, before: str) -> bool:
        """False (and the request ended; its lease stays the caller's to release) when it
        was cancelled or its transfer deadline passed: no forward or write is spent on
        it. D fails an expired reservation by itself (same deadline) and asks for the
        abort our quiesce then proves."""
        job = live.job
        if job.cancelled:
            status, reason = self._cancel_reason(job.request_id)
            self._finish(job, status, f"{reason}, before {before}")
            return False
        if self._deadline(job) < int(time.time() * 1000):
            self._finish(job, pb.DEADLINE_EXCEEDED, f"transfer deadline passed before {before}")
            return False
        return True

    def _deadline(self, job: PrefillJob) -> int:
        with self._lock:
            return self.transfer_deadlines.get(job.request_id) or self._transfer_deadline(job)

    def _transfer_and_commit(self, live: _Live, frame: np.ndarray | None, cached: int) -> None:
        job, link, sender, stub = live.job, live.link, live.sender, live.stub
        assert frame is not None
        rid = job.request_id
        if not self._still_wanted(live, "the write started"):
            return
        job.stamps["transfer_start"] = now_ns()
        try:
            sender.write(rid, self.storage, live.lease.slots, live.dst, self._deadline(job),
                         capability=live.capability)
        except TransferError as exc:
            log.warning("transfer failed", extra={"request_id": rid, "error": str(exc)})
            # D holds the pages and sends ABORT; our quiesce answers it. Told from the
            # commit pool: the next request's write must not wait for this round trip.
            self._committer.submit(self._tell_decode, stub, rid, pb.TRANSFER_FAILED, f"KV transfer failed: {exc}")
            self._finish(job, pb.TRANSFER_FAILED, f"KV transfer failed: {exc}")
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
    def _tell_decode(stub: pbg.DecodeStub, request_id: int, status: int, message: str,
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
                checksum_sample=self.kv_check_sample, sampling=pb.Sampling(
                    temperature=job.params.temperature, top_k=job.params.top_k, seed=job.params.seed,
                    max_frames=job.params.max_frames, min_frames=job.params.min_frames),
                prompt_tokens=len(job.prompt), identity=self._identity(link, job.deadline_unix_ms),
                stamps=pb.Stamps(ns=job.stamps)), timeout=5.0)
        except grpc.RpcError as exc:
            self._finish(job, pb.TRANSFER_FAILED, f"commit failed: {exc.code()}")
            return
        except Exception as exc:  # a pool thread: nothing else would ever see it
            log.exception("commit crashed", extra={"request_id": rid})
            self._finish(job, pb.TRANSFER_FAILED, f"commit failed: {exc}")
            return
        if reply.status != pb.STATUS_OK:
            self._finish(job, reply.status, reply.message or pb.Status.Name(reply.status))
            return
        self._finish(job, pb.STATUS_OK, prefill_tokens=len(job.prompt) - cached, cached_tokens=cached)

    # ------------------------------------------------------------------ info
    def info(self) -> pb.InfoReply:
        with self._lock:
            ids = list(self.active) + [rid for _, rid in self.held_aborts]
            held = len(self.held_aborts)
        ids += self.scheduler.request_ids()
        in_flight: set[int] = set()
        for link in self.links:
            if link.sender is not None:
                in_flight.update(link.sender.in_flight())
        return pb.InfoReply(
            role="prefill", instance_id=self.instance_id, peer_instance_id=self.d_instance, pid=os.getpid(),
            queue=len(self.scheduler), in_flight=len(in_flight), held_aborts=held,
            transfer_mode=self.transfer_mode,
            unready="; ".join(u for link in self.links if (u := getattr(link.sender, "unready", ""))),
            request_ids=pack(np.array(sorted(set(ids)), dtype=np.uint64), "u8"),
        )


class PrefillService(pbg.PrefillServicer):
    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    async def Submit(self, request, context):  # noqa: N802 - gRPC names
        return await serve_submit(request, self.engine.model.config, self.engine.submit, self.engine.cancel)

    async def Cancel(self, request, context):  # noqa: N802
        return pb.CancelReply(found=self.engine.cancel(request.request_id))

    async def Abort(self, request, context):  # noqa: N802
        return self.engine.abort(request)

    async def Info(self, request, context):  # noqa: N802
        return self.engine.info()
