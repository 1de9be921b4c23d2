"""The CUDA driver calls the copy kernels, every GPU transport and the nvlink-proxy share.

Owns: device lookup by UUID (never by index: a pod's container numbers its devices unlike
the proxy), primary-context scoping, legacy IPC export/open, cuMem (VMM) allocations
exported as POSIX fds or FABRIC handles and their import, pidfd_getfd, and a raw device
pointer as a torch tensor without a copy. Every driver error becomes `CudaError` with the
driver's error name and the call (the harness reports them verbatim). Never decides a
transfer mode or falls back silently: callers decide. `cuda.bindings` is imported lazily,
so CPU-only processes can import this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

_lock = threading.Lock()
_initialised = False

IPC_HANDLE_BYTES = 64
FABRIC_HANDLE_BYTES = 64


class CudaError(RuntimeError):
    """A driver call failed; `name` is the driver's error name (CUDA_ERROR_...)."""

    def __init__(self, call: str, name: str, detail: str = "") -> None:
        self.call = call
        self.name = name
        super().__init__(f"{call} failed: {name}" + (f" ({detail})" if detail else ""))


def drv() -> Any:
    from cuda.bindings import driver

    return driver


def check(result: Any, call: str) -> Any:
    """Unpack a cuda.bindings result tuple; raise CudaError on a non-success code."""
    d = drv()
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if err != d.CUresult.CUDA_SUCCESS:
        name_res = d.cuGetErrorName(err)
        name = name_res[1].decode() if name_res[0] == d.CUresult.CUDA_SUCCESS else str(err)
        raise CudaError(call, name)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def init() -> None:
    global _initialised
    with _lock:
        if not _initialised:
            check(drv().cuInit(0), "cuInit")
            _initialised = True


def device_count() -> int:
    init()
    return int(check(drv().cuDeviceGetCount(), "cuDeviceGetCount"))


