"""The proxy's region table, write grants, job validation, sessions and allow-list.

Owns which regions exist and which session registered each; the write grants (PROTOCOL.md
3.1: the capability a destination region's owner made for one request and its slots);
and the rule that a job touches only rows inside registered regions of matching layout.
Every job is validated here BEFORE any backend sees it: a bad region, slot, length,
duplicate destination slot or layout raises `JobRejected`, a write without its grant
`Refused` (a security event); nothing is copied either way. Peers are admitted by their
SO_PEERCRED credentials, never by what they claim. Must never map memory or launch copies
(the backends do), and never trust a slot array or a capability it has not checked.
"""

from __future__ import annotations

import math
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdunit.engine.packing import view
from pdunit.engine.proto import proxy_pb2 as pb
from pdunit.engine.security import same_bytes
from pdunit.engine.transfer.base import CAPABILITY_BYTES

ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1}
_POSITIONS = np.arange(1 << 17, dtype=np.int64)  # read-only: 0..n-1 without an arange per job
_POSITIONS.flags.writeable = False


class JobRejected(Exception):
    """A request the proxy refuses; `code` names the gRPC status (NOT_FOUND, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Refused(JobRejected):
    """A request only an attacker or a bug makes (another session's region, a write
    without its grant): PERMISSION_DENIED, and reported as security event `what`."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__("PERMISSION_DENIED", message)
        self.what = what


@dataclass(frozen=True)
class PeerCreds:
    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Session:
    """One handshake on the auth socket: `token` (secret, sent with every call) and
    `session_id` (public, for logs and ownership)."""

    token: str
    session_id: str
    creds: PeerCreds


@dataclass(frozen=True)
class Layout:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    n_slots: int

    @property
    def row_bytes(self) -> int:
        return self.n_kv_heads * self.head_dim * ELEMENT_BYTES[self.dtype]

    @property
    def planes(self) -> int:
        return self.n_layers * 2

    @property
    def nbytes(self) -> int:
        return self.planes * self.n_slots * self.row_bytes

    @property
    def plane_stride(self) -> int:
        return self.n_slots * self.row_bytes

    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.n_layers, 2, self.n_slots, self.n_kv_heads, self.head_dim)

    def row_geometry(self) -> tuple[int, int, int, str]:
        return (self.n_layers, self.n_kv_heads, self.head_dim, self.dtype)

    @classmethod
    def from_pb(cls, m: pb.Layout) -> Layout:
        return cls(int(m.n_layers), int(m.n_kv_heads), int(m.head_dim), m.dtype, int(m.n_slots))

    def to_pb(self) -> pb.Layout:
        return pb.Layout(n_layers=self.n_layers, n_kv_heads=self.n_kv_heads,
                         head_dim=self.head_dim, dtype=self.dtype, n_slots=self.n_slots)


@dataclass
class Region:
    region_id: str
    name: str
    kind: pb.RegionKind
    layout: Layout
    size_bytes: int
    owner: PeerCreds
    owner_session: str
    gpu_uuid: str = ""
    ipc_handle: bytes = b""
    offset_bytes: int = 0
    owner_pid: int = 0
    owner_fd: int = -1
    alloc_bytes: int = 0
    shm_name: str = ""
    backend_state: dict[str | tuple[Any, ...], Any] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.kind in (pb.CUDA_IPC, pb.CUDA_POSIX_FD)


@dataclass(frozen=True)
class Job:
    request_id: int
    src: Region
    dst: Region
    src_slots: np.ndarray
    dst_slots: np.ndarray

    @property
    def n(self) -> int:
        return int(self.src_slots.size)

    @property
    def nbytes(self) -> int:
        return self.n * self.src.layout.planes * self.src.layout.row_bytes


