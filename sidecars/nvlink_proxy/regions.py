"""The proxy's region table, job validation and peer allow-list.

Owns: which regions exist, who registered them, and the rule that a copy job touches
only rows inside registered regions of matching layout. Every job is validated here
BEFORE any backend sees it: an unknown region, a slot outside [0, n_slots), a length
mismatch, duplicate destination slots or a layout mismatch raises `JobRejected` and
nothing is copied. Peers are admitted by their kernel-reported credentials
(SO_PEERCRED on the auth socket), never by anything they claim about themselves.

Must never map memory or launch copies (the backends do), and never trust a slot
array it has not checked.
"""

from __future__ import annotations

import math
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdunit.sidecars.nvlink_proxy import proxy_pb2 as pb

ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1}
_POSITIONS = np.arange(1 << 17, dtype=np.int64)  # read-only: 0..n-1 without an arange per job
_POSITIONS.flags.writeable = False


class JobRejected(Exception):
    """A request the proxy refuses; `code` names the gRPC status (NOT_FOUND, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PeerCreds:
    pid: int
    uid: int
    gid: int


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
    kind: int
    layout: Layout
    size_bytes: int
    owner: PeerCreds
    gpu_uuid: str = ""
    ipc_handle: bytes = b""
    offset_bytes: int = 0
    owner_pid: int = 0
    owner_fd: int = -1
    alloc_bytes: int = 0
    shm_name: str = ""
    backend_state: dict[str, Any] = field(default_factory=dict)

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
    return np.frombuffer(raw, dtype="<i8")


class RegionTable:
    """Thread-safe table of registered regions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._local = threading.local()

    def add(self, req: pb.RegisterRequest, owner: PeerCreds) -> Region:
        layout = validate_registration(req)
        region = Region(
            region_id=f"r-{secrets.token_hex(8)}", name=req.name or "unnamed", kind=req.kind,
            layout=layout, size_bytes=int(req.size_bytes), owner=owner, gpu_uuid=req.gpu_uuid,
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

    def remove(self, region_id: str, caller: PeerCreds) -> Region:
        with self._lock:
            region = self._regions.get(region_id)
            if region is None:
                raise JobRejected("NOT_FOUND", f"region {region_id!r} is not registered")
            if region.owner.uid != caller.uid or (region.owner.pid and caller.pid
                                                  and region.owner.pid != caller.pid):
                raise JobRejected("PERMISSION_DENIED",
                                  f"region {region_id!r} belongs to pid {region.owner.pid}; "
                                  "only its owner may unregister it")
            return self._regions.pop(region_id)

    def all(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())

    def job(self, req: pb.CopyRequest) -> Job:
        """Validate a copy request completely; raises JobRejected, copies nothing."""
        src = self.get(req.src_region, "source")
        dst = self.get(req.dst_region, "destination")
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
    """Session tokens handed out on the auth socket to allowed peers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[PeerCreds, float]] = {}

    def issue(self, creds: PeerCreds) -> str:
        token = secrets.token_hex(24)
        with self._lock:
            self._tokens[token] = (creds, time.time())
        return token

    def lookup(self, token: str) -> PeerCreds | None:
        with self._lock:
            entry = self._tokens.get(token)
        return entry[0] if entry else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)


def layout_bytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * ELEMENT_BYTES[dtype]