def _uuid_str(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def device_uuid(ordinal: int) -> str:
    """nvidia-smi style UUID of the device with this CUDA ordinal (in this process)."""
    init()
    d = drv()
    dev = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
    uuid = check(d.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
    return _uuid_str(bytes(uuid.bytes))


def device_by_uuid(uuid: str) -> int:
    """The CUDA ordinal, in this process, of the GPU with this UUID."""
    for ordinal in range(device_count()):
        if device_uuid(ordinal) == uuid:
            return ordinal
    seen = [device_uuid(i) for i in range(device_count())]
    raise CudaError("device_by_uuid", "CUDA_ERROR_INVALID_DEVICE",
                    f"GPU {uuid} is not visible to this process; visible: {seen}")


def device_pci_bus_id(ordinal: int) -> str:
    init()
    d = drv()
    dev = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
    bus = check(d.cuDeviceGetPCIBusId(32, dev), "cuDeviceGetPCIBusId")
    return bus.decode().rstrip("\x00") if isinstance(bus, bytes) else str(bus)


_primary: dict[int, Any] = {}


def primary_context(ordinal: int) -> Any:
    """The device's primary context: the one torch and the CUDA runtime use."""
    init()
    with _lock:
        ctx = _primary.get(ordinal)
        if ctx is None:
            d = drv()
            dev = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
            ctx = check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _primary[ordinal] = ctx
        return ctx


@contextlib.contextmanager
def on_device(ordinal: int) -> Iterator[None]:
    """Make the device's primary context current on this thread for the block."""
    d = drv()
    check(d.cuCtxPushCurrent(primary_context(ordinal)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        check(d.cuCtxPopCurrent(), "cuCtxPopCurrent")


def ptr_int(p: Any) -> int:
    return int(p)


def address_range(ptr: int) -> tuple[int, int]:
    """(allocation base, allocation size) of the allocation holding `ptr`."""
    base, size = check(drv().cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    return int(base), int(size)


# ----------------------------------------------------------------- legacy IPC
def ipc_export(ptr: int, device: int) -> tuple[bytes, int]:
    """Legacy IPC handle of the cudaMalloc allocation holding `ptr`, and ptr's offset in it."""
    with on_device(device):
        base, _ = address_range(ptr)
        handle = check(drv().cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES), ptr - base


def ipc_open(handle: bytes, device: int) -> int:
    """Open a legacy IPC handle in `device`'s primary context, enabling peer access
    lazily when the memory lives on another GPU. Returns the allocation base."""
    d = drv()
    if len(handle) != IPC_HANDLE_BYTES:
        raise CudaError("cuIpcOpenMemHandle", "CUDA_ERROR_INVALID_VALUE",
                        f"IPC handle has {len(handle)} bytes, expected {IPC_HANDLE_BYTES}")
    h = d.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_BYTES)
    flags = d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    with on_device(device):
        return int(check(d.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))


def ipc_close(ptr: int, device: int) -> None:
    with on_device(device):
        check(drv().cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


# ----------------------------------------------------------------- cuMem (VMM)
def _granularity(prop: Any) -> int:
    d = drv()
    return int(check(d.cuMemGetAllocationGranularity(
        prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity"))


def _prop(device: int, handle_types: Any) -> Any:
    d = drv()
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = handle_types
    return prop


def _map(handle: Any, size: int, device: int) -> int:
    """Reserve a VA range, map the physical handle, grant `device` read/write access."""
    d = drv()
    va = int(check(d.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve"))
    check(d.cuMemMap(va, size, 0, handle, 0), "cuMemMap")
    access = d.CUmemAccessDesc()
    access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check(d.cuMemSetAccess(va, size, [access], 1), "cuMemSetAccess")
    return va


@dataclass
class VmmAllocation:
    """A cuMem allocation mapped in this process. `fd` / `fabric` are its exports."""

    ptr: int
    size: int
    device: int
    handle: Any
    fd: int = -1
    fabric: bytes = b""
    imported: bool = False

    def close(self) -> None:
        d = drv()
        if self.ptr:
            with on_device(self.device):
                check(d.cuMemUnmap(self.ptr, self.size), "cuMemUnmap")
                check(d.cuMemAddressFree(self.ptr, self.size), "cuMemAddressFree")
                check(d.cuMemRelease(self.handle), "cuMemRelease")
            self.ptr = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def vmm_alloc(size: int, device: int, posix_fd: bool, fabric: bool) -> VmmAllocation:
    """cuMemCreate on `device`, exportable as a POSIX fd or as a FABRIC handle.

    FABRIC needs an IMEX channel: without one cuMemCreate answers
    CUDA_ERROR_NOT_PERMITTED even where the device attribute says FABRIC is supported,
    which is why callers must treat the allocation, not the attribute, as the proof.
    """
    d = drv()
    if posix_fd == fabric:
        # cuda.bindings exposes requestedHandleTypes as a single enum value.
        raise ValueError("vmm_alloc: ask for exactly one of posix_fd and fabric")
    types = (d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if posix_fd
             else d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
    with on_device(device):
        prop = _prop(device, types)
        gran = _granularity(prop)
        size = (size + gran - 1) // gran * gran
        handle = check(d.cuMemCreate(size, prop, 0), "cuMemCreate")
        try:
            ptr = _map(handle, size, device)
        except CudaError:
            d.cuMemRelease(handle)
            raise
        alloc = VmmAllocation(ptr=ptr, size=size, device=device, handle=handle)
        try:
            if posix_fd:
                alloc.fd = int(check(d.cuMemExportToShareableHandle(
                    handle, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                    "cuMemExportToShareableHandle(POSIX_FD)"))
            if fabric:
                fh = check(d.cuMemExportToShareableHandle(
                    handle, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC, 0),
                    "cuMemExportToShareableHandle(FABRIC)")
                alloc.fabric = bytes(fh.data)
        except CudaError:
            alloc.close()
            raise
        return alloc


def vmm_import_fd(fd: int, size: int, device: int) -> VmmAllocation:
    """Import a POSIX-fd cuMem export and map it for `device` (which may differ from
    the device that owns the memory: access then goes over the peer link)."""
    d = drv()
    with on_device(device):
        handle = check(d.cuMemImportFromShareableHandle(
            fd, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle(POSIX_FD)")
        ptr = _map(handle, size, device)
    return VmmAllocation(ptr=ptr, size=size, device=device, handle=handle, imported=True)


def vmm_import_fabric(data: bytes, size: int, device: int) -> VmmAllocation:
    d = drv()
    fh = d.CUmemFabricHandle()
    fh.data = data
    with on_device(device):
        handle = check(d.cuMemImportFromShareableHandle(
            fh, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC),
            "cuMemImportFromShareableHandle(FABRIC)")
        ptr = _map(handle, size, device)
    return VmmAllocation(ptr=ptr, size=size, device=device, handle=handle, imported=True)


# ----------------------------------------------------------------- pidfd_getfd
_SYS_PIDFD_OPEN = 434
_SYS_PIDFD_GETFD = 438


def fd_from_process(pid: int, fd: int) -> int:
    """Duplicate another process's fd into this one (pidfd_getfd, Linux >= 5.6).

    Needs the two processes in one PID namespace view (a pod with
    shareProcessNamespace) and ptrace permission over the owner (same uid, or
    CAP_SYS_PTRACE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(_SYS_PIDFD_OPEN, ctypes.c_int(pid), ctypes.c_uint(0))
    if pidfd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pidfd_open({pid}): {os.strerror(err)}")
    try:
        out = libc.syscall(_SYS_PIDFD_GETFD, ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0))
        if out < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd(pid {pid}, fd {fd}): {os.strerror(err)}")
        return int(out)
    finally:
        os.close(pidfd)


# ----------------------------------------------------------------- torch views
class _CudaArray:
    """Exposes a raw device pointer through __cuda_array_interface__ for torch."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "data": (ptr, False), "shape": shape, "typestr": typestr, "version": 3,
            "strides": None, "stream": None,
        }


_TYPESTR = {torch.bfloat16: "<i2", torch.float16: "<f2", torch.float32: "<f4",
            torch.float64: "<f8", torch.uint8: "|u1", torch.int16: "<i2", torch.float8_e4m3fn: "|u1"}


def tensor_view(ptr: int, shape: tuple[int, ...], dtype: torch.dtype, device: int,
                owner: Any = None) -> torch.Tensor:
    """A torch tensor over `ptr` (no copy). `owner` is kept alive by the tensor's
    base object. bf16 (fp8) is viewed through int16 (uint8): the interface has neither."""
    typestr = _TYPESTR[dtype]
    # No device= argument: torch takes the device from the pointer itself, and a
    # mismatching device= would make it copy instead of view.
    with torch.cuda.device(device):
        t = torch.as_tensor(_CudaArray(ptr, shape, typestr, owner))
    if dtype in (torch.bfloat16, torch.float8_e4m3fn):
        t = t.view(dtype)
    return t
