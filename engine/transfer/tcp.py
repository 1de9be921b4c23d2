"""The `tcp` KV transport, v3 (PROTOCOL.md section 6): the cross-host fallback.

D runs a listener (host:port in its descriptor) and writes every received row into its own
pool itself; P gathers rows into chunks and sends them over N parallel connections.
Because D is the writer, D's per-request state is the quiesce proof (c), and D enforces
who may write what (PROTOCOL.md 3.1 and 6); every connection is authenticated both ways
over the unit's secret before any frame is read. The wire (handshake, per-request states,
frame header) is described above its constants. Must never decide page ownership; must
never apply a row without its grant or outside `receiving`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
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
from pdunit.engine.packing import pack, unpack
from pdunit.engine.security import same_bytes, security_event
from pdunit.engine.transfer.base import (
    CAPABILITY_BYTES,
    Descriptor,
    KVReceiver,
    KVSender,
    PoolGeometry,
    TransferError,
    WriteGate,
    WriteGrants,
)
from pdunit.kernels.kv_dtype import index_copy_kv

log = logging.getLogger("pdunit.transfer.tcp")

# Authentication, per connection, before any frame is read (a challenge-response over
# the unit's secret, HMAC-SHA256, both ways, so P also knows it reached its own D):
#
#     D -> P  CHALLENGE(Ns)
#     P -> D  PROOF(Nc, HMAC(secret, "client" | Ns | Nc))      D compares in constant time
#     D -> P  WELCOME(HMAC(secret, "server" | Nc | Ns))        P compares in constant time
#
# A peer whose proof is wrong, malformed or later than AUTH_TIMEOUT_S is cut off and
# reported (security event `tcp_auth_failed`). This authenticates the peer at connect; it
# does not protect an established stream from an on-path attacker (no encryption or
# per-frame MAC): across hosts, the network between P and D must be trusted.
#
# Per request, on an authenticated connection:
#
#     BEGIN(request_id, n, capability, dst_slots, deadline) -> receiving   (BEGIN_OK)
#     CHUNK(request_id, offset, length, remaining_ms, capability) -> rows applied
#     all rows applied                                      -> completed   (COMPLETED)
#     D gives up (abort, revoke, receiver_quiesced)         -> aborted     (ABORTED)
#
# BEGIN is accepted only when D's grants hold its capability for exactly the slots it
# declares (the reservation D made at RESERVE); a chunk is applied only while its
# request is receiving, with the capability its BEGIN presented, and while the grant
# lives (`revoke` at COMMIT / ABORT / held ends the request). The destination slots come
# from BEGIN only (chunks carry token offsets), so a chunk can never write outside its
# reservation. A refused write writes nothing and answers ABORTED; it is a security event
# (`tcp_write_refused`) unless it carries the request's own capability and only came too
# late (a stalled P after D gave up: counted in `dropped`, the case proof (c) exists for).
#
# Probes (`TcpSender.probe`) ask for a probe grant over the authenticated connection
# (PROBE_GRANT) and write a probe region of their own: a probe never touches the pool.
# Applying a chunk and aborting take the same per-request lock, so once `abort()` or
# `revoke()` returns no row of that request is written any more.
#
# Wire format: a fixed 48-byte little-endian header (magic b"PDKV", version, type,
# flags, request_id, a, b, c, d, payload_len) followed by the payload.
MAGIC = b"PDKV"
VERSION = 4  # the wire of TCP v3 with the handshake and capabilities
HEADER = struct.Struct("<4sBBHQIIqQQ")  # magic ver type flags rid a b c d payload_len
BEGIN, CHUNK, BEGIN_OK, COMPLETED, ABORTED = 1, 2, 3, 4, 5
CHALLENGE, PROOF, WELCOME, PROBE_GRANT, PROBE_GRANTED = 6, 7, 8, 9, 10
FLAG_PROBE = 1
FLAG_VERIFY = 2
PROBE_SLOTS = 16
PROBE_GRANT_MS = 30_000
CHUNK_TARGET_BYTES = 4 << 20
RETENTION_S = 600.0
MAX_STATES = 100_000
NONCE_BYTES = 32
MAC_BYTES = 32
AUTH_TIMEOUT_S = 5.0
MAX_PENDING_AUTH = 64  # connections in their handshake at once; more are cut off
MIN_SECRET_BYTES = 16
_CLIENT, _SERVER = b"pdunit-tcp-kv client", b"pdunit-tcp-kv server"

# D's receiver side
CHUNKS = role_metric(Counter("pdunit_tcp_chunks_total", "TCP KV chunks received by outcome", ["outcome"],
                             registry=None), "decode")
RX_BYTES = role_metric(Counter("pdunit_tcp_received_bytes_total", "TCP KV payload bytes applied", registry=None),
                       "decode")
REQUESTS = role_metric(Counter("pdunit_tcp_requests_total", "TCP KV requests reaching a terminal state", ["state"],
                               registry=None), "decode")


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float = 0.0) -> None:
    """Fill `view`; with `deadline` (time.monotonic()) the whole read must end by then,
    however slowly the peer trickles bytes (TimeoutError)."""
    got = 0
    while got < len(view):
        if deadline:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer was too slow")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _send(sock: socket.socket, lock: threading.Lock, typ: int, rid: int, flags: int = 0,
          a: int = 0, b: int = 0, c: int = 0, d: int = 0, payload: bytes | memoryview = b"",
          capability: bytes = b"") -> None:
    """One frame; `capability` goes first in the payload (BEGIN, CHUNK)."""
    head = HEADER.pack(MAGIC, VERSION, typ, flags, rid, a, b, c, d, len(capability) + len(payload))
    with lock:
        sock.sendall(head + capability)
        if len(payload):
            sock.sendall(payload)


def _recv_frame(sock: socket.socket, want: int, size: int, deadline: float) -> bytes:
    """One handshake frame of type `want` and exactly `size` payload bytes, by
    `deadline`, or ValueError (the payload is never read before its header checked out)."""
    head = bytearray(HEADER.size)
    _recv_exact(sock, memoryview(head), deadline)
    magic, ver, typ, _f, _rid, _a, _b, _c, _d, plen = HEADER.unpack(head)
    if magic != MAGIC or ver != VERSION:
        raise ValueError(f"not a pdunit tcp KV v{VERSION} frame (magic {bytes(magic)!r}, version {ver})")
    if typ != want or plen != size:
        raise ValueError(f"frame type {typ} with {plen} payload bytes, expected type {want} with {size}")
    payload = bytearray(size)
    _recv_exact(sock, memoryview(payload), deadline)
    return bytes(payload)


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def _check_secret(secret: bytes) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise TransferError(f"the tcp KV transport needs the unit's secret (--unit-secret-file, at least "
                            f"{MIN_SECRET_BYTES} bytes); got {len(secret)} bytes")
    return bytes(secret)


def client_handshake(sock: socket.socket, secret: bytes, where: str) -> None:
    """P's half of the handshake (module docstring) on a fresh connection: proves P
    holds the unit's secret and checks that D does. Raises TransferError."""
    deadline = time.monotonic() + AUTH_TIMEOUT_S
    try:
        ns = _recv_frame(sock, CHALLENGE, NONCE_BYTES, deadline)
        nc = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(HEADER.pack(MAGIC, VERSION, PROOF, 0, 0, 0, 0, 0, 0, NONCE_BYTES + MAC_BYTES)
                     + nc + _mac(secret, _CLIENT, ns, nc))
        welcome = _recv_frame(sock, WELCOME, MAC_BYTES, deadline)
    except ValueError as e:
        raise TransferError(f"tcp KV receiver {where}: bad handshake: {e}") from e
    except (ConnectionError, TimeoutError) as e:
        raise TransferError(f"tcp KV receiver {where} refused the handshake ({e}): P and D do not share "
                            "the unit's secret (--unit-secret-file), or it is not a pdunit D") from e
    if not same_bytes(welcome, _mac(secret, _SERVER, nc, ns)):
        raise TransferError(f"tcp KV receiver {where} does not hold the unit's secret (--unit-secret-file): "
                            "it is not this unit's D")


