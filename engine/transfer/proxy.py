"""The `proxy` KV transport: P and D register their pools with the nvlink-proxy sidecar,
which copies rows between them (sidecars/nvlink_proxy).

Owns the client side: the auth handshake and session (`ProxyClient`), registering again
after a proxy restart (`SessionKeeper`), D's pool, probe region and write grants told to
the proxy (`ProxyReceiver`, PROTOCOL.md 3.1), and P's copy jobs over the copy lane with
their quiesce proof (`ProxySender`). An unreachable, stopped or restarted proxy is never
taken as proof that a request is quiesced. Must never decide page ownership.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from pdunit.engine.model.config import dtype_name
from pdunit.engine.packing import pack, view
from pdunit.engine.proto import proxy_pb2 as pb
from pdunit.engine.proto import proxy_pb2_grpc as pb_grpc
from pdunit.engine.proto.lane_framing import recv_frame, send_frame
from pdunit.engine.transfer.base import (
    CAPABILITY_BYTES,
    Descriptor,
    KVReceiver,
    KVSender,
    PoolGeometry,
    TransferError,
    WriteGate,
)
from pdunit.engine.transfer.host import HostReceiver
from pdunit.engine.unit_layout import pod_socket

log = logging.getLogger("pdunit.transfer.proxy")

SESSION_KEY = "x-pdunit-session"
DEFAULT_SOCKET = pod_socket("proxy")
PROBE_SLOTS = 16
KEEPER_INTERVAL_S = 1.0  # how often a SessionKeeper asks the proxy whether it restarted
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
        self.token = self.session_id = self.proxy_instance = ""
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.handshake()
        # A restarted proxy must be reached again within a keeper round, not after
        # gRPC's default reconnect backoff (up to 120 s).
        self.channel = grpc.insecure_channel(f"unix:{socket_path}", options=[
            ("grpc.max_send_message_length", 64 << 20), ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)])
        self.stub = pb_grpc.NvlinkProxyStub(self.channel)

    def handshake(self) -> None:
        """A new session (at start, and after the proxy restarted: its old token is void)."""
        answer = self._handshake_answer()
        if "error" in answer:
            raise TransferError(f"nvlink-proxy at {self.auth_path} refused this process: {answer['error']}")
        self.token = answer["token"]
        self.session_id = answer.get("session_id", "")
        self.proxy_instance = answer.get("instance_id", "")
        self.metadata = ((SESSION_KEY, self.token),)

    def _handshake_answer(self) -> dict:
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

    def register(self, request: pb.RegisterRequest, timeout_s: float | None = None) -> str:
        reply = self.call("Register", request, timeout_s=timeout_s or max(self.timeout_s, 30.0))
        return reply.region_id  # type: ignore[attr-defined]

    def register_host(self, name: str, shm_name: str, geometry: PoolGeometry,
                      timeout_s: float | None = None) -> str:
        lay = layout_pb(geometry)
        return self.register(pb.RegisterRequest(
            name=name, kind=pb.HOST_SHM, layout=lay, shm_name=shm_name,
            size_bytes=geometry.bytes_for(geometry.n_slots)), timeout_s=timeout_s)

    def register_cuda(self, name: str, tensor: torch.Tensor, geometry: PoolGeometry,
                      vmm: object | None = None) -> str:
        """Register a GPU pool: a cuMem allocation (`vmm`, exported as POSIX fd) or else
        the tensor's cudaMalloc allocation through a legacy IPC handle."""
        from pdunit.kernels import cudadrv

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

    def unregister(self, region_id: str, timeout_s: float | None = None) -> None:
        self.call("Unregister", pb.UnregisterRequest(region_id=region_id), timeout_s=timeout_s)

    def grant(self, region_id: str, request_id: int, capability: bytes, dst_slots: np.ndarray,
              deadline_unix_ms: int, any_request: bool = False, timeout_s: float | None = None) -> None:
        """Allow writes of `request_id` (every request with `any_request`) presenting
        `capability` into `dst_slots` of our region `region_id`."""
        self.call("Grant", pb.GrantRequest(
            region_id=region_id, request_id=request_id, capability=capability,
            dst_slots=pack(dst_slots, "i8"),
            deadline_unix_ms=deadline_unix_ms, any_request=any_request), timeout_s=timeout_s)

    def revoke(self, region_id: str, request_id: int, timeout_s: float | None = None) -> None:
        self.call("Revoke", pb.RevokeRequest(region_id=region_id, request_id=request_id), timeout_s=timeout_s)

    def copy(self, request_id: int, src_region: str, src_slots: np.ndarray, dst_region: str,
             dst_slots: np.ndarray, deadline_unix_ms: int, method: pb.CopyMethod = pb.METHOD_AUTO,
             verify: bool = False, timeout_s: float | None = None, capability: bytes = b"") -> pb.CopyReply:
        """One copy job. `dst_region` "" names the region whose owner granted `capability`."""
        req = pb.CopyRequest(
            request_id=request_id, src_region=src_region, dst_region=dst_region,
            src_slots=pack(src_slots, "i8"),
            dst_slots=pack(dst_slots, "i8"),
            deadline_unix_ms=deadline_unix_ms, method=method, verify=verify, capability=capability)
        if not self.copy_lane:
            req.client_send_ns = time.monotonic_ns()  # the proxy reports the way in as stage "recv"
            return self.call("Copy", req, timeout_s=timeout_s)  # type: ignore[return-value]
        return self._lane_copy(req, timeout_s or self.timeout_s)

    # ------------------------------------------------------------ copy lane
    def _lane_sock(self) -> socket.socket:
        sock: socket.socket | None = getattr(self._lane, "sock", None)
        if sock is not None and getattr(self._lane, "token", "") != self.token:
            self._lane_drop()  # connected to the proxy of an earlier session (it restarted)
            sock = None
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
            self._lane.sock, self._lane.token = sock, self.token
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
            req.session = self.token
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
            request_ids=pack(request_ids, "u8"), cancel=cancel, wait_ms=wait_ms),
            timeout_s=self.timeout_s + wait_ms / 1000)
        running = view(reply.running, "u8").tolist()  # type: ignore[attr-defined]
        return bool(reply.quiesced), [int(x) for x in running]  # type: ignore[attr-defined]

    def in_flight(self) -> list[int]:
        reply = self.call("InFlight", pb.Empty())
        return [int(x) for x in view(reply.request_ids, "u8")]  # type: ignore[attr-defined]

    def info(self, timeout_s: float | None = None) -> pb.InfoReply:
        return self.call("Info", pb.Empty(), timeout_s=timeout_s)  # type: ignore[return-value]

    def close(self) -> None:
        with self._lane_lock:
            socks, self._lane_socks = self._lane_socks, []
        for sock in socks:
            sock.close()
        self.channel.close()


