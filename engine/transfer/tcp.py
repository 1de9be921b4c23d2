"""The `tcp` KV transport, v3 (PROTOCOL.md section 6): the cross-host fallback.

D runs a listener (host:port in its descriptor) and writes every received row into its
own pool itself; P gathers rows into chunks and sends them over N parallel
connections. Because D is the writer, D's per-request state is the quiesce proof (c):

    BEGIN(request_id, n_tokens, dst_slots, deadline)  -> receiving      (answer BEGIN_OK)
    CHUNK(request_id, offset, length, remaining_ms)   -> rows applied while receiving
    all rows applied                                  -> completed      (answer COMPLETED)
    D gives up (abort / receiver_quiesced)            -> aborted        (answer ABORTED)

A chunk for a request that is not `receiving` (late after abort, after completion, for
an unknown id, or past its deadline) is read off the socket, dropped and counted, and
the sender is told the terminal state. Applying a chunk and aborting take the same
per-request lock, so once `abort()` returns no row of that request is written any more.
The destination slots come from BEGIN only (the chunks carry token offsets), so a
chunk can never write outside the slots D reserved for its request.

Wire format: a fixed 48-byte little-endian header (magic b"PDKV", version 3, type,
flags, request_id, a, b, c, d, payload_len) followed by the payload. Must never decide
page ownership; must never apply a row outside `receiving`.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from prometheus_client import Counter

from pdunit.engine.metrics import role_metric
from pdunit.engine.transfer.base import (
    Descriptor,
    KVReceiver,
    KVSender,
    PoolGeometry,
    TransferError,
    WriteGate,
)
from pdunit.kernels.kv_dtype import index_copy_kv

log = logging.getLogger("pdunit.transfer.tcp")

MAGIC = b"PDKV"
VERSION = 3
HEADER = struct.Struct("<4sBBHQIIqQQ")  # magic ver type flags rid a b c d payload_len
BEGIN, CHUNK, BEGIN_OK, COMPLETED, ABORTED = 1, 2, 3, 4, 5
FLAG_PROBE = 1
FLAG_VERIFY = 2
PROBE_SLOTS = 16
CHUNK_TARGET_BYTES = 4 << 20
RETENTION_S = 600.0
MAX_STATES = 100_000

# D's receiver side
CHUNKS = role_metric(Counter("pdunit_tcp_chunks_total", "TCP KV chunks received by outcome", ["outcome"],
                             registry=None), "decode")
RX_BYTES = role_metric(Counter("pdunit_tcp_received_bytes_total", "TCP KV payload bytes applied", registry=None),
                       "decode")
REQUESTS = role_metric(Counter("pdunit_tcp_requests_total", "TCP KV requests reaching a terminal state", ["state"],
                               registry=None), "decode")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _send(sock: socket.socket, lock: threading.Lock, typ: int, rid: int, flags: int = 0,
          a: int = 0, b: int = 0, c: int = 0, d: int = 0, payload: bytes | memoryview = b"") -> None:
    head = HEADER.pack(MAGIC, VERSION, typ, flags, rid, a, b, c, d, len(payload))
    with lock:
        sock.sendall(head)
        if len(payload):
            sock.sendall(payload)


@dataclass
class _Request:
    n: int
    dst_slots: torch.Tensor
    deadline_unix_ms: int
    probe: bool
    verify: bool
    state: str = "receiving"
    received: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    checksum: int = 0
    reason: str = ""
    ended_at: float = 0.0


class TcpReceiver(KVReceiver):
    mode = "tcp"

    def __init__(self, geometry: PoolGeometry, device: str, host: str = "127.0.0.1", port: int = 0,
                 storage: torch.Tensor | None = None, advertise_host: str = "") -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self._storage = storage if storage is not None else torch.zeros(
            geometry.shape(), dtype=geometry.dtype, device=self.device)
        self.probe_storage = torch.zeros(
            (geometry.n_layers, 2, PROBE_SLOTS, geometry.n_kv_heads, geometry.head_dim),
            dtype=geometry.dtype, device=self.device)
        self._lock = threading.Lock()
        self._requests: OrderedDict[int, _Request] = OrderedDict()
        self.dropped: dict[str, int] = {"late": 0, "aborted": 0, "unknown": 0, "deadline": 0}
        self.applied_chunks = 0
        self._listener = socket.create_server((host, port), backlog=64)
        self.host = advertise_host or host
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="tcp-kv-accept", daemon=True)
        self._thread.start()
        log.info("tcp KV receiver listening", extra={"host": host, "port": self.port})

    @property
    def storage(self) -> torch.Tensor:
        return self._storage

    def descriptors(self) -> list[Descriptor]:
        return [Descriptor("tcp", {"host": self.host, "port": str(self.port),
                                   "probe_slots": str(PROBE_SLOTS)})]

    # ------------------------------------------------------------ state
    def _prune(self) -> None:
        now = time.monotonic()
        while self._requests:
            rid, req = next(iter(self._requests.items()))
            terminal = req.state != "receiving"
            if len(self._requests) > MAX_STATES or (terminal and now - req.ended_at > RETENTION_S):
                self._requests.popitem(last=False)
            else:
                break

    def _end(self, req: _Request, state: str, reason: str = "") -> None:
        """Under req.lock."""
        req.state = state
        req.reason = reason
        req.ended_at = time.monotonic()
        REQUESTS.labels(state).inc()

    def abort(self, request_id: int, reason: str = "aborted by D") -> None:
        """Mark the request aborted; after return no chunk of it is applied. A request
        not seen yet is remembered as aborted, so its chunks are dropped too."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                req = _Request(0, torch.empty(0, dtype=torch.int64), 0, False, False)
                self._requests[request_id] = req
                self._prune()
        with req.lock:
            if req.state == "receiving":
                self._end(req, "aborted", reason)

    def receiver_quiesced(self, request_id: int) -> bool:
        """Proof (c): D asks only for requests it holds, so asking aborts the request if
        it is still receiving; from then on no chunk of it is applied."""
        self.abort(request_id, "held by D (receiver_quiesced)")
        return True

    def known(self, request_id: int) -> bool:
        """Whether a BEGIN (or an abort) of this request reached this receiver."""
        with self._lock:
            return request_id in self._requests

    def state(self, request_id: int) -> str:
        with self._lock:
            req = self._requests.get(request_id)
        return "unknown" if req is None else req.state

    # ------------------------------------------------------------ network
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="tcp-kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        send_lock = threading.Lock()
        head = bytearray(HEADER.size)
        buf = bytearray(0)
        try:
            while True:
                _recv_exact(conn, memoryview(head))
                magic, ver, typ, flags, rid, a, b, c, _d, plen = HEADER.unpack(head)
                if magic != MAGIC or ver != VERSION:
                    log.warning("tcp KV: bad frame header, closing", extra={"magic": magic, "version": ver})
                    return
                if len(buf) < plen:
                    buf = bytearray(plen)
                payload = memoryview(buf)[:plen]
                _recv_exact(conn, payload)
                if typ == BEGIN:
                    self._begin(conn, send_lock, rid, flags, a, c, payload)
                elif typ == CHUNK:
                    self._chunk(conn, send_lock, rid, a, b, c, payload)
        except (ConnectionError, OSError):
            return
        finally:
            conn.close()

    def _begin(self, conn: socket.socket, lock: threading.Lock, rid: int, flags: int, n: int,
               deadline: int, payload: memoryview) -> None:
        target = self.probe_storage if flags & FLAG_PROBE else self._storage
        slots = np.frombuffer(payload, dtype="<i8").copy()
        error = ""
        if slots.size != n:
            error = f"BEGIN carries {slots.size} dst slots for {n} tokens"
        elif n and (slots.min() < 0 or slots.max() >= target.shape[2]):
            error = f"dst slots outside the pool [0, {target.shape[2]})"
        elif np.unique(slots).size != slots.size:
            error = "duplicate dst slots"
        with self._lock:
            req = self._requests.get(rid)
            if req is None and not error:
                req = _Request(n, torch.from_numpy(slots).to(self.device), deadline,
                               bool(flags & FLAG_PROBE), bool(flags & FLAG_VERIFY),
                               received=np.zeros(n, dtype=bool))
                self._requests[rid] = req
                self._prune()
        if error:
            _send(conn, lock, ABORTED, rid, payload=error.encode())
            return
        assert req is not None
        with req.lock:
            state, reason, checksum = req.state, req.reason, req.checksum
        if state == "receiving":
            _send(conn, lock, BEGIN_OK, rid)
        elif state == "completed":
            _send(conn, lock, COMPLETED, rid, d=checksum)
        else:
            _send(conn, lock, ABORTED, rid, payload=reason.encode())

    def _chunk(self, conn: socket.socket, lock: threading.Lock, rid: int, t0: int, k: int,
               remaining_ms: int, payload: memoryview) -> None:
        with self._lock:
            req = self._requests.get(rid)
        if req is None:
            self.dropped["unknown"] += 1
            CHUNKS.labels("dropped_unknown").inc()
            _send(conn, lock, ABORTED, rid, payload=b"unknown request (no BEGIN)")
            return
        reply: tuple[int, int, bytes] | None = None
        with req.lock:
            if req.state == "receiving" and (remaining_ms <= 0 or time.time() * 1000 > req.deadline_unix_ms):
                self._end(req, "aborted", "deadline passed")
                self.dropped["deadline"] += 1
                CHUNKS.labels("dropped_deadline").inc()
                reply = (ABORTED, 0, b"deadline passed")
            elif req.state != "receiving":
                kind = "aborted" if req.state == "aborted" else "late"
                self.dropped[kind] += 1
                CHUNKS.labels(f"dropped_{kind}").inc()
                reply = (ABORTED, 0, req.reason.encode()) if req.state == "aborted" else (COMPLETED, req.checksum, b"")
            elif t0 + k > req.n or k <= 0:
                self._end(req, "aborted", f"chunk rows [{t0}, {t0 + k}) outside the request's {req.n} tokens")
                reply = (ABORTED, 0, req.reason.encode())
            else:
                g = self.geometry
                shape = (g.n_layers, 2, k, g.n_kv_heads, g.head_dim)
                rows = torch.frombuffer(payload, dtype=torch.uint8).view(g.dtype).view(shape)
                target = self.probe_storage if req.probe else self._storage
                index_copy_kv(target, 2, req.dst_slots[t0:t0 + k], rows.to(self.device))
                fresh = ~req.received[t0:t0 + k]
                req.received[t0:t0 + k] = True
                req.count += int(fresh.sum())
                self.applied_chunks += 1
                CHUNKS.labels("applied").inc()
                RX_BYTES.inc(len(payload))
                if req.count == req.n:
                    if req.verify:
                        from pdunit.engine.kv.checksum import kv_checksum

                        req.checksum = kv_checksum(target, req.dst_slots.cpu().numpy())
                    self._end(req, "completed")
                    reply = (COMPLETED, req.checksum, b"")
        if reply is not None:
            _send(conn, lock, reply[0], rid, d=reply[1], payload=reply[2])

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


