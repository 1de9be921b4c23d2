"""The `posix-fd` KV transport: D's pool is a cuMem allocation exported as a POSIX file
descriptor; P fetches the fd with pidfd_getfd (shared PID namespace and ptrace rights
needed), imports it and maps it for its own GPU, then writes rows directly.
Where P's container lacks D's device node the import fails with
CUDA_ERROR_INVALID_DEVICE: `auto` reports that and moves on.

Owns only export/import; everything else is engine/transfer/direct.py.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pdunit.engine.transfer.base import Descriptor
from pdunit.engine.transfer.direct import PROCESS_TOKEN, DirectReceiver, DirectSender
from pdunit.kernels import cudadrv


class PosixFdReceiver(DirectReceiver):
    mode = "posix-fd"
    fabric = False

    def _allocate(self, nbytes: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, dict[str, Any]]:
        alloc = cudadrv.vmm_alloc(nbytes, self.ordinal, posix_fd=not self.fabric, fabric=self.fabric)
        t = cudadrv.tensor_view(alloc.ptr, shape, self.geometry.dtype, self.ordinal, owner=alloc)
        return t, {"alloc": alloc}

    def _describe(self) -> tuple[dict[str, str], bytes]:
        pool, probe = self.pool_export["alloc"], self.probe_export["alloc"]
        if self.fabric:
            return ({"size": str(pool.size), "probe_size": str(probe.size)}, pool.fabric + probe.fabric)
        return ({"fd": str(pool.fd), "size": str(pool.size), "probe_fd": str(probe.fd),
                 "probe_size": str(probe.size)}, b"")


class PosixFdSender(DirectSender):
    mode = "posix-fd"

    def _open(self, descriptor: Descriptor) -> tuple[int, int, list[Any]]:
        p = descriptor.params
        pid = int(p["pid"])
        allocs = []
        try:
            for fd_key, size_key in (("fd", "size"), ("probe_fd", "probe_size")):
                same = p.get("process") == PROCESS_TOKEN
                fd = os.dup(int(p[fd_key])) if same else cudadrv.fd_from_process(pid, int(p[fd_key]))
                try:
                    allocs.append(cudadrv.vmm_import_fd(fd, int(p[size_key]), self.ordinal))
                finally:
                    os.close(fd)
        except Exception:
            for a in allocs:
                a.close()
            raise
        return allocs[0].ptr, allocs[1].ptr, allocs

    def close(self) -> None:
        for a in self._owners:
            a.close()
        self._owners.clear()
