"""P's links to the D's it feeds (one, or several: `--decode-socket a.sock,b.sock`):
the handshake with each D (model and geometry checked, a sender attached), their load
(Reserve replies and a periodic Info probe), the choice of a D per request at RESERVE,
and each request's route and transfer deadline, both fixed at RESERVE.

NO_CAPACITY, DRAINING, RATE_FLOOR or an unreachable D moves a request to the next D;
only before any write: a written request never changes D (PROTOCOL.md 3). Identities
are per D instance; a D that restarted is handshaken again before it is asked again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import grpc
import torch
from prometheus_client import Counter

from pdunit.engine import metrics as m
from pdunit.engine.grpc_server import sync_channel
from pdunit.engine.model.config import ModelConfig, dtype_name
from pdunit.engine.prefill.scheduler import PrefillJob
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.settings import parse_decode_sockets
from pdunit.engine.transfer.base import Descriptor, KVSender, PoolGeometry
from pdunit.engine.unit_layout import decode_names

log = logging.getLogger("pdunit.prefill")

P_ROUTED = m.role_metric(Counter("pdunit_prefill_decode_routed_total", "Requests P reserved on each D", ["decode"],
                                 registry=None), "prefill")
P_FALLBACKS = m.role_metric(Counter("pdunit_prefill_decode_fallbacks_total",
                                    "Reservations moved to another D before any write, by the first D's answer",
                                    ["decode", "reason"], registry=None), "prefill")

# The sender to one D among the transports it offered (PrefillEngine.attach_sender).
AttachSender = Callable[[list[Descriptor], PoolGeometry], KVSender]


@dataclass
class Reservation:
    """A RESERVE's outcome: the D that answered last (None: none answered), its reply,
    and on a grant the sender and stub of the D instance that granted it."""

    link: DecodeLink | None
    reply: pb.ReserveReply
    sender: KVSender | None = None
    stub: pbg.DecodeStub | None = None


class PeerMismatch(RuntimeError):
    """P and D disagree on the model or pool geometry: no transfer can be correct."""


@dataclass(frozen=True)
class PeerSpec:
    """What every D must match: P's model, its KV dtype, and the transport asked for."""

    model_spec: str
    config: ModelConfig
    kv_dtype: torch.dtype
    transfer: str


@dataclass
class DecodeLink:
    """One D that P feeds: its channel, P's sender into its pool, its instance id, and its
    load as last reported (Info probe, Reserve replies). Only the reserve stage's
    RESERVEs (one handshake at a time) and `connect` before it starts replace `sender`
    and `instance`; a request keeps the sender and stub it was reserved with."""

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


