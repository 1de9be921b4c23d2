"""CUDA row-copy kernels for KV pools: copy, gather to staging, scatter from staging.

Owns the one kernel every GPU transport and the nvlink-proxy launch: it copies rows
`src[plane, src_slots[i]] -> dst[plane, dst_slots[i]]` for every plane (layer x K/V)
in ONE launch, between any two device pointers the executing context can address
(local, peer, legacy-IPC-mapped or cuMem-mapped). A row is `n_kv_heads * head_dim`
elements; the kernel moves bytes, so bf16, fp16 and fp32 pools are the same code, and
any page size is a slot list. Loads are 16-byte vectors when the row size and the
pointers allow it (narrower otherwise); each 128-thread block copies 8 rows and issues
all 8 loads before the stores, so enough reads are in flight to fill NVLink.
A null slot array means the identity (0..n-1): that is gather (dst = staging) and
scatter (src = staging).

The torch CPU reference with the same signatures is kernels/reference.py; the tests
compare the two bit for bit. This module never checks ownership of rows: the caller
(the proxy's region table, or the transport) bounds-checks before launching.
Compiled at first use with NVRTC for the device's own architecture (no PTX JIT).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdunit.engine.transfer import cudadrv
from pdunit.engine.transfer.cudadrv import check, drv

ROWS_PER_BLOCK = 8
THREADS = 128

_SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;

template <typename V>
__device__ __forceinline__ void copy_rows_impl(
    const char* __restrict__ src, char* __restrict__ dst,
    const i64* __restrict__ src_slots, const i64* __restrict__ dst_slots, i64 n, i64 planes, i64 src_plane_stride, i64 dst_plane_stride, i64 row_bytes)
{
    const i64 total = planes * n;
    const i64 first = (i64)blockIdx.x * ROWS;
    const V* s_row[ROWS];
    V* d_row[ROWS];
    bool live[ROWS];
    // One division per thread; the next rows step through (plane, token) by increments.
    i64 p = first / n;
    i64 i = first - p * n;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        live[r] = first + r < total;
        if (r > 0 && ++i == n) { i = 0; ++p; }
        const i64 ss = !live[r] ? 0 : (src_slots ? src_slots[i] : i);
        const i64 ds = !live[r] ? 0 : (dst_slots ? dst_slots[i] : i);
        s_row[r] = (const V*)(src + p * src_plane_stride + ss * row_bytes);
        d_row[r] = (V*)(dst + p * dst_plane_stride + ds * row_bytes);
    }
    const i64 vecs = row_bytes / (i64)sizeof(V);
    for (i64 v = threadIdx.x; v < vecs; v += blockDim.x) {
        V buf[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) if (live[r]) buf[r] = s_row[r][v];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) if (live[r]) d_row[r][v] = buf[r];
    }
}

#define DEFINE(NAME, V) \
extern "C" __global__ void __launch_bounds__(THREADS) NAME( \
    const char* __restrict__ src, char* __restrict__ dst, \
    const i64* __restrict__ src_slots, const i64* __restrict__ dst_slots, i64 n, i64 planes, \
    i64 src_plane_stride, i64 dst_plane_stride, i64 row_bytes) { \
    copy_rows_impl<V>(src, dst, src_slots, dst_slots, \
                      n, planes, src_plane_stride, dst_plane_stride, row_bytes); }

DEFINE(copy_rows_16, uint4)
DEFINE(copy_rows_8, uint2)
DEFINE(copy_rows_4, unsigned int)
DEFINE(copy_rows_2, unsigned short)
DEFINE(copy_rows_1, unsigned char)
"""

_WIDTHS = (16, 8, 4, 2, 1)


def compile_cubin(arch: str) -> bytes:
    """NVRTC-compile the kernels for `arch` (e.g. "sm_90"). Runs without a GPU."""
    from cuda.bindings import nvrtc

    src = f"#define ROWS {ROWS_PER_BLOCK}\n#define THREADS {THREADS}\n{_SOURCE}".encode()
    err, prog = nvrtc.nvrtcCreateProgram(src, b"cuda_rows.cu", 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcCreateProgram failed: {err}")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed for {arch}: {log.decode(errors='replace')}")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@dataclass
class _Scratch:
    ptr: int = 0
    nbytes: int = 0


