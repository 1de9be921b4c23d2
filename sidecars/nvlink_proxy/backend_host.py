"""Host shared-memory backend of the proxy: regions are POSIX shm objects in /dev/shm.

Owns mapping registered shm regions (torch.from_file, shared) and copying rows between
them with the torch reference kernel (kernels/reference.py), which defines the
semantics the CUDA kernel must match. Used for CPU runs and tests. Must never create
or unlink a segment: the registering process owns it.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.model.config import torch_dtype
from pdunit.kernels import reference
from pdunit.sidecars.nvlink_proxy.regions import Job, JobRejected, Region
from pdunit.sidecars.nvlink_proxy.stages import StageClock

SHM_DIR = "/dev/shm"


class HostBackend:
    name = "host"

    def prepare(self, region: Region) -> None:
        """Map the segment now, so a bad registration fails at Register, not at Copy."""
        path = os.path.join(SHM_DIR, region.shm_name)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise JobRejected("NOT_FOUND", f"shared memory segment {path} does not exist: the "
                              "proxy must share /dev/shm with the registering process") from None
        if size < region.layout.nbytes:
            raise JobRejected("INVALID_ARGUMENT", f"segment {path} has {size} bytes, the layout "
                              f"needs {region.layout.nbytes}")
        numel = region.layout.nbytes // torch.empty((), dtype=torch_dtype(region.layout.dtype, pool=True)).element_size()
        region.backend_state["tensor"] = torch.from_file(
            path, shared=True, size=numel, dtype=torch_dtype(region.layout.dtype, pool=True)
        ).view(region.layout.shape())

    def _tensor(self, region: Region) -> torch.Tensor:
        return region.backend_state["tensor"]

    def copy(self, job: Job, method: int, clock: StageClock | None = None) -> tuple[str, float]:
        clock = clock or StageClock()
        t0 = clock.last
        # copies: the job's arrays are read-only views of the request bytes
        reference.copy_rows(self._tensor(job.src), torch.from_numpy(job.src_slots.copy()),
                            self._tensor(job.dst), torch.from_numpy(job.dst_slots.copy()))
        return "host", clock.mark("copy") - t0

    def checksum(self, region: Region, slots: np.ndarray) -> int:
        return kv_checksum(self._tensor(region), np.array(slots))

    def release(self, region: Region) -> None:
        region.backend_state.pop("tensor", None)