def validate_registration(req: pb.RegisterRequest) -> Layout:
    """Check a registration's fields; the message names the field and the fix."""
    if not req.HasField("layout"):
        raise JobRejected("INVALID_ARGUMENT", "register: layout is required")
    layout = Layout.from_pb(req.layout)
    if layout.dtype not in ELEMENT_BYTES:
        raise JobRejected("INVALID_ARGUMENT",
                          f"register: layout.dtype {layout.dtype!r} is not one of {sorted(ELEMENT_BYTES)}")
    for fname in ("n_layers", "n_kv_heads", "head_dim", "n_slots"):
        if getattr(layout, fname) <= 0:
            raise JobRejected("INVALID_ARGUMENT", f"register: layout.{fname} must be > 0")
    if req.size_bytes < layout.nbytes:
        raise JobRejected("INVALID_ARGUMENT",
                          f"register: size_bytes {req.size_bytes} is smaller than the layout "
                          f"{list(layout.shape())} {layout.dtype} needs ({layout.nbytes})")
    if req.kind == pb.HOST_SHM:
        if not req.shm_name or "/" in req.shm_name:
            raise JobRejected("INVALID_ARGUMENT", "register: HOST_SHM needs shm_name without '/'")
    elif req.kind == pb.CUDA_IPC:
        if len(req.ipc_handle) != 64:
            raise JobRejected("INVALID_ARGUMENT",
                              f"register: ipc_handle has {len(req.ipc_handle)} bytes, expected 64")
        if not req.gpu_uuid.startswith("GPU-"):
            raise JobRejected("INVALID_ARGUMENT",
                              f"register: gpu_uuid {req.gpu_uuid!r} must be a GPU UUID (GPU-...), never an index")
        if req.offset_bytes < 0:
            raise JobRejected("INVALID_ARGUMENT", "register: offset_bytes must be >= 0")
    elif req.kind == pb.CUDA_POSIX_FD:
        if req.owner_pid <= 0 or req.owner_fd < 0 or req.alloc_bytes < req.size_bytes:
            raise JobRejected("INVALID_ARGUMENT",
                              "register: CUDA_POSIX_FD needs owner_pid > 0, owner_fd >= 0 and "
                              "alloc_bytes >= size_bytes")
        if not req.gpu_uuid.startswith("GPU-"):
            raise JobRejected("INVALID_ARGUMENT",
                              f"register: gpu_uuid {req.gpu_uuid!r} must be a GPU UUID (GPU-...)")
    else:
        raise JobRejected("INVALID_ARGUMENT", f"register: unknown region kind {req.kind}")
    return layout


def _slots(raw: bytes, what: str) -> np.ndarray:
    if len(raw) % 8:
        raise JobRejected("INVALID_ARGUMENT", f"{what} has {len(raw)} bytes, not a packed int64 array")
    return view(raw, "i8")