def session_lost(err: TransferError) -> bool:
    """The proxy does not know our session: it restarted (a new instance)."""
    return getattr(err, "code", "") == "UNAUTHENTICATED"


class SessionKeeper:
    """Keeps one process registered with the proxy across its restarts.

    A restarted proxy has a new instance id and knows none of our sessions, regions or
    grants. `heal()` (in its own thread every KEEPER_INTERVAL_S, and at once after
    `lost()`: a call met an unknown session) asks Info; when the instance is not the one we
    registered with, it handshakes again and calls `register` (the owner registers
    everything again); when it is, it calls `resync` (the owner sends what a stalled
    proxy did not take). `unready` is "" when registered with the running proxy, else
    why not (the process's InfoReply.unready). Never decides anything about writes."""

    def __init__(self, client: ProxyClient, register: Callable[[], None], owner: str,
                 resync: Callable[[], None] | None = None, interval_s: float = KEEPER_INTERVAL_S) -> None:
        self.client = client
        self.owner = owner
        self.interval_s = interval_s
        self._register = register
        self._resync = resync
        self._lock = threading.Lock()
        self._registered_instance = client.proxy_instance
        self.unready = ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"proxy-keeper-{owner}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def lost(self) -> None:
        """A call met an unknown session (the proxy restarted): unready now, and the
        keeper's thread registers again at once (never the caller's thread: D's RESERVE
        and P's ABORT run on their gRPC loops)."""
        self.unready = f"nvlink-proxy restarted (our session is unknown there): {self.owner} is registering again"
        self._wake.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            # Sooner while unready: what a stalled proxy did not take is sent once it answers.
            self._wake.wait(min(self.interval_s, 0.25) if self.unready else self.interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.heal()

    def heal(self) -> bool:
        """True when we are registered with the proxy that runs now."""
        with self._lock:
            try:
                info = self.client.info(timeout_s=max(0.5, self.interval_s))
                if info.instance_id == self._registered_instance:
                    if self._resync is not None:
                        self._resync()
                    self.unready = ""
                    return True
                why = f"instance {self._registered_instance} -> {info.instance_id}"
            except TransferError as e:
                if not session_lost(e):
                    self.unready = (f"nvlink-proxy at {self.client.socket_path} does not answer "
                                    f"({getattr(e, 'code', 'error')}): {self.owner} cannot transfer until it does")
                    return False
                why = "our session is unknown there"
            self.unready = f"nvlink-proxy restarted ({why}): {self.owner} is registering again"
            try:
                self.client.handshake()
                self._register()
            except TransferError as e:
                self.unready = f"nvlink-proxy restarted; {self.owner} failed to register again: {e}"
                log.warning("proxy re-registration failed", extra={"owner": self.owner, "error": str(e)})
                return False
            self._registered_instance = self.client.proxy_instance
            self.unready = ""
            log.info("registered again with a restarted proxy", extra={
                "owner": self.owner, "proxy_instance": self.client.proxy_instance,
                "session_id": self.client.session_id})
            return True


def _is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class _LiveGrant:
    capability: bytes
    dst_slots: np.ndarray
    deadline_unix_ms: int


class ProxyReceiver(KVReceiver):
    """D's side: allocates the pool (host shm, or GPU memory) and registers it, plus a
    probe region of PROBE_SLOTS slots for verified test transfers. Every grant of a
    reservation is told to the proxy (and told again after a proxy restart). The probe
    region has a standing grant whose capability travels in its descriptor, so `auto` can
    run a verified test transfer without touching pool slots that may belong to live
    requests."""

    mode = "proxy"
    # A stalled proxy must not hold D's RESERVE (on D's gRPC loop) longer; a Grant takes
    # well under a millisecond when the proxy runs.
    GRANT_TIMEOUT_S = 0.2

    def __init__(self, geometry: PoolGeometry, device: str, socket_path: str = DEFAULT_SOCKET,
                 storage: torch.Tensor | None = None, vmm: object | None = None,
                 shm_pool: HostReceiver | None = None) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self.socket_path = socket_path
        self.client = ProxyClient(socket_path)
        self._owned: list[HostReceiver] = []
        self._vmm = vmm
        self._shm_names: tuple[str, str] = ("", "")
        self._probe_geo = _with_slots(geometry, PROBE_SLOTS)
        # Writes into the probe region hold probe rows only: one standing grant for
        # every request id, its capability in the descriptor (P's Hello reply).
        self.probe_capability = secrets.token_bytes(CAPABILITY_BYTES)
        # The grants the proxy must hold, and those a stalled proxy did not take yet
        # (grants to send, revokes to send): the keeper sends them when it answers again.
        self._live: dict[int, _LiveGrant] = {}
        self._unsent: set[int] = set()
        self._unrevoked: set[int] = set()
        # Held across each grant/revoke RPC: a revoke is never overtaken by a late grant.
        self._sync = threading.RLock()
        if _is_cuda(self.device):
            self._storage = storage if storage is not None else torch.empty(
                geometry.shape(), dtype=geometry.dtype, device=self.device)
            self.probe_storage = torch.zeros(self._probe_geo.shape(), dtype=geometry.dtype, device=self.device)
        else:
            pool = shm_pool if shm_pool is not None else HostReceiver(geometry)
            probe = HostReceiver(self._probe_geo)
            self._owned = [probe] if shm_pool is not None else [pool, probe]
            self._storage, self.probe_storage = pool.storage, probe.storage
            self._shm_names = (pool.name, probe.name)
        self.region = self.probe_region = ""
        self._register_regions()
        self.keeper = SessionKeeper(self.client, self._register_again, "decode", resync=self._resync)
        self.keeper.start()

    def _register_regions(self) -> None:
        if _is_cuda(self.device):
            self.region = self.client.register_cuda("d-pool", self._storage, self.geometry, vmm=self._vmm)
            self.probe_region = self.client.register_cuda("d-probe", self.probe_storage, self._probe_geo)
        else:
            self.region = self.client.register_host("d-pool", self._shm_names[0], self.geometry)
            self.probe_region = self.client.register_host("d-probe", self._shm_names[1], self._probe_geo)
        self.client.grant(self.probe_region, 0, self.probe_capability, np.arange(PROBE_SLOTS), 0,
                          any_request=True)

    def _register_again(self) -> None:
        """A restarted proxy: the regions under new ids, and every live grant again."""
        with self._sync:
            self._register_regions()
            now_ms = time.time() * 1000
            self._live = {rid: g for rid, g in self._live.items()
                          if not g.deadline_unix_ms or g.deadline_unix_ms > now_ms}
            self._unsent.clear()
            self._unrevoked.clear()  # the new proxy never had them
            for rid, g in self._live.items():
                self.client.grant(self.region, rid, g.capability, g.dst_slots, g.deadline_unix_ms)

    def _resync(self) -> None:
        """The same proxy answers again after a stall: send the revokes and grants it did
        not take (a revoke that never arrived would leave a grant alive there)."""
        with self._sync:
            for rid in list(self._unrevoked):
                self.client.revoke(self.region, rid, timeout_s=self.GRANT_TIMEOUT_S)
                self._unrevoked.discard(rid)
            for rid in list(self._unsent):
                g = self._live.get(rid)
                if g is not None:
                    self.client.grant(self.region, rid, g.capability, g.dst_slots, g.deadline_unix_ms,
                                      timeout_s=self.GRANT_TIMEOUT_S)
                self._unsent.discard(rid)

    @property
    def unready(self) -> str:
        """"" when registered with the running proxy; else why D cannot take writes."""
        return self.keeper.unready

    @property
    def storage(self) -> torch.Tensor:
        return self._storage

    def grant(self, request_id: int, dst_slots: np.ndarray, deadline_unix_ms: int) -> bytes:
        capability = super().grant(request_id, dst_slots, deadline_unix_ms)
        self.publish_grant(request_id, capability, dst_slots, deadline_unix_ms)
        return capability

    def publish_grant(self, request_id: int, capability: bytes, dst_slots: np.ndarray,
                      deadline_unix_ms: int) -> None:
        """Tell the proxy a reservation's capability (made by `grant`, or by a receiver
        that wraps this one). A proxy that does not take it now gets it when the keeper
        hears from it again; P's write is refused meanwhile, never misapplied."""
        slots = np.array(dst_slots, dtype=np.int64).reshape(-1)
        with self._sync:
            self._live[request_id] = _LiveGrant(bytes(capability), slots, int(deadline_unix_ms))
            self._unrevoked.discard(request_id)
            self._unsent.add(request_id)
            if self.keeper.unready:
                return  # the proxy is away: the keeper sends it once the proxy is back
            err = self._send("grant", request_id, lambda: self.client.grant(
                self.region, request_id, capability, slots, deadline_unix_ms, timeout_s=self.GRANT_TIMEOUT_S))
            if err is None:
                self._unsent.discard(request_id)
        if err is not None and session_lost(err):
            self.keeper.lost()  # registers again and sends every live grant, this one too

    def revoke(self, request_id: int) -> None:
        super().revoke(request_id)
        with self._sync:
            if self._live.pop(request_id, None) is None:
                return
            self._unsent.discard(request_id)
            self._unrevoked.add(request_id)
            if self.keeper.unready:
                return  # the keeper sends it once the proxy answers again
            err = self._send("revoke", request_id, lambda: self.client.revoke(
                self.region, request_id, timeout_s=self.GRANT_TIMEOUT_S))
            if err is None:
                self._unrevoked.discard(request_id)
        if err is not None and session_lost(err):
            self.keeper.lost()  # a restarted proxy holds none of our grants

    def _send(self, what: str, request_id: int, call: Callable[[], None]) -> TransferError | None:
        try:
            call()
            return None
        except TransferError as e:
            log.warning("proxy did not take a %s", what, extra={"request_id": request_id, "error": str(e)})
            if not session_lost(e):  # stalled: later calls skip the wait until the keeper hears it
                self.keeper.unready = f"nvlink-proxy did not take a {what} ({getattr(e, 'code', 'error')})"
            return e

    def descriptors(self) -> list[Descriptor]:
        return [Descriptor("proxy", {
            "socket": self.socket_path, "region": self.region, "probe_region": self.probe_region,
            "probe_slots": str(PROBE_SLOTS), "probe_capability": self.probe_capability.hex(),
            "proxy_instance": self.client.proxy_instance, "device": str(self.device)})]

    def close(self) -> None:
        self.keeper.stop()
        for rid in (self.region, self.probe_region):
            try:
                self.client.unregister(rid)
            except TransferError:
                pass  # the proxy is gone: nothing is mapped there any more
        self.client.close()
        for r in self._owned:
            r.close()


@dataclass
class _Staging:
    """A CPU writer thread's staging segment and its region on the proxy session
    `generation` (a restarted proxy needs it registered again)."""

    segment: HostReceiver
    region: str
    generation: int


class ProxySender(KVSender):
    """P's side. Copy jobs travel over the proxy's copy lane (a unix stream socket,
    SO_PEERCRED-checked, protobuf frames) rather than the Copy RPC: same messages and
    checks, about a tenth of the per-call cost. Every write records where its time went
    (`last_stages`). A write names D's region by its capability alone, so P need not learn
    D's new region id when the proxy restarts.

    Quiesce proof: a request is quiesced when P has no Copy of it running AND the proxy
    confirms, after marking the id cancelled, that no job of it runs there (a Copy that
    timed out on P's side may still run in the proxy)."""

    mode = "proxy"

    def __init__(self, descriptor: Descriptor, geometry: PoolGeometry, device: str,
                 socket_path: str = "", method: pb.CopyMethod = pb.METHOD_AUTO, copy_lane: bool = True) -> None:
        if descriptor.mode != "proxy":
            raise TransferError(f"ProxySender needs a 'proxy' descriptor, got {descriptor.mode!r}")
        for key in ("region", "probe_region", "probe_capability"):
            if key not in descriptor.params:
                raise TransferError(f"proxy descriptor lacks {key!r}: D runs an older pdunit; upgrade D")
        self.geometry = geometry
        self.device = torch.device(device)
        self.method = method
        self.client = ProxyClient(socket_path or descriptor.params.get("socket", DEFAULT_SOCKET),
                                  copy_lane=copy_lane)
        self.probe_region = descriptor.params["probe_region"]
        self.probe_capability = bytes.fromhex(descriptor.params["probe_capability"])
        self.probe_slots = int(descriptor.params.get("probe_slots", PROBE_SLOTS))
        self._lock = threading.Lock()  # source registration and staging segments
        self._gate = WriteGate()
        self._sources: dict[tuple[int, int], str] = {}
        self._generation = 0  # bumped when the proxy restarted: every region registers again
        # CPU sources: a staging segment per writing thread (P writes from several),
        # every one listed for close().
        self._staging = threading.local()
        self._stagings: list[_Staging] = []
        self.last_reply: pb.CopyReply | None = None
        # Where the last write's time went: "prepare" (this side, before the RPC), the
        # proxy's stages (recv .. reply, see sidecars/nvlink_proxy/stages.py), "return"
        # (reply built -> received here) and "total" (the whole write).
        self.last_stages: dict[str, float] = {}
        self.keeper = SessionKeeper(self.client, self._forget_regions, "prefill")
        self.keeper.start()

    @property
    def unready(self) -> str:
        """"" when registered with the running proxy; else why P cannot write now."""
        return self.keeper.unready

    def _forget_regions(self) -> None:
        """A restarted proxy: our regions are gone there; each registers again when next
        used (GPU sources in source_region, CPU staging per thread in _host_stage)."""
        with self._lock:
            self._sources.clear()
            self._generation += 1

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

    def _host_stage(self, src: torch.Tensor, src_slots: np.ndarray, timeout_s: float) -> tuple[str, np.ndarray]:
        """CPU: the proxy can only read shared memory, so gather the rows into a staging
        segment this sender owns; the job then copies staging[0..n) -> dst. Registering
        a new segment waits at most `timeout_s` (the write's deadline)."""
        n = int(src_slots.size)
        mine: _Staging | None = getattr(self._staging, "segment", None)
        if mine is None or mine.segment.geometry.n_slots < n or mine.generation != self._generation:
            # Forget the old one first: whatever fails below, this thread never uses it again.
            self._staging.segment = None
            if mine is not None:
                self._retire(mine)
            mine = self._new_staging(max(n, 64), timeout_s)
            self._staging.segment = mine
        idx = torch.as_tensor(src_slots, dtype=torch.int64)
        mine.segment.storage[:, :, :n].copy_(src.index_select(2, idx))
        return mine.region, np.arange(n, dtype=np.int64)

    def _new_staging(self, n_slots: int, timeout_s: float) -> _Staging:
        generation = self._generation
        seg = HostReceiver(_with_slots(self.geometry, n_slots))
        try:
            region = self.client.register_host("p-staging", seg.name, seg.geometry, timeout_s=timeout_s)
            staging = _Staging(seg, region, generation)
        except BaseException:
            seg.close()
            raise
        with self._lock:
            self._stagings.append(staging)
        return staging

    def _retire(self, staging: _Staging) -> None:
        """Best effort: a stalled or restarted proxy must not fail the next write."""
        with self._lock:
            if staging in self._stagings:
                self._stagings.remove(staging)
            current = staging.generation == self._generation
        if current:
            try:
                self.client.unregister(staging.region, timeout_s=1.0)
            except TransferError as e:
                log.info("staging region not unregistered", extra={"region_id": staging.region, "error": str(e)})
        staging.segment.close()

    # ------------------------------------------------------------ writes
    def write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray,
              dst_slots: np.ndarray, deadline_unix_ms: int, *, capability: bytes) -> None:
        # D's pool region is named by the capability's grant (it changes when the proxy restarts).
        self._write(request_id, src, src_slots, dst_slots, deadline_unix_ms, "", capability, False)

    def _write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray, dst_slots: np.ndarray,
               deadline_unix_ms: int, dst_region: str, capability: bytes, verify: bool) -> pb.CopyReply:
        t0 = time.perf_counter()
        with self._gate.writing(request_id, deadline_unix_ms):
            try:
                return self._copy(t0, request_id, src, src_slots, dst_slots, deadline_unix_ms,
                                  dst_region, capability, verify)
            except TransferError as e:
                if session_lost(e):
                    self.keeper.lost()  # the proxy restarted: register again for the next write
                raise

    def _copy(self, t0: float, request_id: int, src: torch.Tensor, src_slots: np.ndarray,
              dst_slots: np.ndarray, deadline_unix_ms: int, dst_region: str, capability: bytes,
              verify: bool) -> pb.CopyReply:
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
            src_region, s_eff = self._host_stage(src, s, max(0.5, deadline_unix_ms / 1000.0 - time.time()))
        remaining_s = max(0.05, deadline_unix_ms / 1000.0 - time.time())
        t1 = time.perf_counter()
        reply = self.client.copy(request_id, src_region, s_eff, dst_region, d, deadline_unix_ms,
                                 method=self.method, verify=verify, timeout_s=remaining_s + 1.0,
                                 capability=capability)
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
                            self.probe_region, self.probe_capability, True)
        return int(reply.src_checksum), int(reply.dst_checksum)

    def quiesce(self, request_id: int) -> bool:
        if not self._gate.quiesce(request_id):
            return False  # a write of ours is still between P and the proxy
        try:
            quiesced, _ = self.client.quiesce([request_id], cancel=True)
        except TransferError as e:
            if session_lost(e):
                self.keeper.lost()  # asked again (D re-sends ABORT), the new proxy answers
            return False  # a proxy we cannot reach, or one that restarted under us, proves nothing
        return quiesced

    def in_flight(self) -> list[int]:
        return self._gate.in_flight()

    def close(self) -> None:
        self.keeper.stop()
        with self._lock:
            stagings, self._stagings = self._stagings, []
        for region in list(self._sources.values()) + [st.region for st in stagings]:
            try:
                self.client.unregister(region)
            except TransferError:
                pass
        for st in stagings:
            st.segment.close()
        self.client.close()
