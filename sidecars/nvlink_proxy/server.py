"""The nvlink-proxy gRPC service: registration, write grants, copy jobs, quiesce, drain check.

Owns the request-level job bookkeeping (which request ids have a job running, which are
cancelled, per session) and the translation of every failure into a gRPC status whose
message names the field and the fix. A peer authenticates by its SO_PEERCRED on the auth
socket (`AuthListener`); a session sees and uses only the regions and jobs it made
(`ProxyService`, PROTOCOL.md 3.1), and copy jobs also arrive over the copy lane
(`CopyLane`). Must never copy a row of a job that regions.RegionTable.job() and
GrantTable.check() did not both accept.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from concurrent import futures
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram

from pdunit.engine.packing import pack, view
from pdunit.engine.proto import proxy_pb2 as pb
from pdunit.engine.proto import proxy_pb2_grpc as pb_grpc
from pdunit.engine.proto.lane_framing import MAX_FRAME, recv_frame, send_frame
from pdunit.engine.security import security_event
from pdunit.sidecars.nvlink_proxy.regions import (
    AllowList,
    GrantTable,
    JobRejected,
    PeerCreds,
    Refused,
    Region,
    RegionTable,
    Session,
    Sessions,
    peer_creds,
)
from pdunit.sidecars.nvlink_proxy.stages import StageClock

log = logging.getLogger("pdunit.proxy")

SESSION_KEY = "x-pdunit-session"

JOBS = Counter("pdunit_proxy_jobs_total", "Copy jobs by method and outcome", ["method", "outcome"])
BYTES = Counter("pdunit_proxy_copied_bytes_total", "Bytes copied by completed jobs", ["method"])
JOB_SECONDS = Histogram(
    "pdunit_proxy_job_seconds", "Device time of a copy job (launch to completion)", ["method"],
    buckets=(1e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.0),
)
STAGE_SECONDS = Histogram(
    "pdunit_proxy_job_stage_seconds",
    "Where a completed copy job's time went, per stage (stages.py: recv, validate, admit, map, "
    "upload, launch, sync, copy, checksum, reply)", ["stage"],
    buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2.5e-3, 5e-3, 1e-2, 0.1, 1.0),
)
ERRORS = Counter("pdunit_proxy_errors_total", "Refused or failed requests by kind", ["kind"])
REGIONS = Gauge("pdunit_proxy_regions", "Registered regions")
GRANTS = Gauge("pdunit_proxy_grants", "Live write grants")
RUNNING = Gauge("pdunit_proxy_jobs_running", "Copy jobs running now")
LANE_CONNECTIONS = Gauge("pdunit_proxy_copy_lane_connections", "Open copy-lane connections")
FALLBACKS = Counter("pdunit_proxy_staged_fallback_total",
                    "Jobs that ran staged because the single kernel could not run")
AUTH = Counter("pdunit_proxy_auth_total", "Auth handshakes by outcome", ["outcome"])


class JobTracker:
    """Running-job counts and cancelled request ids, per session, under one lock: a
    session's Quiesce sees and cancels only its own jobs. Each session keeps at most
    `max_cancelled` cancelled ids (its oldest go first), so no session can grow the
    table without bound."""

    def __init__(self, cancel_retention_s: float, max_cancelled: int = 100_000) -> None:
        self._cond = threading.Condition()
        self._running: dict[tuple[str, int], int] = {}
        self._cancelled: dict[str, OrderedDict[int, float]] = {}
        self.retention_s = cancel_retention_s
        self.max_cancelled = max_cancelled

    def _prune(self, ids: OrderedDict[int, float], now: float) -> None:
        while ids:
            rid, at = next(iter(ids.items()))
            if now - at < self.retention_s and len(ids) <= self.max_cancelled:
                break
            ids.popitem(last=False)

    def start(self, session_id: str, request_id: int) -> None:
        with self._cond:
            cancelled = self._cancelled.get(session_id)
            if cancelled is not None:
                self._prune(cancelled, time.monotonic())
                if request_id in cancelled:
                    raise JobRejected("FAILED_PRECONDITION",
                                      f"request {request_id} was cancelled (quiesced): job refused")
            key = (session_id, request_id)
            self._running[key] = self._running.get(key, 0) + 1
            RUNNING.inc()

    def finish(self, session_id: str, request_id: int) -> None:
        with self._cond:
            key = (session_id, request_id)
            left = self._running[key] - 1
            if left:
                self._running[key] = left
            else:
                del self._running[key]
            RUNNING.dec()
            self._cond.notify_all()

    def quiesce(self, session_id: str, ids: list[int], cancel: bool, wait_s: float) -> list[int]:
        """Cancel (optionally) the session's later jobs of `ids`; return those of `ids`
        that still have a job of this session running."""
        deadline = time.monotonic() + max(0.0, wait_s)
        with self._cond:
            if cancel:
                now = time.monotonic()
                cancelled = self._cancelled.setdefault(session_id, OrderedDict())
                for rid in ids:
                    cancelled[rid] = now
                    cancelled.move_to_end(rid)
                self._prune(cancelled, now)
            while True:
                running = [rid for rid in ids if (session_id, rid) in self._running]
                left = deadline - time.monotonic()
                if not running or left <= 0:
                    return running
                self._cond.wait(left)

    def running(self) -> list[int]:
        with self._cond:
            return sorted({rid for _, rid in self._running})

    def has_running(self, session_id: str) -> bool:
        with self._cond:
            return any(sid == session_id for sid, _ in self._running)


def _ids(raw: bytes) -> list[int]:
    if len(raw) % 8:
        raise JobRejected("INVALID_ARGUMENT", f"request_ids has {len(raw)} bytes, not packed uint64")
    return [int(x) for x in view(raw, "u8")]


def _pack(ids: list[int]) -> bytes:
    return pack(ids, "u8")


class CopyError(Exception):
    """A copy job that did not run (or failed): `code` is the gRPC status name, `kind`
    the pdunit_proxy_errors_total label."""

    def __init__(self, code: str, message: str, kind: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.kind = kind


def start_clock(request: pb.CopyRequest) -> StageClock:
    """A job's stage clock, started now; the way in ("recv") comes from the caller's
    stamp. CLOCK_MONOTONIC is one clock for every process of the host (PID namespaces
    do not change it), so the difference is a real transit time."""
    clock = StageClock()
    if request.client_send_ns:
        clock.seconds["recv"] = max(0.0, (time.monotonic_ns() - request.client_send_ns) / 1e9)
    return clock


class ProxyService(pb_grpc.NvlinkProxyServicer):
    """Authorisation (PROTOCOL.md 3.1): a session sees (Info) and uses only the regions it
    registered; a copy reads from the caller's own region and writes only the rows that a
    live grant of the destination's owner allows, for the capability the job presents.
    Quiesce and its cancellations reach the caller's own jobs only, so no session can stop
    another's requests. Every refusal of that kind is a security event. Each job's stages
    are timed (stages.py) into `pdunit_proxy_job_stage_seconds{stage}` and returned in
    CopyReply.stage_seconds."""

    def __init__(self, backends: dict[str, Any], allow: AllowList, cancel_retention_s: float,
                 max_jobs: int = 4) -> None:
        self.instance_id = uuid.uuid4().hex
        self.backends = backends
        self.allow = allow
        self.regions = RegionTable()
        self.grants = GrantTable()
        self.sessions = Sessions()
        self.jobs = JobTracker(cancel_retention_s)
        self._pruned_at = 0.0
        # Concurrent copy jobs over both entry points (gRPC Copy and the copy lane).
        self.job_slots = threading.BoundedSemaphore(max_jobs)

    # ------------------------------------------------------------ helpers
    def session(self, token: str) -> Session:
        """The session of `token`; JobRejected UNAUTHENTICATED when this instance did not
        issue it (none sent, forged, or issued by the proxy before a restart)."""
        session = self.sessions.lookup(token) if token else None
        if session is None:
            raise JobRejected("UNAUTHENTICATED",
                              f"no valid session for proxy instance {self.instance_id}: connect to the "
                              "auth socket (SO_PEERCRED allow-list), send its token in metadata "
                              "x-pdunit-session, and register again (the proxy may have restarted)")
        return session

    def in_use(self, session: Session) -> bool:
        """A session that still owns regions (or runs a job) is never forgotten."""
        return bool(self.regions.of_session(session.session_id)) or self.jobs.has_running(session.session_id)

    def _peer(self, context: grpc.ServicerContext) -> Session:
        try:
            return self.session(dict(context.invocation_metadata()).get(SESSION_KEY, ""))
        except JobRejected as e:
            ERRORS.labels("unauthenticated").inc()
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
            raise  # unreachable: abort raises

    @staticmethod
    def refused(e: Refused, session: Session, **fields: Any) -> None:
        """A refusal only an attacker or a bug causes: logged and counted as a security
        event (the caller counts it in pdunit_proxy_errors_total too)."""
        security_event(e.what, reason=str(e), session_id=session.session_id,
                       peer_pid=session.creds.pid, peer_uid=session.creds.uid, **fields)

    def _backend(self, region: Region) -> Any:
        key = "cuda" if region.is_cuda else "host"
        backend = self.backends.get(key)
        if backend is None:
            raise JobRejected("FAILED_PRECONDITION",
                              f"region {region.name!r} needs the {key} backend, which this proxy "
                              f"has not started (backends: {sorted(self.backends)})")
        return backend

    def _fail(self, context: grpc.ServicerContext, exc: JobRejected, kind: str,
              session: Session | None = None) -> None:
        if isinstance(exc, Refused) and session is not None:
            self.refused(exc, session)
        ERRORS.labels("permission" if isinstance(exc, Refused) else kind).inc()
        context.abort(getattr(grpc.StatusCode, exc.code), str(exc))

    # ------------------------------------------------------------ RPCs
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        session = self._peer(context)
        try:
            region = self.regions.add(request, session)
            try:
                self._backend(region).prepare(region)
            except Exception:
                self.regions.remove(region.region_id, session)
                raise
        except JobRejected as e:
            self._fail(context, e, "register")
        REGIONS.set(len(self.regions.all()))
        log.info("region registered", extra={
            "region_id": region.region_id, "region_name": region.name,
            "kind": pb.RegionKind.Name(region.kind), "gpu_uuid": region.gpu_uuid,
            "layout": list(region.layout.shape()), "dtype": region.layout.dtype,
            "session_id": session.session_id, "peer_pid": session.creds.pid, "peer_uid": session.creds.uid})
        return pb.RegisterReply(region_id=region.region_id)

    def Unregister(self, request: pb.UnregisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        session = self._peer(context)
        try:
            region = self.regions.remove(request.region_id, session)
        except JobRejected as e:
            self._fail(context, e, "unregister", session)
        self.grants.drop_region(region.region_id)
        self._backend(region).release(region)
        REGIONS.set(len(self.regions.all()))
        GRANTS.set(len(self.grants))
        log.info("region unregistered", extra={"region_id": region.region_id, "region_name": region.name})
        return pb.Empty()

    def Grant(self, request: pb.GrantRequest, context: grpc.ServicerContext) -> pb.Empty:
        session = self._peer(context)
        try:
            region = self.regions.owned(request.region_id, session, "grant:")
            self.grants.grant(region, None if request.any_request else int(request.request_id),
                              request.capability, request.dst_slots, request.deadline_unix_ms)
        except JobRejected as e:
            self._fail(context, e, "grant", session)
        now = time.monotonic()
        if now - self._pruned_at > 1.0:  # grants whose deadline passed (their Revoke got lost)
            self._pruned_at = now
            self.grants.prune(time.time() * 1000)
        GRANTS.set(len(self.grants))
        return pb.Empty()

    def Revoke(self, request: pb.RevokeRequest, context: grpc.ServicerContext) -> pb.Empty:
        session = self._peer(context)
        try:
            region = self.regions.owned(request.region_id, session, "revoke:")
        except JobRejected as e:
            self._fail(context, e, "revoke", session)
        self.grants.revoke(region.region_id, int(request.request_id))
        GRANTS.set(len(self.grants))
        return pb.Empty()

    def run_copy(self, request: pb.CopyRequest, session: Session, clock: StageClock) -> pb.CopyReply:
        """Authorise, validate, admit and run one copy job: the body of both the gRPC Copy
        and the copy lane, so both paths make the same checks. The source must be the
        caller's region; the destination rows need a live grant for the presented
        capability. Raises CopyError (counted, with the gRPC status name; a security event
        for a refused write) on any failure; a refused job copies nothing."""
        try:
            rid = int(request.request_id)
            dst_id = request.dst_region or self.grants.region_for(rid, request.capability)
            job = self.regions.job(request, session, dst_id)
            self.grants.check(job.dst, rid, request.capability, job.dst_slots)
            if request.deadline_unix_ms and time.time() * 1000 > request.deadline_unix_ms:
                raise JobRejected("DEADLINE_EXCEEDED",
                                  f"request {job.request_id}: deadline passed "
                                  f"{time.time() * 1000 - request.deadline_unix_ms:.0f} ms ago; nothing copied")
            backend = self._backend(job.src)
        except Refused as e:
            self.refused(e, session, request_id=int(request.request_id), src_region=request.src_region,
                         dst_region=request.dst_region)
            raise CopyError(e.code, str(e), "permission") from None
        except JobRejected as e:
            raise CopyError(e.code, str(e), e.code.lower()) from None
        clock.mark("validate")
        with self.job_slots:
            try:
                self.jobs.start(session.session_id, job.request_id)
            except JobRejected as e:
                raise CopyError(e.code, str(e), "cancelled") from None
            clock.mark("admit")
            try:
                fallbacks_before = getattr(backend, "fallbacks", 0)
                method, seconds = backend.copy(job, request.method, clock)
                if getattr(backend, "fallbacks", 0) != fallbacks_before:
                    FALLBACKS.inc()
                reply = pb.CopyReply(method=method, bytes=job.nbytes, device_seconds=seconds)
                if request.verify:
                    reply.src_checksum = backend.checksum(job.src, job.src_slots)
                    reply.dst_checksum = backend.checksum(job.dst, job.dst_slots)
                    clock.mark("checksum")
            except JobRejected as e:
                JOBS.labels("none", "rejected").inc()
                raise CopyError(e.code, str(e), e.code.lower()) from None
            except Exception as e:  # a driver error: report it verbatim, the job failed
                JOBS.labels("none", "failed").inc()
                log.error("copy job failed", extra={"request_id": job.request_id, "error": str(e),
                                                    "src": job.src.name, "dst": job.dst.name})
                raise CopyError("INTERNAL", f"request {job.request_id}: copy failed: {e}",
                                "copy_failed") from None
            finally:
                self.jobs.finish(session.session_id, job.request_id)
        JOBS.labels(method, "ok").inc()
        BYTES.labels(method).inc(job.nbytes)
        JOB_SECONDS.labels(method).observe(seconds)
        clock.mark("reply")
        for stage, sec in clock.seconds.items():
            STAGE_SECONDS.labels(stage).observe(sec)
        reply.stage_seconds.update(clock.seconds)
        reply.proxy_done_ns = time.monotonic_ns()
        return reply

    def Copy(self, request: pb.CopyRequest, context: grpc.ServicerContext) -> pb.CopyReply:
        clock = start_clock(request)
        session = self._peer(context)
        try:
            return self.run_copy(request, session, clock)
        except CopyError as e:
            ERRORS.labels(e.kind).inc()
            context.abort(getattr(grpc.StatusCode, e.code), e.message)
            raise  # unreachable: abort raises

    def Quiesce(self, request: pb.QuiesceRequest, context: grpc.ServicerContext) -> pb.QuiesceReply:
        """PROTOCOL.md 3.5: `Quiesce(ids, cancel=true)` marks the ids cancelled BEFORE
        looking at running jobs, under one lock with job admission, so after a reply of
        `quiesced=true` no job of those ids runs or can start. A job already past
        admission runs to completion (a launched kernel cannot be recalled); the reply
        then says which ids still run, and the caller asks again."""
        session = self._peer(context)
        try:
            ids = _ids(request.request_ids)
        except JobRejected as e:
            self._fail(context, e, "invalid_argument")
        running = self.jobs.quiesce(session.session_id, ids, request.cancel, request.wait_ms / 1000.0)
        return pb.QuiesceReply(quiesced=not running, running=_pack(running))

    def InFlight(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.InFlightReply:
        # No session needed: the LB's drain check reads request ids, copies nothing and
        # changes nothing (and the socket is reachable only inside the pod).
        running = self.jobs.running()
        return pb.InFlightReply(request_ids=_pack(running), jobs_running=len(running))

    def Info(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.InfoReply:
        session = self._peer(context)
        cuda = self.backends.get("cuda")
        return pb.InfoReply(
            instance_id=self.instance_id, session_id=session.session_id,
            regions=[pb.RegionInfo(region_id=r.region_id, name=r.name, kind=r.kind,
                                   layout=r.layout.to_pb(), gpu_uuid=r.gpu_uuid, owner_pid=r.owner.pid)
                     for r in self.regions.of_session(session.session_id)],
            gpu_uuids=sorted(cuda.devices) if cuda is not None else [],
            version="1",
            copy_kernel=str(cuda.copy_config) if cuda is not None else "",
            copy_device=cuda.copy_device if cuda is not None else "",
        )

    def close(self) -> None:
        for region in self.regions.all():
            try:
                self._backend(region).release(region)
            except Exception as e:  # shutting down: report, continue with the others
                log.warning("release failed", extra={"region_id": region.region_id, "error": str(e)})


class _UnixListener:
    """A unix stream socket open to every local user (the allow-list, checked on each
    connection's SO_PEERCRED, decides who is served) and its accept thread."""

    def __init__(self, path: str, service: ProxyService, thread_name: str) -> None:
        self.path = path
        self.service = service
        if os.path.exists(path):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o666)  # the allow-list, not file modes, decides who is admitted
        self.sock.listen(64)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            creds = peer_creds(conn)
            self._handle(conn, creds, self.service.allow.check(creds))

    def _handle(self, conn: socket.socket, creds: PeerCreds, refused: str | None) -> None:
        """One accepted connection; `refused` is the allow-list's reason, or None."""
        raise NotImplementedError

    def _close_socket(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class AuthListener(_UnixListener):
    """The auth socket (`<socket>.auth`): SO_PEERCRED -> allow-list -> session token (one
    JSON line). gRPC itself cannot report a unix peer's credentials, hence this separate
    handshake. Every RPC that registers memory, grants, copies or cancels must carry the
    token in metadata `x-pdunit-session` (InFlight, the read-only drain check, needs
    none); a token of an earlier proxy instance is answered UNAUTHENTICATED, and the
    client handshakes and registers again."""

    def __init__(self, path: str, service: ProxyService) -> None:
        super().__init__(path, service, "proxy-auth")

    def _handle(self, conn: socket.socket, creds: PeerCreds, refused: str | None) -> None:
        if refused is None:
            session = self.service.sessions.issue(creds, self.service.in_use)
            answer = {"token": session.token, "session_id": session.session_id,
                      "instance_id": self.service.instance_id, "pid_seen": creds.pid}
            AUTH.labels("allowed").inc()
            log.info("peer admitted", extra={"peer_pid": creds.pid, "peer_uid": creds.uid,
                                             "session_id": session.session_id})
        else:
            answer = {"error": refused}
            AUTH.labels("denied").inc()
            ERRORS.labels("permission").inc()
            log.warning("peer refused", extra={"peer_pid": creds.pid, "peer_uid": creds.uid, "reason": refused})
        with conn:
            try:
                conn.sendall((json.dumps(answer) + "\n").encode())
            except OSError:
                pass

    def stop(self) -> None:
        self._close_socket()
        self._unlink()


class CopyLane(_UnixListener):
    """The copy lane (`<socket>.copy`, see proxy.proto): length-prefixed CopyRequest ->
    LaneReply frames over a unix stream socket. A connecting peer is checked against
    the allow-list by its SO_PEERCRED, exactly like the auth socket; a refused peer gets
    one PERMISSION_DENIED frame and is disconnected before it can send a job. Each job
    names its session (CopyRequest.session), which must be one this proxy issued to the
    same process. Each connection has its own thread; jobs share ProxyService.job_slots
    with gRPC. Each frame runs through the same `run_copy` as the Copy RPC (same
    validation, admission and metrics); the lane exists for latency: a Python gRPC unary
    call costs far more than a socket round trip (proxy.proto gives the measurement)."""

    MAX_FRAME = MAX_FRAME

    def __init__(self, path: str, service: ProxyService, max_connections: int = 64) -> None:
        super().__init__(path, service, "proxy-lane")
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}

    def _handle(self, conn: socket.socket, creds: PeerCreds, refused: str | None) -> None:
        with self._lock:
            full = len(self._conns) >= self.max_connections
        if refused is not None or full:
            ERRORS.labels("permission" if refused else "lane_full").inc()
            code = "PERMISSION_DENIED" if refused else "RESOURCE_EXHAUSTED"
            msg = refused or (f"copy lane has {self.max_connections} connections already; "
                              "close idle senders or raise the limit")
            log.warning("copy lane refused a peer", extra={"peer_pid": creds.pid, "peer_uid": creds.uid,
                                                          "reason": msg})
            try:
                send_frame(conn, pb.LaneReply(code=code, message=msg).SerializeToString())
            except OSError:
                pass
            conn.close()
            return
        t = threading.Thread(target=self._connection, args=(conn, creds), name="proxy-lane-conn", daemon=True)
        with self._lock:
            self._conns[conn] = t
            LANE_CONNECTIONS.set(len(self._conns))
        t.start()

    def _connection(self, conn: socket.socket, creds: PeerCreds) -> None:
        try:
            while not self._stop.is_set():
                raw = recv_frame(conn, self.MAX_FRAME)
                if raw is None:
                    return  # the peer closed, or stop() shut the read side
                try:
                    request = pb.CopyRequest.FromString(raw)
                except Exception as e:  # a frame that is not a CopyRequest: tell and hang up
                    ERRORS.labels("invalid_argument").inc()
                    send_frame(conn, pb.LaneReply(code="INVALID_ARGUMENT",
                                                   message=f"copy lane frame is not a CopyRequest: {e}")
                                .SerializeToString())
                    return
                clock = start_clock(request)
                try:
                    session = self._session(request, creds)
                    answer = pb.LaneReply(reply=self.service.run_copy(request, session, clock))
                except CopyError as e:
                    ERRORS.labels(e.kind).inc()
                    answer = pb.LaneReply(code=e.code, message=e.message)
                send_frame(conn, answer.SerializeToString())
        except OSError as e:
            log.info("copy lane connection ended", extra={"peer_pid": creds.pid, "error": str(e)})
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                LANE_CONNECTIONS.set(len(self._conns))
            conn.close()

    def _session(self, request: pb.CopyRequest, creds: PeerCreds) -> Session:
        """The job's session, when this connection's peer is the process it was issued to."""
        try:
            session = self.service.session(request.session)
        except JobRejected as e:
            raise CopyError(e.code, str(e), "unauthenticated") from None
        if session.creds.uid != creds.uid or (session.creds.pid and creds.pid and session.creds.pid != creds.pid):
            refusal = Refused("proxy_foreign_session",
                              f"the copy lane's peer pid {creds.pid} uid {creds.uid} presented the session of "
                              f"pid {session.creds.pid} uid {session.creds.uid}: a session is its own process's")
            self.service.refused(refusal, session, lane_peer_pid=creds.pid)
            raise CopyError(refusal.code, str(refusal), "permission")
        return session

    def stop(self, grace_s: float) -> None:
        """No new connections or jobs; a job already running finishes and is answered."""
        self._close_socket()
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RD)  # wakes a reader; a running job can still reply
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for _, t in conns:
            t.join(max(0.0, deadline - time.monotonic()))
        self._unlink()




def build_server(socket_path: str, service: ProxyService, workers: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="proxy-job"),
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    pb_grpc.add_NvlinkProxyServicer_to_server(service, server)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    server.add_insecure_port(f"unix:{socket_path}")
    return server
