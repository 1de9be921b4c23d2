"""CUDA row-copy kernels for KV pools: copy, gather to staging, scatter from staging.

Owns the one kernel every GPU transport and the nvlink-proxy launch: it copies rows
`src[plane, src_slots[i]] -> dst[plane, dst_slots[i]]` for every plane (layer x K/V) in
ONE launch, between any two device pointers the executing context can address. It moves
bytes, so every dtype and page size is the same code; a null slot array is the identity
(gather, scatter). `CopyConfig` is its launch shape, compiled in by NVRTC for the device's
own architecture (docs/performance.md, "Kernel notes"); kernels/reference.py is the torch
reference the tests compare bit for bit. Must never check ownership of rows: the caller
(the proxy's region table, or the transport) bounds-checks before launching.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from pdunit.kernels import cudadrv
from pdunit.kernels.cudadrv import check, drv

# Cache operators of the copy's loads/stores: plain; .cs (streaming, evict first);
# .cg (cache in L2 only). Which one NVLink prefers is measured, not assumed.
HINTS = {"none": 0, "cs": 1, "cg": 2}


@dataclass(frozen=True)
class CopyConfig:
    """Launch configuration of the row-copy kernel (see the module docstring)."""

    rows: int = 8
    threads: int = 128
    unroll: int = 8
    hint: str = "none"
    blocks_per_sm: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.rows <= 64:
            raise ValueError(f"copy config: rows={self.rows} must be in 1..64")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"copy config: threads={self.threads} must be a multiple of 32 in 32..1024")
        if not 1 <= self.unroll <= 16:
            raise ValueError(f"copy config: unroll={self.unroll} must be in 1..16")
        if self.hint not in HINTS:
            raise ValueError(f"copy config: hint={self.hint!r} must be one of {sorted(HINTS)}")
        if not 0 <= self.blocks_per_sm <= 64:
            raise ValueError(f"copy config: blocks_per_sm={self.blocks_per_sm} must be in 0..64 "
                             "(0 = one block per row group)")

    @property
    def kernel_key(self) -> tuple[int, int, int, int]:
        """What the compiled code depends on (blocks_per_sm is a launch-time choice)."""
        return (self.rows, self.threads, self.unroll, HINTS[self.hint])

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def parse(cls, text: str) -> CopyConfig:
        """`rows=8,threads=128,unroll=8,hint=none,blocks_per_sm=0` (any subset)."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            if not sep or key not in known:
                raise ValueError(f"copy config: {part!r} is not key=value with key in {sorted(known)}")
            values[key] = raw if key == "hint" else int(raw)
        return cls(**values)


DEFAULT_CONFIG = CopyConfig()

_SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;

template <int HINT, typename V>
__device__ __forceinline__ V load_vec(const V* p) {
    if constexpr (HINT == 1) return __ldcs(p);
    else if constexpr (HINT == 2) return __ldcg(p);
    else return *p;
}

template <int HINT, typename V>
__device__ __forceinline__ void store_vec(V* p, const V& v) {
    if constexpr (HINT == 1) __stcs(p, v);
    else if constexpr (HINT == 2) __stcg(p, v);
    else *p = v;
}