class DecodeLinks(Sequence[DecodeLink]):
    """Every D of this P, in `--decode-socket` order, with the requests routed to them."""

    def __init__(self, decode_socket: str, instance_id: str, attach_sender: AttachSender,
                 transfer_deadline_ms: int = 0, probe_interval_s: float = 0.5) -> None:
        sockets = parse_decode_sockets(decode_socket)
        self._links = [DecodeLink(i, sock, name)
                       for i, (sock, name) in enumerate(zip(sockets, decode_names(len(sockets)), strict=True))]
        self.instance_id = instance_id  # P's, sent in every identity
        self.attach_sender = attach_sender
        self.transfer_deadline_ms = transfer_deadline_ms
        self.probe_interval_s = probe_interval_s
        self.routes: dict[int, DecodeLink] = {}  # request id -> the D it was reserved on
        self.deadlines: dict[int, int] = {}      # request id -> transfer deadline sent in RESERVE
        self._peer: PeerSpec | None = None
        self._lock = threading.Lock()
        self._handshake = threading.Lock()  # a handshake again (a D restarted), and reading a link's peer
        self._probe_stop = threading.Event()
        self._probe_thread: threading.Thread | None = None

    @overload
    def __getitem__(self, i: int) -> DecodeLink: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[DecodeLink]: ...

    def __getitem__(self, i: int | slice) -> DecodeLink | Sequence[DecodeLink]:
        return self._links[i]

    def __len__(self) -> int:
        return len(self._links)

    def __iter__(self) -> Iterator[DecodeLink]:
        return iter(self._links)

    def instances(self) -> str:
        """Every D's instance id, in order, comma-separated (P's InfoReply.peer_instance_id)."""
        return ",".join(link.instance for link in self._links)

    def transfer_modes(self) -> str:
        """The transports P writes with, comma-separated, each once (P's InfoReply)."""
        modes = [link.sender.mode for link in self._links if link.sender is not None]
        return ",".join(dict.fromkeys(modes))

    def close(self) -> None:
        for link in self._links:
            if link.sender is not None:
                link.sender.close()

    # ------------------------------------------------------------------ handshake
    def connect(self, peer: PeerSpec, timeout_s: float = 120.0) -> None:
        """Hello to every D until it answers; checks model and geometry against `peer`;
        attaches a sender per D. P serves only once every D answered."""
        self._peer = peer
        for link in self._links:
            self._connect_link(link, timeout_s)

    def _connect_link(self, link: DecodeLink, timeout_s: float = 120.0) -> None:
        peer = self._peer
        assert peer is not None, "connect() first"
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
        mc = peer.config
        g = hello.geometry
        if hello.model != peer.model_spec:
            raise PeerMismatch(f"P runs model {peer.model_spec!r} but D at {link.socket} runs {hello.model!r}")
        if (g.n_layers, g.n_kv_heads, g.head_dim) != (mc.n_layers, mc.n_kv_heads, mc.head_dim):
            raise PeerMismatch(f"D pool geometry {g} at {link.socket} does not match the model {mc.name}")
        if g.dtype != dtype_name(peer.kv_dtype):
            raise PeerMismatch(f"D pool dtype {g.dtype} at {link.socket} != P pool dtype {dtype_name(peer.kv_dtype)}: "
                               "run P and D with the same --dtype and --kv-cache-dtype")
        geometry = PoolGeometry(g.n_layers, g.n_kv_heads, g.head_dim, peer.kv_dtype, g.n_slots, g.page_size)
        offered = [Descriptor(t.mode, dict(t.params), t.handle) for t in hello.transports]
        if link.sender is not None:
            link.sender.close()
        link.sender = self.attach_sender(offered, geometry)
        if peer.transfer not in ("auto", link.sender.mode):
            raise PeerMismatch(f"asked for transfer {peer.transfer!r} but D at {link.socket} offers "
                               f"{[d.mode for d in offered]}")
        m.P_TRANSFER_MODE.labels(decode=link.name).state(link.sender.mode)
        link.instance = hello.instance_id
        link.page_size = max(1, g.page_size)
        link.pool_pages = link.free_pages = max(0, g.n_slots // link.page_size)
        link.responsive = True
        log.info("connected to decode", extra={"decode": link.name, "socket": link.socket,
                                               "d_instance": link.instance, "transfer": link.sender.mode})

    # ------------------------------------------------------------------ D load probe
    def start_probe(self) -> None:
        """With several D's: a thread asks every D for Info each `probe_interval_s` (free
        pages, streams, draining, responsiveness) for the choice at RESERVE."""
        if len(self._links) < 2 or self._probe_thread is not None:
            return
        self._probe_thread = threading.Thread(target=self._probe_loop, name="decode-probe", daemon=True)
        self._probe_thread.start()

    def stop_probe(self) -> None:
        self._probe_stop.set()
        if self._probe_thread is not None:
            self._probe_thread.join(timeout=5)

    def _probe_loop(self) -> None:
        while not self._probe_stop.wait(self.probe_interval_s):
            for link in self._links:
                self.probe(link)

    def probe(self, link: DecodeLink) -> None:
        stub = link.stub
        if stub is None:
            return
        try:
            info = stub.Info(pb.Empty(), timeout=max(0.2, min(1.0, 2 * self.probe_interval_s)))
        except grpc.RpcError as exc:
            if link.responsive:
                log.warning("decode does not answer Info: new requests go to the other decoders first",
                            extra={"decode": link.name, "code": str(exc.code())})
            link.responsive = False
            return
        if not link.responsive:
            log.info("decode answers again", extra={"decode": link.name})
        link.observe(info)

    # ------------------------------------------------------------------ routes and deadlines
    def ordered(self) -> list[DecodeLink]:
        """The D's best first, as `DecodeLink.order_key` ranks them."""
        return sorted(self._links, key=DecodeLink.order_key)

    def route(self, request_id: int) -> DecodeLink | None:
        """The D the request was reserved on (None: not reserved, or finished)."""
        with self._lock:
            return self.routes.get(request_id)

    def deadline(self, job: PrefillJob) -> int:
        """The request's transfer deadline: the one sent in its RESERVE."""
        with self._lock:
            return self.deadlines.get(job.request_id) or self._transfer_deadline(job)

    def forget(self, request_id: int) -> None:
        """The request finished: its route and deadline go."""
        with self._lock:
            self.deadlines.pop(request_id, None)
            link = self.routes.pop(request_id, None)
            if link is not None:
                link.routed.discard(request_id)

    def identity(self, receiver_instance: str, deadline_ms: int) -> pb.Identity:
        return pb.Identity(sender_instance=self.instance_id, receiver_instance=receiver_instance,
                           budget_ms=max(0, deadline_ms - int(time.time() * 1000)))

    def _transfer_deadline(self, job: PrefillJob) -> int:
        """The transfer's deadline, fixed at RESERVE: D enforces the same one (it fails
        the reservation when the deadline passes without COMMIT)."""
        deadline = job.deadline_unix_ms
        if self.transfer_deadline_ms:
            deadline = min(deadline or 2**62, int(time.time() * 1000) + self.transfer_deadline_ms)
        return deadline

    # ------------------------------------------------------------------ RESERVE
    def reserve(self, job: PrefillJob) -> Reservation:
        """RESERVE on the best D; on NO_CAPACITY, DRAINING, RATE_FLOOR or an unreachable D, the next
        one (nothing was written yet, so the request may still change D). Returns the D
        that answered last, its reply, and the sender and stub of the D instance that
        answered; the D is None when none answered. Safe from several threads at once (P's
        reserve stage sends a group's RESERVEs together)."""
        rows = len(job.prompt)
        deadline = self._transfer_deadline(job)
        with self._lock:
            self.deadlines[job.request_id] = deadline
        failure: pb.ReserveReply | None = None
        for link in self.ordered():
            try:
                reply, sender, stub = self._reserve_on(link, job, rows, deadline)
            except grpc.RpcError as exc:
                link.responsive = False
                failure = pb.ReserveReply(status=pb.TRANSFER_FAILED, message=f"decode unreachable: {exc.code()}")
                if len(self._links) > 1:
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
                return Reservation(link, reply, sender, stub)
            if reply.status not in (pb.NO_CAPACITY, pb.DRAINING, pb.RATE_FLOOR):
                return Reservation(link, reply)
            if reply.status == pb.NO_CAPACITY:
                link.free_pages = 0
            elif reply.status == pb.DRAINING:
                link.draining = True
            failure = reply
            if len(self._links) > 1:
                P_FALLBACKS.labels(decode=link.name, reason=pb.Status.Name(reply.status).lower()).inc()
        assert failure is not None
        return Reservation(None, failure)

    def _reserve_on(self, link: DecodeLink, job: PrefillJob, rows: int,
                    deadline: int) -> tuple[pb.ReserveReply, KVSender | None, pbg.DecodeStub | None]:
        """The RESERVE on one D, with the sender and stub of the instance it named: D grants
        only a RESERVE naming its own instance, so a grant is that instance's even when
        another thread's handshake replaced the link's sender meanwhile (one handshake at
        a time, and none for a restart another thread already handshook)."""
        traced = {"metadata": job.span.metadata()} if job.span is not None else {}  # engine/tracing.py
        for attempt in range(2):
            with self._handshake:
                stub, sender, instance = link.stub, link.sender, link.instance
            assert stub is not None
            reply = stub.Reserve(pb.ReserveRequest(
                request_id=job.request_id, n_tokens=rows, total_tokens=rows + job.params.max_frames,
                deadline_unix_ms=deadline, identity=self.identity(instance, deadline), audio=job.audio), timeout=5.0, **traced)
            if reply.status != pb.STALE_INSTANCE or attempt:
                return reply, sender, stub
            log.warning("decode restarted: handshaking again", extra={"request_id": job.request_id,
                                                                      "decode": link.name})
            with self._handshake:
                if link.instance == instance:
                    self._connect_link(link)
        return reply, sender, stub
