"""The `proxy` KV transport: P and D register their pools with the nvlink-proxy sidecar,
which copies rows between them (sidecars/nvlink_proxy).

Owns the client side: the auth handshake, region registration (host shm on CPU;
legacy CUDA IPC handle or cuMem POSIX fd on GPU, named by GPU UUID), copy jobs and the
sender's quiesce bookkeeping. D's receiver also registers a small probe region so
`auto` can run a verified test transfer without touching pool slots that may belong to
live requests.

Copy jobs travel over the proxy's copy lane (a unix stream socket, SO_PEERCRED-checked,
protobuf frames) rather than the Copy RPC: same messages and checks, about a tenth of
the per-call cost. Every write records where its time went (`last_stages`).

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
    WriteGate,
)
from pdunit.engine.transfer.host import HostReceiver
from pdunit.sidecars.nvlink_proxy import proxy_pb2 as pb
from pdunit.sidecars.nvlink_proxy import proxy_pb2_grpc as pb_grpc
from pdunit.sidecars.nvlink_proxy.lane_framing import recv_frame, send_frame

SESSION_KEY = "x-pdunit-session"
DEFAULT_SOCKET = "/run/pdunit/proxy.sock"
PROBE_SLOTS = 16
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
                 timeout_s: float = 5.0, copy_lane: bool = True) -> None:
        self.socket_path = socket_path
        self.auth_path = auth_path or socket_path + ".auth"
        self.lane_path = socket_path + ".copy"
        self.timeout_s = timeout_s
        # Copy jobs go over the copy lane (one connection per calling thread) unless
        # told to use the Copy RPC; an unreachable lane is an error, never a fallback.
        self.copy_lane = copy_lane
        self._lane = threading.local()
        self._lane_socks: list[socket.socket] = []
        self._lane_lock = threading.Lock()
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
        if not self.copy_lane:
            req.client_send_ns = time.monotonic_ns()  # the proxy reports the way in as stage "recv"
            return self.call("Copy", req, timeout_s=timeout_s)  # type: ignore[return-value]
        return self._lane_copy(req, timeout_s or self.timeout_s)

    # ------------------------------------------------------------ copy lane
    def _lane_sock(self) -> socket.socket:
        sock: socket.socket | None = getattr(self._lane, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.lane_path)
            except OSError as e:
                sock.close()
                err = TransferError(f"nvlink-proxy copy lane {self.lane_path} unreachable ({e}): is "
                                    "`pdunit proxy` running and sharing /run/pdunit with this container?",
                                    retryable=True)
                err.code = "UNAVAILABLE"  # type: ignore[attr-defined]
                raise err from e
            self._lane.sock = sock
            with self._lane_lock:
                self._lane_socks.append(sock)
        return sock

    def _lane_drop(self) -> None:
        sock = getattr(self._lane, "sock", None)
        if sock is not None:
            self._lane.sock = None
            with self._lane_lock:
                if sock in self._lane_socks:
                    self._lane_socks.remove(sock)
            sock.close()

    def _lane_copy(self, req: pb.CopyRequest, timeout_s: float) -> pb.CopyReply:
        sock = self._lane_sock()

        def fail(code: str, detail: str) -> TransferError:
            err = TransferError(f"nvlink-proxy Copy: {code}: {detail}",
                                retryable=code in {c.name for c in _RETRYABLE})
            err.code = code  # type: ignore[attr-defined]
            return err

        try:
            sock.settimeout(timeout_s)
            req.client_send_ns = time.monotonic_ns()  # the proxy reports the way in as stage "recv"
            send_frame(sock, req.SerializeToString())
            body = recv_frame(sock)
            if body is None:
                raise EOFError("the proxy closed the copy lane")
        except TimeoutError:
            # The job may still run in the proxy: the caller's quiesce asks the proxy.
            self._lane_drop()
            raise fail("DEADLINE_EXCEEDED", f"no answer on the copy lane within {timeout_s:.3f} s") from None
        except (OSError, EOFError) as e:
            self._lane_drop()
            raise fail("UNAVAILABLE", f"copy lane {self.lane_path} broke: {e}") from None
        answer = pb.LaneReply.FromString(body)
        if answer.code:
            if answer.code in ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED"):
                self._lane_drop()  # the proxy hung up after refusing the connection
            raise fail(answer.code, answer.message)
        return answer.reply

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
        with self._lane_lock:
            socks, self._lane_socks = self._lane_socks, []
        for sock in socks:
            sock.close()
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
                 socket_path: str = "", method: int = pb.METHOD_AUTO, copy_lane: bool = True) -> None:
        if descriptor.mode != "proxy":
            raise TransferError(f"ProxySender needs a 'proxy' descriptor, got {descriptor.mode!r}")
        for key in ("region", "probe_region"):
            if key not in descriptor.params:
                raise TransferError(f"proxy descriptor lacks {key!r}")
        self.geometry = geometry
        self.device = torch.device(device)
        self.method = method
        self.client = ProxyClient(socket_path or descriptor.params.get("socket", DEFAULT_SOCKET),
                                  copy_lane=copy_lane)
        self.dst_region = descriptor.params["region"]
        self.probe_region = descriptor.params["probe_region"]
        self.probe_slots = int(descriptor.params.get("probe_slots", PROBE_SLOTS))
        self._lock = threading.Lock()  # source registration and staging segments
        self._gate = WriteGate()
        self._sources: dict[tuple[int, int], str] = {}
        # CPU sources: a staging segment per writing thread (P writes from several),
        # every one listed for close().
        self._staging = threading.local()
        self._stagings: list[tuple[HostReceiver, str]] = []
        self.last_reply: pb.CopyReply | None = None
        # Where the last write's time went: "prepare" (this side, before the RPC), the
        # proxy's stages (recv .. reply, see sidecars/nvlink_proxy/stages.py), "return"
        # (reply built -> received here) and "total" (the whole write).
        self.last_stages: dict[str, float] = {}

    # ------------------------------------------------------------ sources
    def source_region(self, src: torch.Tensor) -> str:
        """The proxy region of a GPU source pool (registered once, by IPC handle)."""
        key = (src.data_ptr(), src.numel())
        with self._lock:  # held across Register: concurrent writers register it once
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
        mine: tuple[HostReceiver, str] | None = getattr(self._staging, "segment", None)
        if mine is None or mine[0].geometry.n_slots < n:
            if mine is not None:
                with self._lock:
                    self._stagings.remove(mine)
                self.client.unregister(mine[1])
                mine[0].close()
            seg = HostReceiver(_with_slots(self.geometry, max(n, 64)))
            mine = (seg, self.client.register_host("p-staging", seg.name, seg.geometry))
            self._staging.segment = mine
            with self._lock:
                self._stagings.append(mine)
        idx = torch.as_tensor(src_slots, dtype=torch.int64)
        mine[0].storage[:, :, :n].copy_(src.index_select(2, idx))
        return mine[1], np.arange(n, dtype=np.int64)

    # ------------------------------------------------------------ writes
    def write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray,
              dst_slots: np.ndarray, deadline_unix_ms: int, *, capability: bytes = b"") -> None:
        self._write(request_id, src, src_slots, dst_slots, deadline_unix_ms, self.dst_region, False)

    def _write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray, dst_slots: np.ndarray,
               deadline_unix_ms: int, dst_region: str, verify: bool) -> pb.CopyReply:
        t0 = time.perf_counter()
        with self._gate.writing(request_id, deadline_unix_ms):
            s = np.ascontiguousarray(src_slots, dtype=np.int64)
            d = np.ascontiguousarray(dst_slots, dtype=np.int64)
            if src.is_cuda:
                # The proxy reads the rows outside any stream of ours: the work that wrote
                # them must be complete. It is ordered before the caller's current stream
                # (P's transfer stage waits on the forward's event); a device-wide sync
                # would also wait for the next batch's forward.
                torch.cuda.current_stream(src.device).synchronize()
                src_region, s_eff = self.source_region(src), s
            else:
                src_region, s_eff = self._host_stage(src, s)
            remaining_s = max(0.05, deadline_unix_ms / 1000.0 - time.time())
            t1 = time.perf_counter()
            reply = self.client.copy(request_id, src_region, s_eff, dst_region, d, deadline_unix_ms,
                                     method=self.method, verify=verify, timeout_s=remaining_s + 1.0)
            received_ns = time.monotonic_ns()
            stages = {"prepare": t1 - t0, **reply.stage_seconds}
            if reply.proxy_done_ns:
                stages["return"] = max(0.0, (received_ns - reply.proxy_done_ns) / 1e9)
            stages["total"] = time.perf_counter() - t0
            self.last_reply, self.last_stages = reply, stages
            return reply

    def probe(self, src: torch.Tensor, src_slots: np.ndarray, request_id: int) -> tuple[int, int]:
        """Write rows into D's probe region with verification: returns (src, dst)
        checksums as computed by the proxy from the two regions' memory."""
        n = int(src_slots.size)
        dst = np.arange(n, dtype=np.int64)
        reply = self._write(request_id, src, src_slots, dst, int(time.time() * 1000) + 30_000,
                            self.probe_region, True)
        return int(reply.src_checksum), int(reply.dst_checksum)

    def quiesce(self, request_id: int) -> bool:
        if not self._gate.quiesce(request_id):
            return False  # a write of ours is still between P and the proxy
        try:
            quiesced, _ = self.client.quiesce([request_id], cancel=True)
        except TransferError:
            return False  # a proxy we cannot reach proves nothing
        return quiesced

    def in_flight(self) -> list[int]:
        return self._gate.in_flight()

    def close(self) -> None:
        with self._lock:
            stagings, self._stagings = self._stagings, []
        for region in list(self._sources.values()) + [region for _, region in stagings]:
            try:
                self.client.unregister(region)
            except TransferError:
                pass
        for seg, _ in stagings:
            seg.close()
        self.client.close()
