"""Direct GPU transports (ipc, posix-fd, fabric): P maps D's pool and writes rows into it
with one copy kernel on P's GPU (source local, destination over the peer link).

Owns what the three share: the receiver's pool + probe allocation and descriptor
(`DirectReceiver`), the sender's mapping, writes, quiesce proof and verified probe
(`DirectSender`). The modes differ only in how memory is exported and imported (ipc.py,
posix_fd.py, fabric.py). Must never decide page ownership, and a probe never touches
pool slots.
"""

from __future__ import annotations

import abc
import os
from typing import Any

import numpy as np
import torch

from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.transfer.base import (
    Descriptor,
    KVReceiver,
    KVSender,
    PoolGeometry,
    TransferError,
    WriteGate,
    exact_pattern,
)
from pdunit.kernels import cudadrv

PROBE_SLOTS = 16
PATTERN_SLOTS = 8
# Identifies this process across PID namespaces (two pods' processes can share a pid).
PROCESS_TOKEN = os.urandom(8).hex()


def probe_shape(geometry: PoolGeometry) -> tuple[int, int, int, int, int]:
    return (geometry.n_layers, 2, PROBE_SLOTS, geometry.n_kv_heads, geometry.head_dim)


def pattern(geometry: PoolGeometry, seed: int) -> torch.Tensor:
    """Deterministic probe pattern for slots [0, PATTERN_SLOTS) (CPU tensor)."""
    shape = (geometry.n_layers, 2, PATTERN_SLOTS, geometry.n_kv_heads, geometry.head_dim)
    return exact_pattern(shape, geometry.dtype, seed)


