"""CUDA backend of the proxy: maps P's and D's GPU regions and runs copy jobs.

Owns the mapping cache (region, executing GPU) -> device pointer and the two copy methods:
single kernel (`_single`: both regions in ONE executing GPU's context, one row-copy
kernel over NVLink) and staged (`_staged`: gather, one peer copy, scatter), the fallback
where the single kernel cannot run, logged and counted, never silent. Must never open the
two handles in different contexts and peer-copy row by row (a fraction of the link:
docs/performance.md, "Kernel notes"), and never copy without a validated Job
(regions.py). GPUs are found by UUID.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.model.config import torch_dtype
from pdunit.engine.proto import proxy_pb2 as pb
from pdunit.kernels import cuda_rows, cudadrv
from pdunit.kernels.cuda_rows import DEFAULT_CONFIG, CopyConfig
from pdunit.kernels.cudadrv import CudaError, check, drv
from pdunit.sidecars.nvlink_proxy.regions import Job, JobRejected, Region
from pdunit.sidecars.nvlink_proxy.stages import StageClock

log = logging.getLogger("pdunit.proxy.cuda")

COPY_DEVICES = ("dst", "src", "split")


class CudaBackend:
    """Per job: the slot arrays go through a per-thread pinned buffer with one async
    upload on the job's stream, the launch arguments live in a per-thread block, and a
    job thread keeps its GPU's context current, so the host work around the kernel is a
    few driver calls; each stage is timed into the caller's StageClock."""

    name = "cuda"

    def __init__(self, staged_chunks: int = 8, copy_config: CopyConfig = DEFAULT_CONFIG,
                 copy_device: str = "dst", copy_split: float = 0.5) -> None:
        if copy_device not in COPY_DEVICES:
            raise ValueError(f"copy_device={copy_device!r} must be one of {COPY_DEVICES}")
        if not 0.0 < copy_split < 1.0:
            raise ValueError(f"copy_split={copy_split} must be in (0, 1): the share of tokens the "
                             "destination GPU pulls when copy_device=split")
        cudadrv.init()
        self.staged_chunks = max(1, staged_chunks)
        self.copy_config = copy_config
        self.copy_device = copy_device
        self.copy_split = copy_split
        self.devices = {cudadrv.device_uuid(i): i for i in range(cudadrv.device_count())}
        self._map_lock = threading.Lock()
        self._local = threading.local()
        self.fallbacks = 0
        # Compile and load the kernels now, not inside the first job's deadline.
        for ordinal in self.devices.values():
            cuda_rows.copier(ordinal, copy_config)

    # ------------------------------------------------------------- mapping
    def device_of(self, region: Region) -> int:
        ordinal = self.devices.get(region.gpu_uuid)
        if ordinal is None:
            raise JobRejected("FAILED_PRECONDITION",
                              f"region {region.name!r} lives on {region.gpu_uuid}, which this proxy "
                              f"cannot see (visible: {sorted(self.devices)}); run the proxy with "
                              "NVIDIA_VISIBLE_DEVICES=all")
        return ordinal

    def prepare(self, region: Region) -> None:
        """Map the region in its own GPU's context now: a bad handle fails at Register."""
        try:
            self.map(region, self.device_of(region))
        except CudaError as e:
            raise JobRejected("FAILED_PRECONDITION",
                              f"cannot map region {region.name!r} on its own GPU: {e}") from e
        except OSError as e:
            raise JobRejected("FAILED_PRECONDITION",
                              f"cannot fetch fd {region.owner_fd} of pid {region.owner_pid}: {e}; "
                              "the proxy needs a shared PID namespace with the owner "
                              "(shareProcessNamespace: true) and ptrace rights over it") from e

    def map(self, region: Region, exec_dev: int) -> int:
        key = ("map", exec_dev)
        with self._map_lock:
            cached = region.backend_state.get(key)
            if cached is not None:
                return int(cached[0])
            if region.kind == pb.CUDA_IPC:
                base = cudadrv.ipc_open(region.ipc_handle, exec_dev)
                region.backend_state[key] = (base + region.offset_bytes, ("ipc", base))
            else:
                fd = cudadrv.fd_from_process(region.owner_pid, region.owner_fd)
                try:
                    alloc = cudadrv.vmm_import_fd(fd, region.alloc_bytes, exec_dev)
                finally:
                    os.close(fd)
                region.backend_state[key] = (alloc.ptr, ("vmm", alloc))
            return int(region.backend_state[key][0])

    def release(self, region: Region) -> None:
        with self._map_lock:
            for key in [k for k in region.backend_state if isinstance(k, tuple) and k[0] == "map"]:
                _, (kind, obj) = region.backend_state.pop(key)
                try:
                    if kind == "ipc":
                        cudadrv.ipc_close(obj, key[1])
                    else:
                        obj.close()
                except CudaError as e:
                    log.warning("unmapping region failed", extra={"region": region.name, "error": str(e)})

    # ------------------------------------------------------------- copies
    def _placement(self, src_dev: int, dst_dev: int) -> list[tuple[int, float]]:
        """(executing GPU, share of the tokens) for the single-kernel method."""
        if self.copy_device == "src":
            return [(src_dev, 1.0)]
        if self.copy_device == "split" and src_dev != dst_dev:
            return [(dst_dev, self.copy_split), (src_dev, 1.0 - self.copy_split)]
        return [(dst_dev, 1.0)]

    def copy(self, job: Job, method: int, clock: StageClock | None = None) -> tuple[str, float]:
        """Run the job; returns (method that ran, seconds from launch to completion)."""
        clock = clock or StageClock()
        src_dev, dst_dev = self.device_of(job.src), self.device_of(job.dst)
        if method in (pb.METHOD_AUTO, pb.SINGLE_KERNEL):
            placement = self._placement(src_dev, dst_dev)
            pair = (job.src.region_id, job.dst.region_id, tuple(dev for dev, _ in placement))
            staged_reason = job.dst.backend_state.get(("single_failed", pair))
            if staged_reason is None:
                try:
                    ptrs = [(dev, share, self.map(job.src, dev), self.map(job.dst, dev))
                            for dev, share in placement]
                except CudaError as e:
                    staged_reason = str(e)
                    job.dst.backend_state[("single_failed", pair)] = staged_reason
                    if method == pb.SINGLE_KERNEL:
                        raise
                    self.fallbacks += 1
                    log.warning("single-kernel copy cannot run for this region pair; using the "
                                "staged pipeline", extra={"src": job.src.name, "dst": job.dst.name,
                                                          "copy_device": self.copy_device,
                                                          "error": staged_reason})
                else:
                    clock.mark("map")
                    return "single_kernel", self._single(job, ptrs, clock)
            elif method == pb.SINGLE_KERNEL:
                raise CudaError("single_kernel", "UNAVAILABLE", staged_reason)
        return "staged", self._staged(job, src_dev, dst_dev, clock)

    def _keep_context(self, c: cuda_rows.RowCopier) -> None:
        """A job thread runs only proxy jobs: leave its first GPU's context current, so
        the common case (one executing GPU) needs no context switch per job."""
        if not getattr(self._local, "context_set", False):
            c.make_current()
            self._local.context_set = True

    def _single(self, job: Job, ptrs: list[tuple[int, float, int, int]], clock: StageClock) -> float:
        """Both regions opened in ONE executing GPU's primary context (legacy IPC handles
        with lazy peer access, or cuMem POSIX-fd imports granted to that GPU), then one
        row-copy kernel per part. `copy_device` picks the executing GPU: `dst` (the
        default; the kernel reads the source over the link: pull), `src` (writes over the
        link: push), or `split` (a `copy_split` share of the tokens pulled by the
        destination GPU, the rest pushed by the source GPU, both kernels at once)."""
        lay = job.src.layout
        n = job.n
        parts = []  # (copier, stream, first token, tokens, src ptr, dst ptr)
        first = 0
        for k, (dev, share, src_ptr, dst_ptr) in enumerate(ptrs):
            count = n - first if k == len(ptrs) - 1 else min(n - first, int(round(n * share)))
            if count > 0:
                c = cuda_rows.copier(dev, self.copy_config)
                self._keep_context(c)
                parts.append((c, c.stream(), first, count, src_ptr, dst_ptr))
            first += count
        uploaded = []
        for c, stream, a, count, _, _ in parts:
            if len(parts) == 1:
                uploaded.append(c.upload([job.src_slots, job.dst_slots], stream))
            else:
                uploaded.append(c.upload([job.src_slots[a:a + count], job.dst_slots[a:a + count]], stream))
        t0 = clock.mark("upload")
        for (c, stream, _, count, src_ptr, dst_ptr), (sp, dp) in zip(parts, uploaded, strict=True):
            c.launch_raw(src_ptr, dst_ptr, sp, dp, count, lay.planes, job.src.layout.plane_stride,
                         job.dst.layout.plane_stride, lay.row_bytes, stream)
        clock.mark("launch")
        for c, stream, *_ in parts:
            c.sync(stream)
        return clock.mark("sync") - t0

    def _thread_state(self, dev: int) -> dict[str, Any]:
        states = getattr(self._local, "states", None)
        if states is None:
            states = self._local.states = {}
        st = states.get(dev)
        if st is None:
            d = drv()
            with cudadrv.on_device(dev):
                copy_stream = int(check(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"))
                flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING
                events = [check(d.cuEventCreate(flags), "cuEventCreate") for _ in range(2 * 64)]
            st = states[dev] = {"copy_stream": copy_stream, "events": events, "stage": 0, "stage_bytes": 0}
        return st

    def _stage(self, dev: int, nbytes: int) -> int:
        st = self._thread_state(dev)
        if st["stage_bytes"] < nbytes:
            d = drv()
            with cudadrv.on_device(dev):
                if st["stage"]:
                    check(d.cuMemFree(st["stage"]), "cuMemFree")
                st["stage"] = int(check(d.cuMemAlloc(nbytes), "cuMemAlloc(staging)"))
                st["stage_bytes"] = nbytes
        return int(st["stage"])

    def _staged(self, job: Job, src_dev: int, dst_dev: int, clock: StageClock) -> float:
        """Gather on the source GPU into a staging buffer, one peer copy, scatter on the
        destination GPU, pipelined in chunks over three streams. Used only where the
        single kernel cannot run (the source cannot be mapped into the executing
        context)."""
        d = drv()
        lay = job.src.layout
        if src_dev != dst_dev:
            # Without peer access between the two primary contexts the peer copy is
            # staged through host memory (measured: ~37 GB/s instead of NVLink speed).
            cuda_rows.enable_peer(dst_dev, src_dev)
            cuda_rows.enable_peer(src_dev, dst_dev)
        src_ptr = self.map(job.src, src_dev)
        dst_ptr = self.map(job.dst, dst_dev)
        clock.mark("map")
        total = job.nbytes
        stage_src = self._stage(src_dev, total)
        stage_dst = self._stage(dst_dev, total) if dst_dev != src_dev else stage_src
        gc, sc = cuda_rows.copier(src_dev, self.copy_config), cuda_rows.copier(dst_dev, self.copy_config)
        g_stream, s_stream = gc.stream(), sc.stream()
        c_stream = self._thread_state(dst_dev)["copy_stream"]
        src_events = self._thread_state(src_dev)["events"]
        dst_events = self._thread_state(dst_dev)["events"]
        if gc is sc:  # one scratch per (thread, GPU): both arrays in one upload
            sp, dp = gc.upload([job.src_slots, job.dst_slots], g_stream)
        else:
            (sp,) = gc.upload([job.src_slots], g_stream)
            (dp,) = sc.upload([job.dst_slots], s_stream)
        chunks = min(self.staged_chunks, job.n, 64)
        bounds = np.linspace(0, job.n, chunks + 1).astype(np.int64)
        src_ctx, dst_ctx = cudadrv.primary_context(src_dev), cudadrv.primary_context(dst_dev)
        t0 = clock.mark("upload")
        for k in range(chunks):
            k0, k1 = int(bounds[k]), int(bounds[k + 1])
            nk = k1 - k0
            if nk == 0:
                continue
            off = lay.planes * k0 * lay.row_bytes
            nbytes = lay.planes * nk * lay.row_bytes
            # gather chunk k on the source GPU: staging laid out [planes, nk] rows
            gc.launch_raw(src_ptr, stage_src + off, sp + 8 * k0, 0, nk, lay.planes,
                          job.src.layout.plane_stride, nk * lay.row_bytes, lay.row_bytes, g_stream)
            if dst_dev != src_dev:
                with cudadrv.on_device(src_dev):
                    check(d.cuEventRecord(src_events[k], g_stream), "cuEventRecord")
                with cudadrv.on_device(dst_dev):
                    check(d.cuStreamWaitEvent(c_stream, src_events[k], 0), "cuStreamWaitEvent")
                    check(d.cuMemcpyPeerAsync(stage_dst + off, dst_ctx, stage_src + off, src_ctx,
                                              nbytes, c_stream), "cuMemcpyPeerAsync")
                    check(d.cuEventRecord(dst_events[k], c_stream), "cuEventRecord")
                    check(d.cuStreamWaitEvent(s_stream, dst_events[k], 0), "cuStreamWaitEvent")
            else:
                with cudadrv.on_device(src_dev):
                    check(d.cuEventRecord(src_events[k], g_stream), "cuEventRecord")
                    check(d.cuStreamWaitEvent(s_stream, src_events[k], 0), "cuStreamWaitEvent")
            sc.launch_raw(stage_dst + off, dst_ptr, 0, dp + 8 * k0, nk, lay.planes,
                          nk * lay.row_bytes, job.dst.layout.plane_stride, lay.row_bytes, s_stream)
        clock.mark("launch")
        sc.sync(s_stream)
        gc.sync(g_stream)  # done already (the scatter waited on it); marks the scratch free
        return clock.mark("sync") - t0

    def checksum(self, region: Region, slots: np.ndarray) -> int:
        dev = self.device_of(region)
        view = cudadrv.tensor_view(self.map(region, dev), region.layout.shape(),
                                   torch_dtype(region.layout.dtype, pool=True), dev)
        return kv_checksum(view, np.array(slots))