@dataclass
class _Request:
    n: int
    dst_slots: torch.Tensor
    deadline_unix_ms: int
    probe: bool
    verify: bool
    capability: bytes = b""
    dst: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
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
                 storage: torch.Tensor | None = None, advertise_host: str = "", *, secret: bytes) -> None:
        self._secret = _check_secret(secret)
        self.geometry = geometry
        self.device = torch.device(device)
        self._storage = storage if storage is not None else torch.zeros(
            geometry.shape(), dtype=geometry.dtype, device=self.device)
        self.probe_storage = torch.zeros(
            (geometry.n_layers, 2, PROBE_SLOTS, geometry.n_kv_heads, geometry.head_dim),
            dtype=geometry.dtype, device=self.device)
        self.probe_grants = WriteGrants()  # probe writes only: never a pool slot
        self._lock = threading.Lock()
        self._requests: OrderedDict[int, _Request] = OrderedDict()
        self.dropped: dict[str, int] = {"late": 0, "aborted": 0, "unknown": 0, "deadline": 0,
                                        "revoked": 0, "refused": 0}
        self.refused_begins = 0
        self.auth_failures = 0
        self.applied_chunks = 0
        self._pending_auth = threading.BoundedSemaphore(MAX_PENDING_AUTH)
        self._listener = socket.create_server((host, port), backlog=64)
        self.host = advertise_host or host
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="tcp-kv-accept", daemon=True)
        self._thread.start()
        log.info("tcp KV receiver listening", extra={"host": host, "port": self.port})
        if host in ("", "0.0.0.0", "::"):
            log.warning("tcp KV receiver listens on every interface: P in the pod needs loopback only, "
                        "tcp across hosts the pod IP only (--tcp-host)", extra={"host": host, "port": self.port})

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

    def _end(self, rid: int, req: _Request, state: str, reason: str = "") -> None:
        """Under req.lock."""
        req.state = state
        req.reason = reason
        req.ended_at = time.monotonic()
        REQUESTS.labels(state).inc()
        if req.probe:
            self.probe_grants.revoke(rid)

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
                self._end(request_id, req, "aborted", reason)

    def revoke(self, request_id: int) -> None:
        """The reservation ended (COMMIT, ABORT, held): its grant goes, and a transfer
        still receiving ends aborted; after return no chunk of it is applied."""
        super().revoke(request_id)
        with self._lock:
            req = self._requests.get(request_id)
        if req is not None:
            with req.lock:
                if req.state == "receiving":
                    self._end(request_id, req, "aborted", "the reservation ended (revoked by D)")

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
                conn, peer = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._pending_auth.acquire(blocking=False):
                self._auth_failed(f"more than {MAX_PENDING_AUTH} connections in their handshake at once",
                                  peer)
                conn.close()
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"),
                             name="tcp-kv-conn", daemon=True).start()

    def _auth_failed(self, reason: str, peer: object) -> None:
        self.auth_failures += 1
        security_event("tcp_auth_failed", reason=reason, peer=str(peer), port=self.port)

    def _authenticate(self, conn: socket.socket, peer: str) -> bool:
        """D's half of the handshake (module docstring); False = cut off and reported."""
        deadline = time.monotonic() + AUTH_TIMEOUT_S
        try:
            conn.settimeout(AUTH_TIMEOUT_S)
            ns = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(HEADER.pack(MAGIC, VERSION, CHALLENGE, 0, 0, 0, 0, 0, 0, NONCE_BYTES) + ns)
            proof = _recv_frame(conn, PROOF, NONCE_BYTES + MAC_BYTES, deadline)
            nc, mac = proof[:NONCE_BYTES], proof[NONCE_BYTES:]
            if not same_bytes(mac, _mac(self._secret, _CLIENT, ns, nc)):
                self._auth_failed("wrong proof: the peer does not hold the unit's secret", peer)
                return False
            conn.sendall(HEADER.pack(MAGIC, VERSION, WELCOME, 0, 0, 0, 0, 0, 0, MAC_BYTES)
                         + _mac(self._secret, _SERVER, nc, ns))
            conn.settimeout(None)
            return True
        except TimeoutError:
            self._auth_failed(f"no proof within {AUTH_TIMEOUT_S:g}s", peer)
        except ValueError as e:
            self._auth_failed(f"malformed handshake: {e}", peer)
        except (ConnectionError, OSError) as e:
            self._auth_failed(f"closed during the handshake: {e}", peer)
        return False

    def _serve(self, conn: socket.socket, peer: str) -> None:
        send_lock = threading.Lock()
        head = bytearray(HEADER.size)
        buf = bytearray(0)
        try:
            try:
                authenticated = self._authenticate(conn, peer)
            finally:
                self._pending_auth.release()
            if not authenticated:
                return
            while True:
                _recv_exact(conn, memoryview(head))
                magic, ver, typ, flags, rid, a, b, c, _d, plen = HEADER.unpack(head)
                if magic != MAGIC or ver != VERSION:
                    log.warning("tcp KV: bad frame header, closing",
                                extra={"magic": bytes(magic), "version": ver, "peer": peer})
                    return
                if len(buf) < plen:
                    buf = bytearray(plen)
                payload = memoryview(buf)[:plen]
                _recv_exact(conn, payload)
                if typ == BEGIN:
                    self._begin(conn, send_lock, peer, rid, flags, a, c, payload)
                elif typ == CHUNK:
                    self._chunk(conn, send_lock, peer, rid, a, b, c, payload)
                elif typ == PROBE_GRANT:
                    self._probe_grant(conn, send_lock, rid, a)
                else:
                    log.warning("tcp KV: unexpected frame type, closing", extra={"type": typ, "peer": peer})
                    return
        except (ConnectionError, OSError):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _refuse(self, conn: socket.socket, lock: threading.Lock, peer: str, rid: int, what: str, why: str,
                late: bool) -> None:
        """A write that is not applied: ABORTED to the sender; a security event unless it
        is the request's own writer, late (module docstring)."""
        if late:
            log.info("tcp KV: late write refused", extra={"request_id": rid, "what": what, "reason": why})
        else:
            security_event("tcp_write_refused", reason=f"{what}: {why}", request_id=rid, peer=peer)
        _send(conn, lock, ABORTED, rid, payload=f"{what} refused: {why}".encode())

    def _begin(self, conn: socket.socket, lock: threading.Lock, peer: str, rid: int, flags: int, n: int,
               deadline: int, payload: memoryview) -> None:
        probe = bool(flags & FLAG_PROBE)
        target = self.probe_storage if probe else self._storage
        grants = self.probe_grants if probe else self.grants
        if len(payload) != CAPABILITY_BYTES + 8 * n:
            self.refused_begins += 1
            self._refuse(conn, lock, peer, rid, "BEGIN", f"{len(payload)} payload bytes, expected the "
                         f"{CAPABILITY_BYTES}-byte capability and {n} dst slots", late=False)
            return
        capability = bytes(payload[:CAPABILITY_BYTES])
        slots = unpack(payload[CAPABILITY_BYTES:], "i8")
        why = ""
        if n and (slots.min() < 0 or slots.max() >= target.shape[2]):
            why = f"dst slots outside the {'probe region' if probe else 'pool'} [0, {target.shape[2]})"
        elif np.unique(slots).size != slots.size:
            why = "duplicate dst slots"
        else:
            why = grants.check(rid, capability, slots, exact=True)
        with self._lock:
            req = self._requests.get(rid)
        if why:
            self.refused_begins += 1
            completed = req is not None and req.state == "completed"
            self._refuse(conn, lock, peer, rid, "BEGIN", why,
                         late=not completed and grants.late(rid, capability))
            return
        with self._lock:
            req = self._requests.get(rid)
            if req is None:
                req = _Request(n, torch.from_numpy(slots).to(self.device), deadline, probe,
                               bool(flags & FLAG_VERIFY), capability=capability, dst=slots,
                               received=np.zeros(n, dtype=bool))
                self._requests[rid] = req
                self._prune()
        with req.lock:
            state, reason, checksum = req.state, req.reason, req.checksum
        if state == "receiving":
            _send(conn, lock, BEGIN_OK, rid)
        elif state == "completed":
            _send(conn, lock, COMPLETED, rid, d=checksum)
        else:
            _send(conn, lock, ABORTED, rid, payload=reason.encode())

    def _chunk(self, conn: socket.socket, lock: threading.Lock, peer: str, rid: int, t0: int, k: int,
               remaining_ms: int, payload: memoryview) -> None:
        capability = bytes(payload[:CAPABILITY_BYTES])
        rows_bytes = payload[CAPABILITY_BYTES:]
        with self._lock:
            req = self._requests.get(rid)
        if req is None:
            self.dropped["unknown"] += 1
            CHUNKS.labels("dropped_unknown").inc()
            self._refuse(conn, lock, peer, rid, "CHUNK", "unknown request (no BEGIN)",
                         late=self.grants.late(rid, capability))
            return
        grants = self.probe_grants if req.probe else self.grants
        g = self.geometry
        reply: tuple[int, int, bytes] | None = None
        refused = ""
        with req.lock:
            if len(payload) < CAPABILITY_BYTES or not req.capability or not same_bytes(req.capability, capability):
                # not the writer that began this request: refused, the request goes on
                self.dropped["refused"] += 1
                CHUNKS.labels("dropped_refused").inc()
                refused = "wrong write capability for this request"
            elif req.state == "completed":
                self.dropped["late"] += 1
                CHUNKS.labels("dropped_late").inc()
                refused = "the request already completed"
                reply = (COMPLETED, req.checksum, b"")
            elif req.state == "aborted":
                self.dropped["aborted"] += 1
                CHUNKS.labels("dropped_aborted").inc()
                reply = (ABORTED, 0, req.reason.encode())
            elif remaining_ms <= 0 or time.time() * 1000 > req.deadline_unix_ms:
                self._end(rid, req, "aborted", "deadline passed")
                self.dropped["deadline"] += 1
                CHUNKS.labels("dropped_deadline").inc()
                reply = (ABORTED, 0, b"deadline passed")
            elif t0 + k > req.n or k <= 0 or len(rows_bytes) != g.bytes_for(k):
                self._end(rid, req, "aborted", f"chunk rows [{t0}, {t0 + k}) with {len(rows_bytes)} bytes "
                          f"do not fit the request's {req.n} tokens")
                reply = (ABORTED, 0, req.reason.encode())
            elif why := grants.check(rid, capability, req.dst[t0:t0 + k]):
                self._end(rid, req, "aborted", why)
                self.dropped["revoked"] += 1
                CHUNKS.labels("dropped_revoked").inc()
                reply = (ABORTED, 0, why.encode())
            else:
                shape = (g.n_layers, 2, k, g.n_kv_heads, g.head_dim)
                rows = torch.frombuffer(rows_bytes, dtype=torch.uint8).view(g.dtype).view(shape)
                target = self.probe_storage if req.probe else self._storage
                index_copy_kv(target, 2, req.dst_slots[t0:t0 + k], rows.to(self.device))
                fresh = ~req.received[t0:t0 + k]
                req.received[t0:t0 + k] = True
                req.count += int(fresh.sum())
                self.applied_chunks += 1
                CHUNKS.labels("applied").inc()
                RX_BYTES.inc(len(rows_bytes))
                if req.count == req.n:
                    if req.verify:
                        from pdunit.engine.kv.checksum import kv_checksum

                        req.checksum = kv_checksum(target, req.dst)
                    self._end(rid, req, "completed")
                    reply = (COMPLETED, req.checksum, b"")
        if refused:
            if reply is None:
                self._refuse(conn, lock, peer, rid, "CHUNK", refused, late=False)
                return
            security_event("tcp_write_refused", reason=f"CHUNK: {refused}", request_id=rid, peer=peer)
        if reply is not None:
            _send(conn, lock, reply[0], rid, d=reply[1], payload=reply[2])

    def _probe_grant(self, conn: socket.socket, lock: threading.Lock, rid: int, n: int) -> None:
        """A grant for probe slots [0, n) of the probe region (never the pool), for the
        authenticated peer that asked."""
        if not 0 < n <= PROBE_SLOTS:
            _send(conn, lock, ABORTED, rid, payload=f"a probe writes 1 to {PROBE_SLOTS} rows, not {n}".encode())
            return
        capability = self.probe_grants.grant(rid, np.arange(n), int(time.time() * 1000) + PROBE_GRANT_MS)
        _send(conn, lock, PROBE_GRANTED, rid, payload=capability)

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
    capability: bytes = b""  # PROBE_GRANTED