def _cuda_index(device: str | torch.device) -> int:
    dev = torch.device(device)
    if dev.type != "cuda":
        raise TransferError(f"direct GPU transports need a CUDA device, got {device!r}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


class DirectReceiver(KVReceiver):
    """D's side: the pool and the probe region, exported by the subclass.

    Verified probe (never a device attribute): D fills probe slots [0, PATTERN) with a
    pattern and publishes its checksum; P reads them through its mapping (proves the
    mapping reaches D's real memory), then writes rows into slots [PATTERN, PROBE) and
    reads them back (proves writes land)."""

    mode = ""

    def __init__(self, geometry: PoolGeometry, device: str) -> None:
        self.geometry = geometry
        self.ordinal = _cuda_index(device)
        self.gpu_uuid = cudadrv.device_uuid(self.ordinal)
        torch.cuda.set_device(self.ordinal)
        self._storage, self.pool_export = self._allocate(geometry.bytes_for(geometry.n_slots), geometry.shape())
        self.probe, self.probe_export = self._allocate(
            geometry.bytes_for(PROBE_SLOTS), probe_shape(geometry))
        self.seed = int.from_bytes(os.urandom(4), "little")
        self.probe.zero_()
        self.probe[:, :, :PATTERN_SLOTS].copy_(pattern(geometry, self.seed))
        torch.cuda.synchronize(self.ordinal)
        self.pattern_checksum = kv_checksum(self.probe, np.arange(PATTERN_SLOTS))

    @abc.abstractmethod
    def _allocate(self, nbytes: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Allocate exportable memory; returns the tensor and what the descriptor needs."""

    @abc.abstractmethod
    def _describe(self) -> tuple[dict[str, str], bytes]:
        """Mode-specific descriptor params and handle bytes."""

    @property
    def storage(self) -> torch.Tensor:
        return self._storage

    def descriptors(self) -> list[Descriptor]:
        params, handle = self._describe()
        params.update({
            "gpu_uuid": self.gpu_uuid, "pid": str(os.getpid()), "process": PROCESS_TOKEN,
            "n_slots": str(self.geometry.n_slots), "probe_slots": str(PROBE_SLOTS),
            "pattern_slots": str(PATTERN_SLOTS), "pattern_checksum": str(self.pattern_checksum),
        })
        return [Descriptor(self.mode, params, handle)]


class DirectSender(KVSender):
    """P's side. Quiesce: a write is synchronous (kernel launched and finished inside
    `write`), so a request is quiesced when no write of it runs and it is marked cancelled."""

    mode = ""

    _owners: list[Any]  # what keeps D's mapped memory open (per subclass); released by close()

    def __init__(self, descriptor: Descriptor, geometry: PoolGeometry, device: str) -> None:
        if descriptor.mode != self.mode:
            raise TransferError(f"{type(self).__name__} needs a {self.mode!r} descriptor, got {descriptor.mode!r}")
        self.geometry = geometry
        self.ordinal = _cuda_index(device)
        self.params = descriptor.params
        if int(descriptor.params.get("n_slots", geometry.n_slots)) != geometry.n_slots:
            raise TransferError(f"D's pool has {descriptor.params['n_slots']} slots, P expects {geometry.n_slots}")
        # Open both regions in P's own device context: the kernel runs on P's GPU and
        # writes D's memory over the peer link.
        self.dst_ptr, self.probe_ptr, owners = self._open(descriptor)
        self._owners = owners
        self._gate = WriteGate()

    @abc.abstractmethod
    def _open(self, descriptor: Descriptor) -> tuple[int, int, list[Any]]:
        """Map D's pool and probe region for P's device: (pool ptr, probe ptr, owners)."""

    def _copy(self, src: torch.Tensor, src_slots: np.ndarray, dst_ptr: int, dst_slots: np.ndarray,
              dst_n_slots: int) -> None:
        from pdunit.kernels import cuda_rows

        if src.device.index != self.ordinal:
            raise TransferError(f"source pool is on {src.device}, this sender writes from cuda:{self.ordinal}")
        g = self.geometry
        row_bytes = g.row_bytes
        # Stream order, not a device sync: the rows were written by work ordered before
        # the caller's current stream (P's transfer stage waits on the forward's event),
        # and a device-wide sync would also wait for the next batch's forward.
        c = cuda_rows.copier(self.ordinal)
        stream = torch.cuda.current_stream(src.device).cuda_stream
        c.launch(src.data_ptr(), dst_ptr, src_slots, dst_slots, int(src_slots.size), g.n_layers * 2,
                 src.shape[2] * row_bytes, dst_n_slots * row_bytes, row_bytes, stream)
        c.sync(stream)

    def write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray,
              dst_slots: np.ndarray, deadline_unix_ms: int, *, capability: bytes) -> None:
        """`capability` goes unchecked: P writes D's mapped memory itself (base.py)."""
        s = np.ascontiguousarray(src_slots, dtype=np.int64)
        d = np.ascontiguousarray(dst_slots, dtype=np.int64)
        if s.size != d.size:
            raise TransferError(f"request {request_id}: src_slots has {s.size} entries, dst_slots {d.size}")
        if d.size and (d.min() < 0 or d.max() >= self.geometry.n_slots or np.unique(d).size != d.size):
            raise TransferError(f"request {request_id}: dst_slots out of [0, {self.geometry.n_slots}) or duplicated")
        if s.size and (s.min() < 0 or s.max() >= src.shape[2]):
            raise TransferError(f"request {request_id}: src_slots out of [0, {src.shape[2]})")
        with self._gate.writing(request_id, deadline_unix_ms):
            try:
                self._copy(src, s, self.dst_ptr, d, self.geometry.n_slots)
            except cudadrv.CudaError as e:
                raise TransferError(f"request {request_id}: {self.mode} copy failed: {e}") from e

    def probe(self, src: torch.Tensor, src_slots: np.ndarray, request_id: int) -> tuple[int, int]:
        """Verify the mapping: D's published pattern reads back, then written rows read
        back. Returns (expected, seen) checksums of the written rows."""
        seen_pattern = kv_checksum(self._read_probe(), np.arange(PATTERN_SLOTS))
        want_pattern = int(self.params.get("pattern_checksum", "-1"))
        if seen_pattern != want_pattern:
            raise TransferError(f"{self.mode}: D's probe pattern reads back as checksum {seen_pattern}, "
                                f"D published {want_pattern}: the mapping does not reach D's memory")
        n = int(src_slots.size)
        if n > PROBE_SLOTS - PATTERN_SLOTS:
            raise TransferError(f"probe writes at most {PROBE_SLOTS - PATTERN_SLOTS} rows")
        dst = np.arange(PATTERN_SLOTS, PATTERN_SLOTS + n, dtype=np.int64)
        self._copy(src, np.ascontiguousarray(src_slots, dtype=np.int64), self.probe_ptr, dst, PROBE_SLOTS)
        return kv_checksum(src, src_slots), kv_checksum(self._read_probe(), dst)

    def _read_probe(self) -> torch.Tensor:
        """D's probe region, read through P's own mapping into a local tensor.

        Not a torch view of the mapped pointer: torch would attribute that memory to
        the GPU that owns it (D's) and run its kernels there, where this mapping has no
        access rights (seen on H200: illegal address)."""
        from pdunit.kernels import cuda_rows

        g = self.geometry
        local = torch.empty(probe_shape(g), dtype=g.dtype, device=f"cuda:{self.ordinal}")
        plane = PROBE_SLOTS * g.row_bytes
        c = cuda_rows.copier(self.ordinal)
        stream = torch.cuda.current_stream(local.device).cuda_stream
        torch.cuda.synchronize(local.device)
        c.launch(self.probe_ptr, local.data_ptr(), None, None, PROBE_SLOTS, g.n_layers * 2,
                 plane, plane, g.row_bytes, stream)
        c.sync(stream)
        return local

    def quiesce(self, request_id: int) -> bool:
        return self._gate.quiesce(request_id)

    def in_flight(self) -> list[int]:
        return self._gate.in_flight()