// One block copies row groups of ROWS rows (a row = one (plane, token) pair). The
// group's ROWS x vecs vectors are flattened: thread t takes vectors t, t + THREADS, ...
// and issues UNROLL loads before the matching stores, so a warp always touches 32
// consecutive vectors of one row. Row offsets are computed once per group (one
// thread per row) into shared memory. gridDim.x < groups makes the grid persistent.
template <typename V, int ROWS, int THREADS, int UNROLL, int HINT>
__device__ __forceinline__ void copy_rows_impl(
    const char* __restrict__ src, char* __restrict__ dst,
    const i64* __restrict__ src_slots, const i64* __restrict__ dst_slots, i64 n, i64 planes,
    i64 src_plane_stride, i64 dst_plane_stride, i64 row_bytes)
{
    // Byte offsets from src/dst, not pointers: addresses derived from the kernel's
    // parameters keep the global state space (ld.global.nc), pointers read back from
    // shared memory would compile to generic loads.
    __shared__ i64 s_off[ROWS];
    __shared__ i64 d_off[ROWS];
    const i64 total = planes * n;
    const i64 groups = (total + ROWS - 1) / ROWS;
    const unsigned vecs = (unsigned)(row_bytes / (i64)sizeof(V));
    for (i64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const i64 first = g * ROWS;
        const unsigned rows = (unsigned)(total - first < ROWS ? total - first : ROWS);
        for (unsigned r = threadIdx.x; r < rows; r += THREADS) {
            const i64 row = first + r;
            const i64 p = row / n;
            const i64 i = row - p * n;
            const i64 ss = src_slots ? src_slots[i] : i;
            const i64 ds = dst_slots ? dst_slots[i] : i;
            s_off[r] = p * src_plane_stride + ss * row_bytes;
            d_off[r] = p * dst_plane_stride + ds * row_bytes;
        }
        __syncthreads();
        const unsigned items = rows * vecs;
        for (unsigned base = threadIdx.x; base < items; base += THREADS * UNROLL) {
            V buf[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const unsigned k = base + u * THREADS;
                if (k < items) {
                    const unsigned r = k / vecs;
                    buf[u] = load_vec<HINT>((const V*)(src + s_off[r]) + (k - r * vecs));
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const unsigned k = base + u * THREADS;
                if (k < items) {
                    const unsigned r = k / vecs;
                    store_vec<HINT>((V*)(dst + d_off[r]) + (k - r * vecs), buf[u]);
                }
            }
        }
        __syncthreads();  // the next group overwrites the row table
    }
}

#define DEFINE(NAME, V, ROWS, THREADS, UNROLL, HINT) \
extern "C" __global__ void __launch_bounds__(THREADS) NAME( \
    const char* __restrict__ src, char* __restrict__ dst, \
    const i64* __restrict__ src_slots, const i64* __restrict__ dst_slots, i64 n, i64 planes, \
    i64 src_plane_stride, i64 dst_plane_stride, i64 row_bytes) { \
    copy_rows_impl<V, ROWS, THREADS, UNROLL, HINT>(src, dst, src_slots, dst_slots, \
                      n, planes, src_plane_stride, dst_plane_stride, row_bytes); }
"""

_WIDTHS = (16, 8, 4, 2, 1)
_VECTOR = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}


def kernel_name(width: int, key: tuple[int, int, int, int]) -> str:
    rows, threads, unroll, hint = key
    return f"copy_rows_{width}_r{rows}_t{threads}_u{unroll}_h{hint}"


def kernel_source(configs: tuple[CopyConfig, ...], widths: tuple[int, ...] = _WIDTHS) -> str:
    """The CUDA source: the template plus one extern "C" kernel per (config, width)."""
    keys = sorted({c.kernel_key for c in configs})
    lines = [_SOURCE]
    for key in keys:
        for w in widths:
            lines.append(f"DEFINE({kernel_name(w, key)}, {_VECTOR[w]}, {key[0]}, {key[1]}, {key[2]}, {key[3]})")
    return "\n".join(lines) + "\n"


_cubins: dict[tuple[str, tuple[tuple[int, int, int, int], ...], tuple[int, ...]], bytes] = {}
_cubins_lock = threading.Lock()


def compile_cubin(arch: str, configs: tuple[CopyConfig, ...] = (DEFAULT_CONFIG,),
                  widths: tuple[int, ...] = _WIDTHS) -> bytes:
    """NVRTC-compile the kernels of `configs` for `arch` (e.g. "sm_90"). Runs without a
    GPU. Cached per process: two GPUs of one architecture share one compile."""
    key = (arch, tuple(sorted({c.kernel_key for c in configs})), tuple(widths))
    with _cubins_lock:
        cubin = _cubins.get(key)
        if cubin is None:
            cubin = _cubins[key] = _nvrtc(arch, configs, widths)
        return cubin


def _nvrtc(arch: str, configs: tuple[CopyConfig, ...], widths: tuple[int, ...]) -> bytes:
    from cuda.bindings import nvrtc

    src = kernel_source(configs, widths).encode()
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


class _ThreadState:
    """Per (thread, device) resources: the job stream, the slot scratch on the device,
    its pinned host mirror, and the launch-argument block (no allocation per job)."""

    def __init__(self) -> None:
        self.stream = 0
        self.dev_ptr = 0
        self.host_ptr = 0
        self.capacity = 0  # int64 entries of dev/host scratch
        self.host: np.ndarray = np.zeros(0, dtype=np.int64)
        self.busy_stream: int | None = None  # a stream that may still read the scratch
        self.values = (ctypes.c_uint64 * 9)()
        base = ctypes.addressof(self.values)
        self.params = (ctypes.c_void_p * 9)(*[base + 8 * i for i in range(9)])
        self.params_addr = ctypes.addressof(self.params)


class RowCopier:
    """The kernels of `configs` loaded in one device's primary context, plus per-thread
    slot buffers. `config` (the first of `configs`) is what `launch` uses unless told
    otherwise. Obtain the shared one with `copier(ordinal, config)`."""

    def __init__(self, device: int, configs: tuple[CopyConfig, ...] = (DEFAULT_CONFIG,),
                 widths: tuple[int, ...] = _WIDTHS) -> None:
        d = drv()
        self.device = device
        self.configs = tuple(configs)
        self.config = self.configs[0]
        self.widths = tuple(widths)
        self._ctx = cudadrv.primary_context(device)
        self._ctx_id = int(self._ctx)
        with cudadrv.on_device(device):
            dev = check(d.cuDeviceGet(device), "cuDeviceGet")
            attr = d.CUdevice_attribute
            major = check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                          "cuDeviceGetAttribute")
            minor = check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                          "cuDeviceGetAttribute")
            self.sm_count = int(check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
                                      "cuDeviceGetAttribute"))
            # keep the image in a numpy buffer and pass its address (what the driver API takes)
            self._image = np.frombuffer(compile_cubin(f"sm_{major}{minor}", self.configs, self.widths),
                                        dtype=np.uint8).copy()
            self._module = check(d.cuModuleLoadData(self._image.ctypes.data), "cuModuleLoadData")
            self._fn = {(c.kernel_key, w): check(d.cuModuleGetFunction(
                self._module, kernel_name(w, c.kernel_key).encode()), "cuModuleGetFunction")
                for c in self.configs for w in self.widths}
        self._local = threading.local()

    # ------------------------------------------------------------ context
    def _enter(self) -> bool:
        """Make this device's primary context current unless it already is (the proxy's
        job threads keep it current: no push/pop per job). True when pushed."""
        d = drv()
        if int(check(d.cuCtxGetCurrent(), "cuCtxGetCurrent")) == self._ctx_id:
            return False
        check(d.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
        return True

    @staticmethod
    def _leave(pushed: bool) -> None:
        if pushed:
            check(drv().cuCtxPopCurrent(), "cuCtxPopCurrent")

    def _state(self) -> _ThreadState:
        st: _ThreadState | None = getattr(self._local, "state", None)
        if st is None:
            st = self._local.state = _ThreadState()
        return st

    # ------------------------------------------------------------ resources
    def stream(self) -> int:
        """A per-thread non-blocking stream of this device (the proxy's job stream)."""
        st = self._state()
        if not st.stream:
            d = drv()
            pushed = self._enter()
            try:
                st.stream = int(check(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING),
                                      "cuStreamCreate"))
            finally:
                self._leave(pushed)
        return st.stream

    def _reserve(self, st: _ThreadState, entries: int) -> None:
        if st.capacity >= entries:
            return
        d = drv()
        size = max(entries, 8192)
        if st.dev_ptr:
            check(d.cuMemFree(st.dev_ptr), "cuMemFree")
            check(d.cuMemFreeHost(st.host_ptr), "cuMemFreeHost")
            st.dev_ptr = st.host_ptr = st.capacity = 0
        st.dev_ptr = int(check(d.cuMemAlloc(size * 8), "cuMemAlloc(slot scratch)"))
        st.host_ptr = int(check(d.cuMemHostAlloc(size * 8, d.CU_MEMHOSTALLOC_PORTABLE),
                                "cuMemHostAlloc(slot scratch)"))
        st.host = np.ctypeslib.as_array((ctypes.c_int64 * size).from_address(st.host_ptr))
        st.capacity = size

    def upload(self, arrays: list[np.ndarray], stream: int) -> list[int]:
        """Copy int64 slot arrays, back to back, through a pinned buffer to this thread's
        device scratch with ONE async copy on `stream`; returns their device pointers.
        A launch on `stream` after this call sees them. Waits first only if an earlier
        job of this thread may still read the scratch (it was not `sync`ed)."""
        st = self._state()
        entries = sum(int(a.size) for a in arrays)
        d = drv()
        pushed = self._enter()
        try:
            if st.busy_stream is not None:
                check(d.cuStreamSynchronize(st.busy_stream), "cuStreamSynchronize")
                st.busy_stream = None
            self._reserve(st, entries)
            out, off = [], 0
            for a in arrays:
                k = int(a.size)
                st.host[off:off + k] = a  # one host copy (casts to int64 when needed)
                out.append(st.dev_ptr + 8 * off)
                off += k
            if entries:
                check(d.cuMemcpyHtoDAsync(st.dev_ptr, st.host_ptr, 8 * entries, stream), "cuMemcpyHtoDAsync")
                st.busy_stream = stream
        finally:
            self._leave(pushed)
        return out

    # ------------------------------------------------------------ launches
    def grid(self, n: int, planes: int, config: CopyConfig | None = None) -> int:
        cfg = config or self.config
        groups = (planes * n + cfg.rows - 1) // cfg.rows
        return groups if cfg.blocks_per_sm == 0 else min(groups, cfg.blocks_per_sm * self.sm_count)

    def width(self, src_ptr: int, dst_ptr: int, src_plane_stride: int, dst_plane_stride: int,
              row_bytes: int) -> int:
        """The widest vector this module has that divides the row, pointers and strides."""
        for w in self.widths:
            if (row_bytes % w == 0 and src_ptr % w == 0 and dst_ptr % w == 0
                    and src_plane_stride % w == 0 and dst_plane_stride % w == 0):
                return w
        raise ValueError(f"no compiled vector width in {self.widths} divides row_bytes={row_bytes}, "
                         f"the pointers and the plane strides; compile width 1 as well")

    def launch_raw(self, src_ptr: int, dst_ptr: int, src_slots_dev: int, dst_slots_dev: int,
                   n: int, planes: int, src_plane_stride: int, dst_plane_stride: int,
                   row_bytes: int, stream: int, config: CopyConfig | None = None) -> None:
        """Enqueue one copy kernel on `stream`. Slot pointers are device int64 arrays of
        n entries, or 0 for the identity."""
        if n <= 0:
            return
        cfg = config or self.config
        width = self.width(src_ptr, dst_ptr, src_plane_stride, dst_plane_stride, row_bytes)
        fn = self._fn.get((cfg.kernel_key, width))
        if fn is None:
            raise ValueError(f"copy config {cfg} is not compiled in this module (configs: "
                             f"{[str(c) for c in self.configs]})")
        st = self._state()
        v = st.values
        # i64 arguments travel as their two's-complement bits; all are >= 0 here.
        v[0], v[1], v[2], v[3] = src_ptr, dst_ptr, src_slots_dev, dst_slots_dev
        v[4], v[5], v[6], v[7], v[8] = n, planes, src_plane_stride, dst_plane_stride, row_bytes
        d = drv()
        pushed = self._enter()
        try:
            check(d.cuLaunchKernel(fn, self.grid(n, planes, cfg), 1, 1, cfg.threads, 1, 1, 0, stream,
                                   st.params_addr, 0), "cuLaunchKernel(copy_rows)")
        finally:
            self._leave(pushed)

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
        pushed = self._enter()
        try:
            check(drv().cuStreamSynchronize(stream), "cuStreamSynchronize")
        finally:
            self._leave(pushed)
        st = self._state()
        if st.busy_stream == stream:
            st.busy_stream = None

    def make_current(self) -> None:
        """Leave this device's primary context current on the calling thread (the
        proxy's job threads, which run nothing else): later calls skip push/pop."""
        check(drv().cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")


_copiers: dict[tuple[int, CopyConfig], RowCopier] = {}
_copiers_lock = threading.Lock()


def copier(device: int, config: CopyConfig = DEFAULT_CONFIG) -> RowCopier:
    with _copiers_lock:
        c = _copiers.get((device, config))
        if c is None:
            c = RowCopier(device, (config,))
            _copiers[(device, config)] = c
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
         dst_slots: np.ndarray | None, n: int, config: CopyConfig, exec_dev: int | None) -> None:
    exec_dev = dst.device.index if exec_dev is None else exec_dev
    for t in (src, dst):
        enable_peer(exec_dev, t.device.index)
    # Run after whatever torch queued on both tensors, and block until done: the callers
    # (transports) promise "rows are in D's memory" when they return.
    torch.cuda.synchronize(src.device)
    torch.cuda.synchronize(dst.device)
    stream = torch.cuda.current_stream(torch.device("cuda", exec_dev)).cuda_stream
    row_bytes = int(np.prod(src.shape[3:])) * src.element_size()
    planes = src.shape[0] * 2
    c = copier(exec_dev, config)
    c.launch(src.data_ptr(), dst.data_ptr(), src_slots, dst_slots, n, planes,
             src.shape[2] * row_bytes, dst.shape[2] * row_bytes, row_bytes, stream)
    c.sync(stream)


