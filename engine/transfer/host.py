"""The `host` KV transport: D's pool lives in POSIX shared memory (/dev/shm) and P copies
rows straight into it. For CPU runs (tests, `pdunit local` without GPUs).

Owns the shared-memory segment's life (D creates, zeroes and unlinks it; P only maps it)
and the sender's quiesce proof (`HostSender`). Must never decide page ownership (D's pool
does) and must never let P unlink D's segment: the sender maps the file with
torch.from_file, so Python's resource_tracker never learns about it in P. D registers its
own segment with the tracker, so a crashed D does not leak /dev/shm.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
from multiprocessing import resource_tracker

import numpy as np
import torch

from pdunit.engine.model.config import dtype_name, torch_dtype
from pdunit.engine.transfer.base import (
    Descriptor,
    KVReceiver,
    KVSender,
    PoolGeometry,
    TransferError,
    WriteGate,
)
from pdunit.kernels.reference import copy_rows, validate_copy

SHM_DIR = "/dev/shm"

# Cancelled request ids remembered by a sender. The set only has to outlive the race
# between a write already dequeued in P and the quiesce of its request (milliseconds);
# P drops a cancelled request's queued work itself. Bounded so a long-lived P does not
# grow without limit.


def _numel(geometry: PoolGeometry) -> int:
    return math.prod(geometry.shape())


def _segment_bytes(geometry: PoolGeometry) -> int:
    return geometry.bytes_for(geometry.n_slots)


class HostReceiver(KVReceiver):
    """D's side. In containers /dev/shm is often small (Docker's default is 64 MiB):
    the receiver reserves the whole segment up front (posix_fallocate), so a short
    /dev/shm fails at start with a clear error instead of a SIGBUS on the first write."""

    mode = "host"

    def __init__(self, geometry: PoolGeometry, name: str | None = None) -> None:
        self.geometry = geometry
        self.name = name or f"pdunit-kv-{os.getpid()}-{secrets.token_hex(6)}"
        if "/" in self.name or not self.name:
            raise ValueError(f"shared memory name {self.name!r} must be non-empty without '/'")
        self.path = os.path.join(SHM_DIR, self.name)
        size = _segment_bytes(geometry)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise TransferError(
                f"shared memory segment {self.path} already exists: another D uses the name, "
                "or a dead one left it (remove it, or pick another name)"
            ) from None
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            os.unlink(self.path)
            free = _free_shm_bytes()
            raise TransferError(
                f"cannot reserve {size} bytes of KV pool in {SHM_DIR} ({e.strerror}; about "
                f"{free} bytes free there): shrink the pool (fewer slots) or enlarge {SHM_DIR} "
                "(in Kubernetes: an emptyDir with medium Memory mounted at /dev/shm)"
            ) from e
        os.close(fd)
        # The tracker unlinks the segment if this process dies without close().
        resource_tracker.register("/" + self.name, "shared_memory")
        self._storage = torch.from_file(
            self.path, shared=True, size=_numel(geometry), dtype=geometry.dtype
        ).view(geometry.shape())
        self._closed = False

    @property
    def storage(self) -> torch.Tensor:
        return self._storage

    def descriptors(self) -> list[Descriptor]:
        return [
            Descriptor(
                "host",
                {
                    "shm_name": self.name,
                    "shape": ",".join(str(d) for d in self.geometry.shape()),
                    "dtype": dtype_name(self.geometry.dtype),
                },
            )
        ]

    def close(self) -> None:
        """Unlink the segment. Mappings (this storage, attached senders) stay valid until
        they are dropped; the memory returns to the system after the last one."""
        if self._closed:
            return
        self._closed = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        resource_tracker.unregister("/" + self.name, "shared_memory")


def _free_shm_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
        return st.f_bavail * st.f_frsize
    except OSError:
        return -1


class HostSender(KVSender):
    """P's side. Quiesce proof (PROTOCOL.md 3.5): writes are counted per request id
    under a lock; once `quiesce(req)` marked a request cancelled no write of it starts,
    and a write already running stops at its next chunk boundary. `quiesce` returns True
    only when no write of the request is running, so after True nothing of it can land."""

    mode = "host"

    def __init__(
        self,
        descriptor: Descriptor,
        geometry: PoolGeometry,
        chunk_tokens: int = 0,
        chunk_delay_s: float = 0.0,
    ) -> None:
        if descriptor.mode != "host":
            raise TransferError(f"HostSender needs a 'host' descriptor, got {descriptor.mode!r}")
        missing = [k for k in ("shm_name", "shape", "dtype") if k not in descriptor.params]
        if missing:
            raise TransferError(f"host descriptor lacks {', '.join(missing)}")
        if chunk_tokens < 0 or chunk_delay_s < 0:
            raise ValueError(
                f"chunk_tokens ({chunk_tokens}) and chunk_delay_s ({chunk_delay_s}) must be >= 0"
            )
        name = descriptor.params["shm_name"]
        shape = tuple(int(x) for x in descriptor.params["shape"].split(","))
        if shape != geometry.shape():
            raise TransferError(
                f"D's pool {name} has shape {list(shape)} but P expects {list(geometry.shape())} "
                "[n_layers, 2, n_slots, n_kv_heads, head_dim]: P and D must run the same model "
                "and pool size"
            )
        try:
            dtype = torch_dtype(descriptor.params["dtype"], pool=True)
        except ValueError as e:
            raise TransferError(f"D's pool {name}: {e}") from None
        if dtype != geometry.dtype:
            raise TransferError(
                f"D's pool {name} has dtype {dtype_name(dtype)} but P's KV is "
                f"{dtype_name(geometry.dtype)}: run both with the same --dtype and --kv-cache-dtype"
            )
        self.path = os.path.join(SHM_DIR, name)
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            raise TransferError(
                f"shared memory segment {self.path} not found: D is not running, or P and D do "
                "not share /dev/shm (same pod or same host namespace)"
            ) from None
        if size != _segment_bytes(geometry):
            raise TransferError(
                f"shared memory segment {self.path} has {size} bytes, the geometry needs "
                f"{_segment_bytes(geometry)}"
            )
        self.geometry = geometry
        self.chunk_tokens = chunk_tokens
        self.chunk_delay_s = chunk_delay_s
        self._dst: torch.Tensor | None = torch.from_file(
            self.path, shared=True, size=_numel(geometry), dtype=geometry.dtype
        ).view(geometry.shape())
        self._lock = threading.Lock()  # guards _dst (close detaches it)
        self._gate = WriteGate()

    def write(
        self,
        request_id: int,
        src: torch.Tensor,
        src_slots: np.ndarray,
        dst_slots: np.ndarray,
        deadline_unix_ms: int,
        *,
        capability: bytes,
    ) -> None:
        """`capability` goes unchecked: P writes D's shared memory itself (base.py)."""
        with self._lock:
            dst = self._dst
        if dst is None:
            raise TransferError(f"request {request_id}: sender is closed")
        with self._gate.writing(request_id, deadline_unix_ms):
            s = torch.from_numpy(np.ascontiguousarray(src_slots, dtype=np.int64))
            d = torch.from_numpy(np.ascontiguousarray(dst_slots, dtype=np.int64))
            try:
                validate_copy(src, s, dst, d)
            except ValueError as e:
                raise TransferError(f"request {request_id}: {e}") from e
            n = s.numel()
            step = self.chunk_tokens or max(n, 1)
            for start in range(0, n, step):
                if start:
                    if self.chunk_delay_s:
                        time.sleep(self.chunk_delay_s)
                    self._gate.check(request_id, deadline_unix_ms, f"stopped after {start} of {n} rows")
                copy_rows(src, s[start : start + step], dst, d[start : start + step])

    def quiesce(self, request_id: int) -> bool:
        return self._gate.quiesce(request_id)

    def in_flight(self) -> list[int]:
        return self._gate.in_flight()

    def close(self) -> None:
        """Detach: later writes are refused. Never unlinks D's segment."""
        with self._lock:
            self._dst = None
