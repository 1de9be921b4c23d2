"""The `fabric` KV transport: D's pool is a cuMem allocation with a FABRIC handle (needs
an IMEX channel on the host); P imports the 64-byte handle and writes rows directly.
No pidfd or shared PID namespace needed. Without an IMEX channel cuMemCreate answers
CUDA_ERROR_NOT_PERMITTED even where the device attribute claims FABRIC support, which
is why only a real allocation and a verified probe count (`auto`).

Owns only export/import; everything else is engine/transfer/direct.py.
"""

from __future__ import annotations

from typing import Any

from pdunit.engine.transfer.base import Descriptor, TransferError
from pdunit.engine.transfer.direct import DirectSender
from pdunit.engine.transfer.posix_fd import PosixFdReceiver
from pdunit.kernels import cudadrv

HANDLE = cudadrv.FABRIC_HANDLE_BYTES


class FabricReceiver(PosixFdReceiver):
    """A cuMem pool exported as FABRIC handles (the 64-byte handles travel in the descriptor)."""

    mode = "fabric"
    fabric = True


class FabricSender(DirectSender):
    mode = "fabric"

    def _open(self, descriptor: Descriptor) -> tuple[int, int, list[Any]]:
        if len(descriptor.handle) != 2 * HANDLE:
            raise TransferError(f"fabric descriptor handle has {len(descriptor.handle)} bytes, expected {2 * HANDLE}")
        p = descriptor.params
        pool = cudadrv.vmm_import_fabric(descriptor.handle[:HANDLE], int(p["size"]), self.ordinal)
        try:
            probe = cudadrv.vmm_import_fabric(descriptor.handle[HANDLE:], int(p["probe_size"]), self.ordinal)
        except Exception:
            pool.close()
            raise
        return pool.ptr, probe.ptr, [pool, probe]

    def close(self) -> None:
        for a in self._owners:
            a.close()
        self._owners.clear()