def copy_rows(src: torch.Tensor, src_slots: Any, dst: torch.Tensor, dst_slots: Any,
              config: CopyConfig = DEFAULT_CONFIG, exec_device: int | None = None) -> None:
    """dst[:, :, dst_slots[i]] = src[:, :, src_slots[i]] in one kernel, run on
    `exec_device` (default: dst's GPU, i.e. the source is read over the peer link)."""
    _check_pair(src, dst)
    s = _slots(src_slots, src.shape[2], "src_slots")
    d = _slots(dst_slots, dst.shape[2], "dst_slots")
    if s.shape != d.shape:
        raise ValueError(f"src_slots has {s.size} entries, dst_slots {d.size}")
    _run(src, dst, s, d, int(s.size), config, exec_device)


def gather_rows(src: torch.Tensor, slots: Any, config: CopyConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Staging `[n_layers, 2, n, n_kv_heads, head_dim]` holding src's rows at `slots`."""
    s = _slots(slots, src.shape[2], "slots")
    out = torch.empty((src.shape[0], 2, s.size, *src.shape[3:]), dtype=src.dtype, device=src.device)
    _check_pair(src, out)
    _run(src, out, s, None, int(s.size), config, None)
    return out


def scatter_rows(staging: torch.Tensor, dst: torch.Tensor, slots: Any,
                 config: CopyConfig = DEFAULT_CONFIG) -> None:
    """dst[:, :, slots[i]] = staging[:, :, i]."""
    _check_pair(staging, dst)
    s = _slots(slots, dst.shape[2], "slots")
    if s.size != staging.shape[2]:
        raise ValueError(f"staging holds {staging.shape[2]} rows per plane, slots has {s.size}")
    _run(staging, dst, None, s, int(s.size), config, None)


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