class RegionTable:
    """Thread-safe table of registered regions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._local = threading.local()

    def add(self, req: pb.RegisterRequest, owner: Session) -> Region:
        layout = validate_registration(req)
        region = Region(  # 128 random bits: a region id is never guessed
            region_id=f"r-{secrets.token_hex(16)}", name=req.name or "unnamed", kind=req.kind,
            layout=layout, size_bytes=int(req.size_bytes), owner=owner.creds,
            owner_session=owner.session_id, gpu_uuid=req.gpu_uuid,
            ipc_handle=bytes(req.ipc_handle), offset_bytes=int(req.offset_bytes),
            owner_pid=int(req.owner_pid), owner_fd=int(req.owner_fd),
            alloc_bytes=int(req.alloc_bytes), shm_name=req.shm_name,
        )
        with self._lock:
            self._regions[region.region_id] = region
        return region

    def get(self, region_id: str, role: str) -> Region:
        with self._lock:
            region = self._regions.get(region_id)
        if region is None:
            raise JobRejected("NOT_FOUND", f"{role} region {region_id!r} is not registered "
                                           "(register it first; the proxy may have restarted)")
        return region

    def owned(self, region_id: str, caller: Session, action: str) -> Region:
        """The region, when `caller` registered it; else Refused (another session's)."""
        region = self.get(region_id, action)
        if region.owner_session != caller.session_id:
            raise Refused("proxy_foreign_region",
                          f"{action} region {region_id!r} belongs to another session: a session may "
                          "only use the regions it registered (write into another's through its grant)")
        return region

    def remove(self, region_id: str, caller: Session) -> Region:
        self.owned(region_id, caller, "unregister:")
        with self._lock:
            return self._regions.pop(region_id)

    def all(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())

    def of_session(self, session_id: str) -> list[Region]:
        with self._lock:
            return [r for r in self._regions.values() if r.owner_session == session_id]

    def job(self, req: pb.CopyRequest, caller: Session, dst_region: str) -> Job:
        """Validate a copy request completely: the source must be the caller's own region;
        `dst_region` is the one the request's grant names (GrantTable.region_for).
        Raises JobRejected (Refused for another session's source), copies nothing; the
        caller then checks the destination's grant (GrantTable.check)."""
        src = self.owned(req.src_region, caller, "source")
        dst = self.get(dst_region, "destination")
        if src.layout.row_geometry() != dst.layout.row_geometry():
            raise JobRejected("INVALID_ARGUMENT",
                              f"source layout {src.layout.row_geometry()} differs from destination "
                              f"{dst.layout.row_geometry()} (n_layers, n_kv_heads, head_dim, dtype)")
        if src.is_cuda != dst.is_cuda:
            raise JobRejected("INVALID_ARGUMENT",
                              "source and destination must both be GPU regions or both host "
                              f"regions (source {pb.RegionKind.Name(src.kind)}, destination "
                              f"{pb.RegionKind.Name(dst.kind)})")
        s = _slots(req.src_slots, "src_slots")
        d = _slots(req.dst_slots, "dst_slots")
        if s.size != d.size:
            raise JobRejected("INVALID_ARGUMENT", f"src_slots has {s.size} entries, dst_slots {d.size}")
        if s.size == 0:
            raise JobRejected("INVALID_ARGUMENT", "empty job: src_slots and dst_slots hold no entries")
        for arr, region, what in ((s, src, "src_slots"), (d, dst, "dst_slots")):
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= region.layout.n_slots:
                bad = lo if lo < 0 else hi
                raise JobRejected("OUT_OF_RANGE",
                                  f"{what} holds slot {bad}, outside region {region.name!r} "
                                  f"[0, {region.layout.n_slots})")
        if self._has_duplicates(d, dst.layout.n_slots):
            raise JobRejected("INVALID_ARGUMENT",
                              "dst_slots holds duplicate slots: two rows would race for one slot")
        return Job(int(req.request_id), src, dst, s, d)

    def _has_duplicates(self, slots: np.ndarray, n_slots: int) -> bool:
        """O(n), no sort: write each entry's position at its slot in a per-thread scratch
        table; a duplicated slot keeps only the last writer, so some entry reads back
        another position. `slots` must already be inside [0, n_slots)."""
        table: np.ndarray | None = getattr(self._local, "table", None)
        if table is None or table.size < n_slots:
            table = self._local.table = np.empty(max(n_slots, 1024), dtype=np.int64)
        if _POSITIONS.size < slots.size:
            return np.unique(slots).size != slots.size  # larger than any real job: rare path
        pos = _POSITIONS[:slots.size]
        table[slots] = pos
        return not np.array_equal(table[slots], pos)


# ----------------------------------------------------------------- allow-list
def peer_creds(conn: socket.socket) -> PeerCreds:
    """The connecting process's pid/uid/gid as the kernel reports them (SO_PEERCRED).
    pid is 0 when the peer lives in a PID namespace this process cannot see."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCreds(pid, uid, gid)


@dataclass
class AllowList:
    uids: frozenset[int]
    gids: frozenset[int] = frozenset()

    def check(self, creds: PeerCreds) -> str | None:
        """None when allowed, else the reason."""
        if creds.uid in self.uids or (self.gids and creds.gid in self.gids):
            return None
        return (f"peer pid {creds.pid} uid {creds.uid} gid {creds.gid} is not on the allow-list "
                f"(uids {sorted(self.uids)}, gids {sorted(self.gids)}); add it with --allow-uids")


class Sessions:
    """Session tokens handed out on the auth socket to allowed peers. Beyond
    `max_sessions`, the oldest sessions that own nothing (`in_use` False) are forgotten,
    so a peer that handshakes in a loop cannot grow the table without bound."""

    def __init__(self, max_sessions: int = 4096) -> None:
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.max_sessions = max_sessions

    def issue(self, creds: PeerCreds, in_use: Callable[[Session], bool] = lambda _s: False) -> Session:
        session = Session(token=secrets.token_hex(24), session_id=f"s-{secrets.token_hex(8)}", creds=creds)
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                for token in [t for t, old in self._sessions.items() if not in_use(old)]:
                    del self._sessions[token]
                    if len(self._sessions) < self.max_sessions:
                        break
            self._sessions[session.token] = session
        return session

    def lookup(self, token: str) -> Session | None:
        with self._lock:
            return self._sessions.get(token)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)


@dataclass(frozen=True)
class WriteGrant:
    """What a destination region's owner allowed: writes of `request_id` (None: any
    request id, D's probe region) into `slots` (sorted, unique) until the deadline."""

    region_id: str
    request_id: int | None
    capability: bytes
    slots: np.ndarray
    deadline_unix_ms: int


class GrantTable:
    """The live write grants of every region (PROTOCOL.md 3.1), under one lock. A grant
    lives from its owner's Grant (RESERVE) to its Revoke (COMMIT, ABORT, held), its
    deadline, or its region's unregistration; a job whose destination rows it does not
    cover is refused. The capabilities of the latest `memory` ended grants are kept, so
    a late write of a stalled but authorised writer is refused as late (FAILED_PRECONDITION),
    not reported as an attack."""

    def __init__(self, memory: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._by_request: dict[int, dict[str, WriteGrant]] = {}  # request id -> region id -> grant
        self._standing: dict[str, WriteGrant] = {}                # region id -> any-request grant
        self._ended: OrderedDict[tuple[int, bytes], None] = OrderedDict()  # (request id, capability)
        self._memory = memory

    def _end(self, g: WriteGrant) -> None:
        """Under the lock: remember an ended grant's capability."""
        if g.request_id is None:
            return
        self._ended[(g.request_id, g.capability)] = None
        while len(self._ended) > self._memory:
            self._ended.popitem(last=False)

    def _late(self, request_id: int, capability: bytes) -> JobRejected | None:
        with self._lock:
            ended = (request_id, bytes(capability)) in self._ended
        if not ended:
            return None
        return JobRejected("FAILED_PRECONDITION",
                           f"request {request_id}: its write grant ended (COMMIT, ABORT or deadline): "
                           "late write refused, nothing copied")

    def grant(self, region: Region, request_id: int | None, capability: bytes, raw_slots: bytes,
              deadline_unix_ms: int) -> WriteGrant:
        if len(capability) != CAPABILITY_BYTES:
            raise JobRejected("INVALID_ARGUMENT", f"grant: capability has {len(capability)} bytes, "
                                                  f"expected {CAPABILITY_BYTES} random bytes")
        slots = np.unique(_slots(raw_slots, "grant: dst_slots"))
        if slots.size and (slots[0] < 0 or slots[-1] >= region.layout.n_slots):
            raise JobRejected("OUT_OF_RANGE", f"grant: dst_slots outside region {region.name!r} "
                                              f"[0, {region.layout.n_slots})")
        g = WriteGrant(region.region_id, request_id, bytes(capability), slots, int(deadline_unix_ms))
        with self._lock:
            if request_id is None:
                self._standing[region.region_id] = g
            else:
                self._by_request.setdefault(request_id, {})[region.region_id] = g
        return g

    def revoke(self, region_id: str, request_id: int) -> bool:
        with self._lock:
            mine = self._by_request.get(request_id)
            g = mine.pop(region_id, None) if mine is not None else None
            if g is None:
                return False
            self._end(g)
            if not mine:
                del self._by_request[request_id]
            return True

    def drop_region(self, region_id: str) -> None:
        with self._lock:
            self._standing.pop(region_id, None)
            for rid in [rid for rid, g in self._by_request.items() if region_id in g]:
                self._end(self._by_request[rid].pop(region_id))
                if not self._by_request[rid]:
                    del self._by_request[rid]

    def region_for(self, request_id: int, capability: bytes) -> str:
        """The destination region a job names by its capability alone (CopyRequest with an
        empty dst_region: P need not learn D's region ids again after a proxy restart)."""
        with self._lock:
            candidates = list(self._by_request.get(request_id, {}).values())
        for g in candidates:
            if same_bytes(g.capability, bytes(capability)):
                return g.region_id
        late = self._late(request_id, capability)
        if late is not None:
            raise late
        raise Refused("proxy_write_refused",
                      f"request {request_id}: no live grant matches the capability (never granted, "
                      "revoked at COMMIT/ABORT, or the proxy restarted and D has not granted it again)")

    def check(self, region: Region, request_id: int, capability: bytes, dst_slots: np.ndarray) -> None:
        """Raises Refused unless a live grant of `region` allows these rows."""
        with self._lock:
            g = self._by_request.get(request_id, {}).get(region.region_id) or self._standing.get(region.region_id)
        if g is None:
            late = self._late(request_id, capability)
            if late is not None:
                raise late
            raise Refused("proxy_write_refused",
                          f"request {request_id}: no live grant for destination region {region.name!r} "
                          "(never granted, revoked at COMMIT/ABORT, or granted to another region)")
        if not same_bytes(g.capability, bytes(capability)):
            raise Refused("proxy_write_refused",
                          f"request {request_id}: wrong write capability for region {region.name!r} "
                          "(present the one of this request's RESERVE)")
        late_ms = time.time() * 1000 - g.deadline_unix_ms
        if g.deadline_unix_ms and late_ms > 0:  # its own writer, late: refused, not an attack
            raise JobRejected("FAILED_PRECONDITION",
                              f"request {request_id}: its grant on {region.name!r} expired {late_ms:.0f} ms "
                              "ago: late write refused, nothing copied")
        inside = np.isin(dst_slots, g.slots)
        if not bool(inside.all()):
            bad = int(dst_slots[~inside][0])
            raise Refused("proxy_write_refused",
                          f"request {request_id}: dst_slots holds slot {bad}, outside the slots its grant "
                          f"on {region.name!r} allows")

    def prune(self, now_unix_ms: float) -> int:
        """Drop grants whose deadline passed; returns how many."""
        with self._lock:
            dead = [(rid, reg) for rid, gs in self._by_request.items() for reg, g in gs.items()
                    if g.deadline_unix_ms and g.deadline_unix_ms < now_unix_ms]
            for rid, reg in dead:
                self._end(self._by_request[rid].pop(reg))
                if not self._by_request[rid]:
                    del self._by_request[rid]
        return len(dead)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(g) for g in self._by_request.values()) + len(self._standing)


def layout_bytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * ELEMENT_BYTES[dtype]