@dataclass
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    begun: threading.Event = field(default_factory=threading.Event)
    state: str = ""
    checksum: int = 0
    message: str = ""


class _Conn:
    def __init__(self, host: str, port: int, on_reply: object) -> None:
        self.sock = socket.create_connection((host, port), timeout=5.0)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lock = threading.Lock()
        self.alive = True
        self._on_reply = on_reply
        self.thread = threading.Thread(target=self._read, name="tcp-kv-reply", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        head = bytearray(HEADER.size)
        try:
            while True:
                _recv_exact(self.sock, memoryview(head))
                _m, _v, typ, _f, rid, _a, _b, _c, d, plen = HEADER.unpack(head)
                payload = bytearray(plen)
                if plen:
                    _recv_exact(self.sock, memoryview(payload))
                self._on_reply(typ, rid, d, bytes(payload))  # type: ignore[operator]
        except (ConnectionError, OSError):
            self.alive = False

    def close(self) -> None:
        self.alive = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpSender(KVSender):
    mode = "tcp"

    def __init__(self, descriptor: Descriptor, geometry: PoolGeometry, connections: int = 4,
                 chunk_tokens: int = 0) -> None:
        if descriptor.mode != "tcp":
            raise TransferError(f"TcpSender needs a 'tcp' descriptor, got {descriptor.mode!r}")
        self.geometry = geometry
        self.host = descriptor.params["host"]
        self.port = int(descriptor.params["port"])
        self.n_conns = max(1, connections)
        per_token = geometry.bytes_for(1)
        self.chunk_tokens = chunk_tokens or max(1, CHUNK_TARGET_BYTES // per_token)
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._waiters: dict[int, _Waiter] = {}
        self._gate = WriteGate(MAX_STATES)
        self._conns: list[_Conn] = []
        self._pool = ThreadPoolExecutor(self.n_conns, thread_name_prefix="tcp-kv-send")
        self.last_checksum = 0
        self._connect()

    def _connect(self) -> None:
        for c in self._conns:
            c.close()
        try:
            self._conns = [_Conn(self.host, self.port, self._on_reply) for _ in range(self.n_conns)]
        except OSError as e:
            raise TransferError(f"tcp KV receiver {self.host}:{self.port} unreachable: {e}",
                                retryable=True) from e

    def _on_reply(self, typ: int, rid: int, checksum: int, payload: bytes) -> None:
        with self._lock:
            w = self._waiters.get(rid)
        if w is None:
            return
        if typ == BEGIN_OK:
            w.begun.set()
            return
        w.state = "completed" if typ == COMPLETED else "aborted"
        w.checksum = checksum
        w.message = payload.decode(errors="replace")
        w.begun.set()
        w.event.set()

    def write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray,
              dst_slots: np.ndarray, deadline_unix_ms: int) -> None:
        self._write(request_id, src, src_slots, dst_slots, deadline_unix_ms, 0)

    def _write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray, dst_slots: np.ndarray,
               deadline_unix_ms: int, flags: int) -> int:
        s = np.ascontiguousarray(src_slots, dtype=np.int64)
        d = np.ascontiguousarray(dst_slots, dtype=np.int64)
        if s.size != d.size:
            raise TransferError(f"request {request_id}: src_slots has {s.size} entries, dst_slots {d.size}")
        with self._gate.writing(request_id, deadline_unix_ms):
            waiter = _Waiter()
            with self._lock:
                self._waiters[request_id] = waiter
            try:
                return self._send_request(request_id, src, s, d, deadline_unix_ms, flags, waiter)
            finally:
                with self._lock:
                    self._waiters.pop(request_id, None)

    def _send_request(self, request_id: int, src: torch.Tensor, s: np.ndarray, d: np.ndarray,
                      deadline_unix_ms: int, flags: int, waiter: _Waiter) -> int:
        """BEGIN, the chunks over every connection, then the receiver's terminal state."""
        try:
            with self._connect_lock:  # P writes from several threads: one reconnects
                if not all(c.alive for c in self._conns):
                    self._connect()
            n = int(s.size)
            _send(self._conns[0].sock, self._conns[0].lock, BEGIN, request_id, flags=flags, a=n,
                  c=deadline_unix_ms, payload=d.astype("<i8").tobytes())
            if not waiter.begun.wait(max(0.0, deadline_unix_ms / 1000 - time.time())):
                raise TransferError(f"request {request_id}: receiver did not answer BEGIN before the deadline")
            if waiter.event.is_set():
                raise TransferError(f"request {request_id}: receiver refused: {waiter.state} {waiter.message}")
            if src.is_cuda:
                torch.cuda.current_stream(src.device).synchronize()  # see KVSender.write
            idx = torch.from_numpy(s).to(src.device)
            starts = list(range(0, n, self.chunk_tokens))

            def send_share(ci: int) -> None:
                conn = self._conns[ci]
                for t0 in starts[ci::self.n_conns]:
                    if self._gate.quiesced(request_id) or waiter.event.is_set():
                        return
                    k = min(self.chunk_tokens, n - t0)
                    rows = src.index_select(2, idx[t0:t0 + k]).contiguous().cpu()
                    remaining = int(deadline_unix_ms - time.time() * 1000)
                    _send(conn.sock, conn.lock, CHUNK, request_id, a=t0, b=k, c=remaining,
                          payload=rows.view(torch.uint8).numpy().data.cast("B"))

            for f in [self._pool.submit(send_share, i) for i in range(self.n_conns)]:
                f.result()
            if self._gate.quiesced(request_id) and not waiter.event.is_set():
                raise TransferError(f"request {request_id} was cancelled (quiesced) while sending")
            left = deadline_unix_ms / 1000 - time.time()
            if not waiter.event.wait(max(0.0, left)):
                raise TransferError(f"request {request_id}: no terminal state from the receiver before the deadline")
            if waiter.state != "completed":
                raise TransferError(f"request {request_id}: receiver aborted the transfer: {waiter.message}")
            self.last_checksum = waiter.checksum
            return waiter.checksum
        except OSError as e:
            raise TransferError(f"request {request_id}: tcp KV connection failed: {e}", retryable=True) from e

    def probe(self, src: torch.Tensor, src_slots: np.ndarray, request_id: int) -> int:
        """Write rows into D's probe slots; returns the checksum D computed over them."""
        n = int(np.asarray(src_slots).size)
        return self._write(request_id, src, src_slots, np.arange(n, dtype=np.int64),
                           int(time.time() * 1000) + 30_000, FLAG_PROBE | FLAG_VERIFY)

    def quiesce(self, request_id: int) -> bool:
        """Stops sending; chunks already on the wire are D's to drop (its aborted state)."""
        return self._gate.quiesce(request_id)

    def in_flight(self) -> list[int]:
        return self._gate.in_flight()

    def close(self) -> None:
        for c in self._conns:
            c.close()
        self._pool.shutdown(wait=False)
