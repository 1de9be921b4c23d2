"""The `proxy` KV transport: P and D register their pools with the nvlink-proxy sidecar,
which copies rows between them (sidecars/nvlink_proxy).

Owns the client side: the auth handshake, region registration (host shm on CPU;
legacy CUDA IPC handle or cuMem POSIX fd on GPU, named by GPU UUID), copy jobs and the
sender's quiesce bookkeeping. D's receiver also registers a small probe region so
`auto` can run a verified test transfer without touching pool slots that may belong to
live requests.

Quiesce proof: a request is quiesced when P has no Copy RPC of it running AND the
proxy confirms, after marking the id cancelled, that no job of it runs there (a Copy
that timed out on P's side may still run in the proxy). An unreachable or stopped
proxy is never taken as proof. Must never decide page ownership.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import OrderedDict

import grpc
import numpy as np
import torch

from pdunit.engine.model.config import dtype_name
from pdunit.engine.transfer.base import (
    Descriptor,
    KVReceiver,
    KVSender,
    PoolGeometry,
    TransferError,
)
from pdunit.engine.transfer.host import HostReceiver
from pdunit.sidecars.nvlink_proxy import proxy_pb2 as pb
from pdunit.sidecars.nvlink_proxy import proxy_pb2_grpc as pb_grpc

SESSION_KEY = "x-pdunit-session"
DEFAULT_SOCKET = "/run/pdunit/proxy.sock"
PROBE_SLOTS = 16
_CANCELLED_MEMORY = 100_000
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.RESOURCE_EXHAUSTED}


def layout_pb(geometry: PoolGeometry, n_slots: int | None = None) -> pb.Layout:
    return pb.Layout(n_layers=geometry.n_layers, n_kv_heads=geometry.n_kv_heads,
                     head_dim=geometry.head_dim, dtype=dtype_name(geometry.dtype),
                     n_slots=geometry.n_slots if n_slots is None else n_slots)


def _with_slots(geometry: PoolGeometry, n_slots: int) -> PoolGeometry:
    return PoolGeometry(geometry.n_layers, geometry.n_kv_heads, geometry.head_dim,
                        geometry.dtype, n_slots, 1)


class ProxyClient:
    """A session with the proxy: auth handshake, then gRPC calls carrying the token."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, auth_path: str = "",
                 timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.auth_path = auth_path or socket_path + ".auth"
        self.timeout_s = timeout_s
        answer = self._handshake()
        if "error" in answer:
            raise TransferError(f"nvlink-proxy at {self.auth_path} refused this process: {answer['error']}")
        self.token: str = answer["token"]
        self.proxy_instance: str = answer.get("instance_id", "")
        self.channel = grpc.insecure_channel(f"unix:{socket_path}",
                                             options=[("grpc.max_send_message_length", 64 << 20)])
        self.stub = pb_grpc.NvlinkProxyStub(self.channel)
        self.metadata = ((SESSION_KEY, self.token),)

    def _handshake(self) -> dict:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            s.connect(self.auth_path)
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
        except OSError as e:
            raise TransferError(f"nvlink-proxy auth socket {self.auth_path} unreachable ({e}): is "
                                "`pdunit proxy` running and sharing /run/pdunit with this container?",
                                retryable=True) from e
        finally:
            s.close()
        try:
            return json.loads(buf)
        except ValueError:
            raise TransferError(f"nvlink-proxy auth socket {self.auth_path} answered {buf[:200]!r}",
                                retryable=True) from None

    def call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        try:
            return getattr(self.stub, method)(request, metadata=self.metadata,
                                              timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            details = e.details() if hasattr(e, "details") else str(e)
            err = TransferError(f"nvlink-proxy {method}: {code.name}: {details}",
                                retryable=code in _RETRYABLE)
            err.code = code.name  # type: ignore[attr-defined]
            raise err from None

    def register(self, request: pb.RegisterRequest) -> str:
        reply = self.call("Register", request, timeout_s=max(self.timeout_s, 30.0))
        return reply.region_id  # type: ignore[attr-defined]

    def register_host(self, name: str, shm_name: str, geometry: PoolGeometry) -> str:
        lay = layout_pb(geometry)
        return self.register(pb.RegisterRequest(
            name=name, kind=pb.HOST_SHM, layout=lay, shm_name=shm_name,
            size_bytes=geometry.bytes_for(geometry.n_slots)))

    def register_cuda(self, name: str, tensor: torch.Tensor, geometry: PoolGeometry,
                      vmm: object | None = None) -> str:
        """Register a GPU pool: a cuMem allocation (`vmm`, exported as POSIX fd) or else
        the tensor's cudaMalloc allocation through a legacy IPC handle."""
        from pdunit.engine.transfer import cudadrv

        dev = tensor.device.index
        uuid = cudadrv.device_uuid(dev)
        size = geometry.bytes_for(geometry.n_slots)
        lay = layout_pb(geometry)
        if vmm is not None:
            return self.register(pb.RegisterRequest(
                name=name, kind=pb.CUDA_POSIX_FD, layout=lay, size_bytes=size, gpu_uuid=uuid,
                owner_pid=os.getpid(), owner_fd=vmm.fd, alloc_bytes=vmm.size))  # type: ignore[attr-defined]
        handle, offset = cudadrv.ipc_export(tensor.data_ptr(), dev)
        return self.register(pb.RegisterRequest(
            name=name, kind=pb.CUDA_IPC, layout=lay, size_bytes=size, gpu_uuid=uuid,
            ipc_handle=handle, offset_bytes=offset))

    def unregister(self, region_id: str) -> None:
        self.call("Unregister", pb.UnregisterRequest(region_id=region_id))

    def copy(self, request_id: int, src_region: str, src_slots: np.ndarray, dst_region: str,
             dst_slots: np.ndarray, deadline_unix_ms: int, method: int = pb.METHOD_AUTO,
             verify: bool = False, timeout_s: float | None = None) -> pb.CopyReply:
        req = pb.CopyRequest(
            request_id=request_id, src_region=src_region, dst_region=dst_region,
            src_slots=np.ascontiguousarray(src_slots, dtype="<i8").tobytes(),
            dst_slots=np.ascontiguousarray(dst_slots, dtype="<i8").tobytes(),
            deadline_unix_ms=deadline_unix_ms, method=method, verify=verify)
        return self.call("Copy", req, timeout_s=timeout_s)  # type: ignore[return-value]

    def quiesce(self, request_ids: list[int], cancel: bool = True, wait_ms: int = 0) -> tuple[bool, list[int]]:
        reply = self.call("Quiesce", pb.QuiesceRequest(
            request_ids=np.asarray(request_ids, dtype="<u8").tobytes(), cancel=cancel, wait_ms=wait_ms),
            timeout_s=self.timeout_s + wait_ms / 1000)
        running = np.frombuffer(reply.running, dtype="<u8").tolist()  # type: ignore[attr-defined]
        return bool(reply.quiesced), [int(x) for x in running]  # type: ignore[attr-defined]

    def in_flight(self) -> list[int]:
        reply = self.call("InFlight", pb.Empty())
        return [int(x) for x in np.frombuffer(reply.request_ids, dtype="<u8")]  # type: ignore[attr-defined]

    def info(self) -> pb.InfoReply:
        return self.call("Info", pb.Empty())  # type: ignore[return-value]

    def close(self) -> None:
        self.channel.close()


def _is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


class ProxyReceiver(KVReceiver):
    """D's side: allocates the pool (host shm, or GPU memory) and registers it, plus a
    probe region of PROBE_SLOTS slots for verified test transfers."""

    mode = "proxy"

    def __init__(self, geometry: PoolGeometry, device: str, socket_path: str = DEFAULT_SOCKET,
                 storage: torch.Tensor | None = None, vmm: object | None = None,
                 shm_pool: HostReceiver | None = None) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self.client = ProxyClient(socket_path)
        self._owned: list[HostReceiver] = []
        probe_geo = _with_slots(geometry, PROBE_SLOTS)
        if _is_cuda(self.device):
            self._storage = storage if storage is not None else torch.empty(
                geometry.shape(), dtype=geometry.dtype, device=self.device)
            self.probe_storage = torch.zeros(probe_geo.shape(), dtype=geometry.dtype, device=self.device)
            self.region = self.client.register_cuda("d-pool", self._storage, geometry, vmm=vmm)
            self.probe_region = self.client.register_cuda("d-probe", self.probe_storage, probe_geo)
        else:
            pool = shm_pool if shm_pool is not None else HostReceiver(geometry)
            probe = HostReceiver(probe_geo)
            self._owned = [probe] if shm_pool is not None else [pool, probe]
            self._storage, self.probe_storage = pool.storage, probe.storage
            self.region = self.client.register_host("d-pool", pool.name, geometry)
            self.probe_region = self.client.register_host("d-probe", probe.name, probe_geo)
        self.socket_path = socket_path

    @property
    def storage(self) -> torch.Tensor:
        return self._storage

    def descriptors(self) -> list[Descriptor]:
        return [Descriptor("proxy", {
            "socket": self.socket_path, "region": self.region, "probe_region": self.probe_region,
            "probe_slots": str(PROBE_SLOTS), "proxy_instance": self.client.proxy_instance,
            "device": str(self.device)})]

    def close(self) -> None:
        for rid in (self.region, self.probe_region):
            try:
                self.client.unregister(rid)
            except TransferError:
                pass  # the proxy is gone: nothing is mapped there any more
        self.client.close()
        for r in self._owned:
            r.close()


class ProxySender(KVSender):
    mode = "proxy"

    def __init__(self, descriptor: Descriptor, geometry: PoolGeometry, device: str,
                 socket_path: str = "", method: int = pb.METHOD_AUTO) -> None:
        if descriptor.mode != "proxy":
            raise TransferError(f"ProxySender needs a 'proxy' descriptor, got {descriptor.mode!r}")
        for key in ("region", "probe_region"):
            if key not in descriptor.params:
                raise TransferError(f"proxy descriptor lacks {key!r}")
        self.geometry = geometry
        self.device = torch.device(device)
        self.method = method
        self.client = ProxyClient(socket_path or descriptor.params.get("socket", DEFAULT_SOCKET))
        self.dst_region = descriptor.params["region"]
        self.probe_region = descriptor.params["probe_region"]
        self.probe_slots = int(descriptor.params.get("probe_slots", PROBE_SLOTS))
        self._lock = threading.Lock()
        self._in_flight: dict[int, int] = {}
        self._cancelled: OrderedDict[int, None] = OrderedDict()
        self._sources: dict[tuple[int, int], str] = {}
        self._staging: HostReceiver | None = None
        self._staging_region = ""
        self.last_reply: pb.CopyReply | None = None

    # ------------------------------------------------------------ sources
    def source_region(self, src: torch.Tensor) -> str:
        """The proxy region of a GPU source pool (registered once, by IPC handle)."""
        key = (src.data_ptr(), src.numel())
        region = self._sources.get(key)
        if region is None:
            geo = _with_slots(self.geometry, src.shape[2])
            region = self.client.register_cuda("p-pool", src, geo)
            self._sources[key] = region
        return region

    def _host_stage(self, src: torch.Tensor, src_slots: np.ndarray) -> tuple[str, np.ndarray]:
        """CPU: the proxy can only read shared memory, so gather the rows into a staging
        segment this sender owns; the job then copies staging[0..n) -> dst."""
        n = int(src_slots.size)
        if self._staging is None or self._staging.geometry.n_slots < n:
            if self._staging is not None:
                self.client.unregister(self._staging_region)
                self._staging.close()
            self._staging = HostReceiver(_with_slots(self.geometry, max(n, 64)))
            self._staging_region = self.client.register_host("p-staging", self._staging.name,
                                                             self._staging.geometry)
        idx = torch.as_tensor(src_slots, dtype=torch.int64)
        self._staging.storage[:, :, :n].copy_(src.index_select(2, idx))
        return self._staging_region, np.arange(n, dtype=np.int64)

    # ------------------------------------------------------------ writes
    def _refuse_if_stopped(self, request_id: int, deadline_unix_ms: int) -> None:
        if request_id in self._cancelled:
            raise TransferError(f"request {request_id} was cancelled (quiesced): write refused")
        late_ms = time.time() * 1000.0 - deadline_unix_ms
        if late_ms > 0:
            raise TransferError(f"request {request_id}: transfer deadline passed {late_ms:.0f} ms ago")

    def write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray,
              dst_slots: np.ndarray, deadline_unix_ms: int) -> None:
        self._write(request_id, src, src_slots, dst_slots, deadline_unix_ms, self.dst_region, False)

    def _write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray, dst_slots: np.ndarray,
               deadline_unix_ms: int, dst_region: str, verify: bool) -> pb.CopyReply:
        with self._lock:
            self._refuse_if_stopped(request_id, deadline_unix_ms)
            self._in_flight[request_id] = self._in_flight.get(request_id, 0) + 1
        try:
            s = np.ascontiguousarray(src_slots, dtype=np.int64)
            d = np.ascontiguousarray(dst_slots, dtype=np.int64)
            if src.is_cuda:
                torch.cuda.synchronize(src.device)  # P's forward must have written the rows
                src_region, s_eff = self.source_region(src), s
            else:
                src_region, s_eff = self._host_stage(src, s)
            remaining_s = max(0.05, deadline_unix_ms / 1000.0 - time.time())
            reply = self.client.copy(request_id, src_region, s_eff, dst_region, d, deadline_unix_ms,
                                     method=self.method, verify=verify, timeout_s=remaining_s + 1.0)
            self.last_reply = reply
            return reply
        finally:
            with self._lock:
                left = self._in_flight[request_id] - 1
                if left:
                    self._in_flight[request_id] = left
                else:
                    del self._in_flight[request_id]

    def probe(self, src: torch.Tensor, src_slots: np.ndarray, request_id: int) -> tuple[int, int]:
        """Write rows into D's probe region with verification: returns (src, dst)
        checksums as computed by the proxy from the two regions' memory."""
        n = int(src_slots.size)
        dst = np.arange(n, dtype=np.int64)
        reply = self._write(request_id, src, src_slots, dst, int(time.time() * 1000) + 30_000,
                            self.probe_region, True)
        return int(reply.src_checksum), int(reply.dst_checksum)

    def quiesce(self, request_id: int) -> bool:
        with self._lock:
            self._cancelled[request_id] = None
            self._cancelled.move_to_end(request_id)
            while len(self._cancelled) > _CANCELLED_MEMORY:
                self._cancelled.popitem(last=False)
            if request_id in self._in_flight:
                return False
        try:
            quiesced, _ = self.client.quiesce([request_id], cancel=True)
        except TransferError:
            return False  # a proxy we cannot reach proves nothing
        return quiesced

    def in_flight(self) -> list[int]:
        with self._lock:
            return list(self._in_flight)

    def close(self) -> None:
        for region in list(self._sources.values()) + ([self._staging_region] if self._staging else []):
            try:
                self.client.unregister(region)
            except TransferError:
                pass
        if self._staging is not None:
            self._staging.close()
        self.client.close()
