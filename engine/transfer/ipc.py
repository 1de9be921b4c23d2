"""The `ipc` KV transport: legacy CUDA IPC handles (cudaIpcGetMemHandle), P writes D's
pool directly. Works when P's container can open D's GPU (same container, local
development). In a pod where each container sees only its own GPU, opening the handle
fails (cudaErrorInvalidValue / CUDA_ERROR_INVALID_VALUE, or DeviceUninitialized across
PID namespaces): `auto` reports that and moves on to the proxy.

Owns only export/import of the handles; everything else is engine/transfer/direct.py.
"""

from __future__ import annotations

from typing import Any

import torch

from pdunit.engine.transfer.base import Descriptor, TransferError
from pdunit.engine.transfer.direct import PROCESS_TOKEN, DirectReceiver, DirectSender
from pdunit.kernels import cudadrv

HANDLE = cudadrv.IPC_HANDLE_BYTES


class IpcReceiver(DirectReceiver):
    mode = "ipc"

    def _allocate(self, nbytes: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, dict[str, Any]]:
        t = torch.empty(shape, dtype=self.geometry.dtype, device=f"cuda:{self.ordinal}")
        handle, offset = cudadrv.ipc_export(t.data_ptr(), self.ordinal)
        return t, {"handle": handle, "offset": offset}

    def _describe(self) -> tuple[dict[str, str], bytes]:
        return ({"offset": str(self.pool_export["offset"]), "probe_offset": str(self.probe_export["offset"])},
                self.pool_export["handle"] + self.probe_export["handle"])


class IpcSender(DirectSender):
    mode = "ipc"

    def _open(self, descriptor: Descriptor) -> tuple[int, int, list[Any]]:
        if descriptor.params.get("process") == PROCESS_TOKEN:
            raise TransferError("ipc: D's pool lives in this process; legacy IPC handles cannot be "
                                "opened by their exporter (use the tensors directly)")
        if len(descriptor.handle) != 2 * HANDLE:
            raise TransferError(f"ipc descriptor handle has {len(descriptor.handle)} bytes, expected {2 * HANDLE}")
        try:
            cudadrv.device_by_uuid(descriptor.params["gpu_uuid"])
        except cudadrv.CudaError:
            pass  # D's GPU is not visible here: the open below is still the real test
        pool = cudadrv.ipc_open(descriptor.handle[:HANDLE], self.ordinal)
        try:
            probe = cudadrv.ipc_open(descriptor.handle[HANDLE:], self.ordinal)
        except cudadrv.CudaError:
            cudadrv.ipc_close(pool, self.ordinal)
            raise
        owners = [("ipc", pool), ("ipc", probe)]
        return (pool + int(descriptor.params["offset"]), probe + int(descriptor.params["probe_offset"]), owners)

    def close(self) -> None:
        for _, base in self._owners:
            try:
                cudadrv.ipc_close(base, self.ordinal)
            except cudadrv.CudaError:
                pass
        self._owners.clear()