class _Conn:
    def __init__(self, host: str, port: int, secret: bytes, on_reply: object) -> None:
        self.sock = socket.create_connection((host, port), timeout=AUTH_TIMEOUT_S)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(self.sock, secret, f"{host}:{port}")
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(None)
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
                 chunk_tokens: int = 0, *, secret: bytes) -> None:
        if descriptor.mode != "tcp":
            raise TransferError(f"TcpSender needs a 'tcp' descriptor, got {descriptor.mode!r}")
        self._secret = _check_secret(secret)
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
        self._conns = []
        try:
            for _ in range(self.n_conns):
                self._conns.append(_Conn(self.host, self.port, self._secret, self._on_reply))
        except OSError as e:
            for c in self._conns:
                c.close()
            raise TransferError(f"tcp KV receiver {self.host}:{self.port} unreachable: {e}",
                                retryable=True) from e
        except TransferError:
            for c in self._conns:
                c.close()
            raise

    def _on_reply(self, typ: int, rid: int, checksum: int, payload: bytes) -> None:
        with self._lock:
            w = self._waiters.get(rid)
        if w is None:
            return
        if typ == BEGIN_OK:
            w.begun.set()
            return
        if typ == PROBE_GRANTED:
            w.capability = payload
            w.event.set()
            return
        w.state = "completed" if typ == COMPLETED else "aborted"
        w.checksum = checksum
        w.message = payload.decode(errors="replace")
        w.begun.set()
        w.event.set()

    def write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray,
              dst_slots: np.ndarray, deadline_unix_ms: int, *, capability: bytes) -> None:
        self._write(request_id, src, src_slots, dst_slots, deadline_unix_ms, 0, capability)

    def _write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray, dst_slots: np.ndarray,
               deadline_unix_ms: int, flags: int, capability: bytes) -> int:
        s = np.ascontiguousarray(src_slots, dtype=np.int64)
        d = np.ascontiguousarray(dst_slots, dtype=np.int64)
        if s.size != d.size:
            raise TransferError(f"request {request_id}: src_slots has {s.size} entries, dst_slots {d.size}")
        if len(capability) != CAPABILITY_BYTES:
            raise TransferError(f"request {request_id}: the write capability has {len(capability)} bytes, "
                                f"expected the {CAPABILITY_BYTES} of its ReserveReply.capability")
        with self._gate.writing(request_id, deadline_unix_ms):
            waiter = _Waiter()
            with self._lock:
                self._waiters[request_id] = waiter
            try:
                return self._send_request(request_id, src, s, d, deadline_unix_ms, flags, bytes(capability),
                                          waiter)
            finally:
                with self._lock:
                    self._waiters.pop(request_id, None)

    def _ensure_connected(self) -> None:
        with self._connect_lock:  # P writes from several threads: one reconnects
            if not self._conns or not all(c.alive for c in self._conns):
                self._connect()

    def _send_request(self, request_id: int, src: torch.Tensor, s: np.ndarray, d: np.ndarray,
                      deadline_unix_ms: int, flags: int, capability: bytes, waiter: _Waiter) -> int:
        """BEGIN, the chunks over every connection, then the receiver's terminal state."""
        try:
            self._ensure_connected()
            n = int(s.size)
            _send(self._conns[0].sock, self._conns[0].lock, BEGIN, request_id, flags=flags, a=n,
                  c=deadline_unix_ms, payload=pack(d, "i8"), capability=capability)
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
                          payload=rows.view(torch.uint8).numpy().data.cast("B"), capability=capability)

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

    def _probe_grant(self, request_id: int, n: int) -> bytes:
        """D's grant for n rows of its probe region, asked over the authenticated link."""
        waiter = _Waiter()
        with self._lock:
            self._waiters[request_id] = waiter
        try:
            self._ensure_connected()
            _send(self._conns[0].sock, self._conns[0].lock, PROBE_GRANT, request_id, a=n)
            if not waiter.event.wait(AUTH_TIMEOUT_S) or not waiter.capability:
                raise TransferError(f"probe {request_id}: D granted no probe slots: {waiter.message or 'no answer'}")
            return waiter.capability
        except OSError as e:
            raise TransferError(f"probe {request_id}: tcp KV connection failed: {e}", retryable=True) from e
        finally:
            with self._lock:
                self._waiters.pop(request_id, None)

    def probe(self, src: torch.Tensor, src_slots: np.ndarray, request_id: int) -> int:
        """Write rows into D's probe slots (under a probe grant D issues for them);
        returns the checksum D computed over them."""
        n = int(np.asarray(src_slots).size)
        capability = self._probe_grant(request_id, n)
        return self._write(request_id, src, src_slots, np.arange(n, dtype=np.int64),
                           int(time.time() * 1000) + PROBE_GRANT_MS, FLAG_PROBE | FLAG_VERIFY, capability)

    def quiesce(self, request_id: int) -> bool:
        """Stops sending; chunks already on the wire are D's to drop (its aborted state)."""
        return self._gate.quiesce(request_id)

    def in_flight(self) -> list[int]:
        return self._gate.in_flight()

    def close(self) -> None:
        for c in self._conns:
            c.close()
        self._pool.shutdown(wait=False)