class RowCopier:
    """The kernels loaded in one device's primary context, plus per-thread slot
    buffers. Obtain with `copier(ordinal)`."""

    def __init__(self, device: int) -> None:
        d = drv()
        self.device = device
        with cudadrv.on_device(device):
            dev = check(d.cuDeviceGet(device), "cuDeviceGet")
            major = check(d.cuDeviceGetAttribute(
                d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
            minor = check(d.cuDeviceGetAttribute(
                d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute")
            # keep the image in a numpy buffer and pass its address (what the driver API takes)
            self._image = np.frombuffer(compile_cubin(f"sm_{major}{minor}"), dtype=np.uint8).copy()
            self._module = check(d.cuModuleLoadData(self._image.ctypes.data), "cuModuleLoadData")
            self._fn = {w: check(d.cuModuleGetFunction(self._module, f"copy_rows_{w}".encode()),
                                 "cuModuleGetFunction") for w in _WIDTHS}
        self._local = threading.local()

    def _scratch(self, nbytes: int) -> int:
        s: _Scratch | None = getattr(self._local, "scratch", None)
        if s is None:
            s = _Scratch()
            self._local.scratch = s
        if s.nbytes < nbytes:
            d = drv()
            with cudadrv.on_device(self.device):
                if s.ptr:
                    check(d.cuMemFree(s.ptr), "cuMemFree")
                size = max(nbytes, 1 << 16)
                s.ptr = int(check(d.cuMemAlloc(size), "cuMemAlloc"))
                s.nbytes = size
        return s.ptr

    def stream(self) -> int:
        """A per-thread non-blocking stream of this device (the proxy's job stream)."""
        st = getattr(self._local, "stream", None)
        if st is None:
            d = drv()
            with cudadrv.on_device(self.device):
                st = int(check(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"))
            self._local.stream = st
        return st

    def upload(self, arrays: list[np.ndarray], stream: int) -> list[int]:
        """Copy int64 slot arrays to this thread's device scratch; returns their device
        pointers. Waits for `stream` first: the previous launch may still read them."""
        d = drv()
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in arrays]
        with cudadrv.on_device(self.device):
            check(d.cuStreamSynchronize(stream), "cuStreamSynchronize")
            base = self._scratch(sum(a.nbytes for a in arrays))
            out, off = [], 0
            for a in arrays:
                if a.nbytes:
                    check(d.cuMemcpyHtoD(base + off, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")
                out.append(base + off)
                off += a.nbytes
        return out

    def launch_raw(self, src_ptr: int, dst_ptr: int, src_slots_dev: int, dst_slots_dev: int,
                   n: int, planes: int, src_plane_stride: int, dst_plane_stride: int,
                   row_bytes: int, stream: int) -> None:
        """Enqueue one copy kernel on `stream`. Slot pointers are device int64 arrays of
        n entries, or 0 for the identity."""
        if n <= 0:
            return
        d = drv()
        width = next(w for w in _WIDTHS if row_bytes % w == 0 and src_ptr % w == 0
                     and dst_ptr % w == 0 and src_plane_stride % w == 0
                     and dst_plane_stride % w == 0)
        values = [np.array([v], dtype=np.uint64) for v in (src_ptr, dst_ptr, src_slots_dev, dst_slots_dev)]
        values += [np.array([v], dtype=np.int64) for v in
                   (n, planes, src_plane_stride, dst_plane_stride, row_bytes)]
        args = np.array([v.ctypes.data for v in values], dtype=np.uint64)
        grid = (planes * n + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
        with cudadrv.on_device(self.device):
            check(d.cuLaunchKernel(self._fn[width], grid, 1, 1, THREADS, 1, 1, 0, stream,
                                   args.ctypes.data, 0), "cuLaunchKernel(copy_rows)")

    def launch(self, src_ptr: int, dst_ptr: int, src_slots: np.ndarray | None,
               dst_slots: np.ndarray | None, n: int, planes: int, src_plane_stride: int,
               dst_plane_stride: int, row_bytes: int, stream: int) -> None:
        """Upload the slot arrays (None = identity) and enqueue one copy kernel."""
        present = [a for a in (src_slots, dst_slots) if a is not None]
        ptrs = iter(self.upload(present, stream)) if present else iter(())
        sp = next(ptrs) if src_slots is not None else 0
        dp = next(ptrs) if dst_slots is not None else 0
        self.launch_raw(src_ptr, dst_ptr, sp, dp, n, planes, src_plane_stride,
                        dst_plane_stride, row_bytes, stream)

    def sync(self, stream: int) -> None:
        with cudadrv.on_device(self.device):
            check(drv().cuStreamSynchronize(stream), "cuStreamSynchronize")


_copiers: dict[int, RowCopier] = {}
_copiers_lock = threading.Lock()


def copier(device: int) -> RowCopier:
    with _copiers_lock:
        c = _copiers.get(device)
        if c is None:
            c = RowCopier(device)
            _copiers[device] = c
        return c


_peer_enabled: set[tuple[int, int]] = set()


def enable_peer(exec_device: int, other_device: int) -> None:
    """Let kernels in exec_device's context address other_device's allocations."""
    if exec_device == other_device or (exec_device, other_device) in _peer_enabled:
        return
    d = drv()
    with cudadrv.on_device(exec_device):
        err = d.cuCtxEnablePeerAccess(cudadrv.primary_context(other_device), 0)[0]
        if err not in (d.CUresult.CUDA_SUCCESS, d.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
            check((err,), "cuCtxEnablePeerAccess")
    _peer_enabled.add((exec_device, other_device))


# ------------------------------------------------------------------ torch API
def _check_pair(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dtype != dst.dtype or src.shape[0] != dst.shape[0] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"pool shapes do not match: src {tuple(src.shape)} {src.dtype}, "
                         f"dst {tuple(dst.shape)} {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("pools must be contiguous [n_layers, 2, n_slots, n_kv_heads, head_dim]")


def _slots(slots: Any, bound: int, what: str) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(slots.cpu() if isinstance(slots, torch.Tensor) else slots,
                                          dtype=np.int64))
    if arr.size and (arr.min() < 0 or arr.max() >= bound):
        raise IndexError(f"{what} out of range: min {arr.min()}, max {arr.max()}, pool has {bound} slots")
    return arr


def _run(src: torch.Tensor, dst: torch.Tensor, src_slots: np.ndarray | None,
         dst_slots: np.ndarray | None, n: int) -> None:
    exec_dev = dst.device.index
    enable_peer(exec_dev, src.device.index)
    # Run after whatever torch queued on both tensors, and block until done: the callers
    # (transports) promise "rows are in D's memory" when they return.
    torch.cuda.synchronize(src.device)
    stream = torch.cuda.current_stream(dst.device).cuda_stream
    row_bytes = int(np.prod(src.shape[3:])) * src.element_size()
    planes = src.shape[0] * 2
    c = copier(exec_dev)
    c.launch(src.data_ptr(), dst.data_ptr(), src_slots, dst_slots, n, planes,
             src.shape[2] * row_bytes, dst.shape[2] * row_bytes, row_bytes, stream)
    c.sync(stream)


def copy_rows(src: torch.Tensor, src_slots: Any, dst: torch.Tensor, dst_slots: Any) -> None:
    """dst[:, :, dst_slots[i]] = src[:, :, src_slots[i]] in one kernel (runs on dst's GPU)."""
    _check_pair(src, dst)
    s = _slots(src_slots, src.shape[2], "src_slots")
    d = _slots(dst_slots, dst.shape[2], "dst_slots")
    if s.shape != d.shape:
        raise ValueError(f"src_slots has {s.size} entries, dst_slots {d.size}")
    _run(src, dst, s, d, int(s.size))


def gather_rows(src: torch.Tensor, slots: Any) -> torch.Tensor:
    """Staging `[n_layers, 2, n, n_kv_heads, head_dim]` holding src's rows at `slots`."""
    s = _slots(slots, src.shape[2], "slots")
    out = torch.empty((src.shape[0], 2, s.size, *src.shape[3:]), dtype=src.dtype, device=src.device)
    _check_pair(src, out)
    _run(src, out, s, None, int(s.size))
    return out


def scatter_rows(staging: torch.Tensor, dst: torch.Tensor, slots: Any) -> None:
    """dst[:, :, slots[i]] = staging[:, :, i]."""
    _check_pair(staging, dst)
    s = _slots(slots, dst.shape[2], "slots")
    if s.size != staging.shape[2]:
        raise ValueError(f"staging holds {staging.shape[2]} rows per plane, slots has {s.size}")
    _run(staging, dst, None, s, int(s.size))


def per_row_copy(src_ptr: int, dst_ptr: int, src_slots: np.ndarray, dst_slots: np.ndarray,
                 planes: int, src_plane_stride: int, dst_plane_stride: int, row_bytes: int,
                 device: int, stream: int) -> int:
    """Baseline: one cuMemcpyDtoDAsync per row, as upstream per-block copy loops do.
    Returns the number of copies issued. Benchmarks only."""
    d = drv()
    count = 0
    with cudadrv.on_device(device):
        memcpy = d.cuMemcpyDtoDAsync
        for p in range(planes):
            sb = src_ptr + p * src_plane_stride
            db = dst_ptr + p * dst_plane_stride
            for s, t in zip(src_slots.tolist(), dst_slots.tolist(), strict=True):
                err = memcpy(db + t * row_bytes, sb + s * row_bytes, row_bytes, stream)[0]
                if err != d.CUresult.CUDA_SUCCESS:
                    check((err,), "cuMemcpyDtoDAsync")
                count += 1
    return count
