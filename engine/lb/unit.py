"""The LB's view of the rest of its unit: gRPC channels to P, D (and the proxy), probes.

Owns: the channels (unix sockets; in monolith mode P and D are the same socket; a unit
may have several D's, named `decode-0`, `decode-1`, ...), the `Decode.Hello` handshake
that tells the LB n_codebooks, the periodic `Info` probe of P, every D and the proxy
(`NvlinkProxy.InFlight`, so that `/v1/load` checks its request ids too), a short cache
of those answers for `/v1/load`, and the delivery of cancels (`UnitClient.cancel`).

Never: decide HTTP status codes or touch the stream table.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from pdunit.engine.grpc_server import RECONNECT_OPTIONS
from pdunit.engine.lb.metrics import LBMetrics
from pdunit.engine.packing import view
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.proto import proxy_pb2 as proxy_pb
from pdunit.engine.proto import proxy_pb2_grpc as proxy_pbg
from pdunit.engine.unit_layout import decode_names

log = logging.getLogger("pdunit.lb.unit")

CANCEL_BACKOFF_S = (0.05, 2.0)  # first and longest pause between two tries of one cancel
# A target that answers these will answer them again: no retry.
CANCEL_PERMANENT = {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}


def channel_target(socket_path: str) -> str:
    return socket_path if socket_path.startswith("unix:") else f"unix://{socket_path}"


def request_ids_of(info: pb.InfoReply | None) -> list[int]:
    if info is None or not info.request_ids:
        return []
    return view(info.request_ids, "u8").tolist()


@dataclass
class InfoSnapshot:
    """One probe round. A missing reply has its error in `errors[target]`; a reply
    carried over from an earlier round (the target was late, not gone) has the reason in
    `late[target]` and its own time in `answered[target]`."""

    at: float  # time.monotonic() of the round
    decodes: list[pb.InfoReply | None]  # every D, --decode-socket order
    prefill: pb.InfoReply | None = None
    proxy: pb.InfoReply | None = None
    errors: dict[str, str] = field(default_factory=dict)
    answered: dict[str, float] = field(default_factory=dict)  # target -> time of its reply
    late: dict[str, str] = field(default_factory=dict)

    def reply(self, target: str, decode_names: list[str]) -> pb.InfoReply | None:
        if target in ("prefill", "proxy"):
            return getattr(self, target)
        return self.decodes[decode_names.index(target)]

    def oldest_answer(self) -> float:
        """When the oldest reply this snapshot holds was given (the round's time if none)."""
        return min(self.answered.values(), default=self.at)


class UnitClient:
    def __init__(
        self,
        prefill_socket: str,
        decode_socket: str | list[str],
        proxy_socket: str,
        metrics: LBMetrics,
        max_message_bytes: int,
        cancel_retry_s: float = 60.0,
        max_pending_cancels: int = 4096,
        late_grace_s: float = 0.0,
    ) -> None:
        """`cancel_retry_s`: how long a cancel is retried when the caller gives no
        deadline (D decodes a stream for at most its max frames; 60 s covers the
        default 630 frames at real time). `late_grace_s`: how old a target's last reply
        may be and still stand in when its probe runs past the timeout (a busy engine
        answers late; one that is gone answers UNAVAILABLE and counts at once)."""
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            *RECONNECT_OPTIONS,
        ]
        self._metrics = metrics
        self.late_grace_s = late_grace_s
        self.cancel_retry_s = cancel_retry_s
        self.max_pending_cancels = max_pending_cancels
        self.prefill_channel = grpc.aio.insecure_channel(
            channel_target(prefill_socket), options=options
        )
        sockets = decode_socket.split(",") if isinstance(decode_socket, str) else list(decode_socket)
        self.decode_names = decode_names(len(sockets))
        self.decode_channels = [
            self.prefill_channel
            if sock == prefill_socket
            else grpc.aio.insecure_channel(channel_target(sock), options=options)
            for sock in sockets
        ]
        self.prefill = pbg.PrefillStub(self.prefill_channel)
        self.decodes = [pbg.DecodeStub(c) for c in self.decode_channels]
        self.proxy_channel: grpc.aio.Channel | None = None
        self._proxy: proxy_pbg.NvlinkProxyStub | None = None
        if proxy_socket:
            self.proxy_channel = grpc.aio.insecure_channel(
                channel_target(proxy_socket), options=options
            )
            self._proxy = proxy_pbg.NvlinkProxyStub(self.proxy_channel)
        self.snapshot = InfoSnapshot(
            at=float("-inf"),
            decodes=[None] * len(self.decodes),
            errors={"prefill": "not probed yet", **dict.fromkeys(self.decode_names, "not probed yet")},
        )
        self._refresh_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()

    @property
    def has_proxy(self) -> bool:
        return self._proxy is not None

    async def hello(self, timeout: float, index: int = 0) -> pb.HelloReply:
        # No sender_instance: the LB is not a P. (D would take one only as a claim, check
        # it with P on P's socket and count it as forged.)
        return await self.decodes[index].Hello(pb.HelloRequest(), timeout=timeout)

    async def probe(self, timeout: float) -> InfoSnapshot:
        """Ask P, every D (and the proxy) for Info concurrently; never raises."""
        targets: dict[str, asyncio.Future[pb.InfoReply]] = {
            "prefill": asyncio.ensure_future(self.prefill.Info(pb.Empty(), timeout=timeout)),
        }
        for name, stub in zip(self.decode_names, self.decodes, strict=True):
            targets[name] = asyncio.ensure_future(stub.Info(pb.Empty(), timeout=timeout))
        if self._proxy is not None:
            targets["proxy"] = asyncio.ensure_future(self._proxy_in_flight(self._proxy, timeout))
        previous = self.snapshot
        snap = InfoSnapshot(at=time.monotonic(), decodes=[None] * len(self.decodes))
        for name, fut in targets.items():
            try:
                reply = await fut
                answered = time.monotonic()
            except grpc.aio.AioRpcError as exc:
                reason = f"{name} Info failed: {exc.code().name}: {exc.details()}"
                self._metrics.probe_failures.labels(target=name).inc()
                carried = self._carried(previous, name, exc.code())
                if carried is None:
                    snap.errors[name] = reason
                    continue
                reply, answered = carried
                snap.late[name] = reason
                self._metrics.probe_late.labels(target=name).inc()
            if name in ("prefill", "proxy"):
                setattr(snap, name, reply)
            else:
                snap.decodes[self.decode_names.index(name)] = reply
            snap.answered[name] = answered
        self.snapshot = snap
        return snap

    def _carried(
        self, previous: InfoSnapshot, name: str, code: grpc.StatusCode
    ) -> tuple[pb.InfoReply, float] | None:
        """The previous reply of a target that answered late (DEADLINE_EXCEEDED), if that
        reply is younger than `late_grace_s`; None otherwise (the failure counts)."""
        if code != grpc.StatusCode.DEADLINE_EXCEEDED or name in previous.errors:
            return None
        reply = previous.reply(name, self.decode_names)
        answered = previous.answered.get(name)
        if reply is None or answered is None or time.monotonic() - answered > self.late_grace_s:
            return None
        return reply, answered

    async def fresh_snapshot(self, max_age: float, timeout: float) -> InfoSnapshot:
        """The cached probe if younger than `max_age`, else a new one (concurrent callers share it)."""
        if time.monotonic() - self.snapshot.at <= max_age:
            return self.snapshot
        async with self._refresh_lock:
            if time.monotonic() - self.snapshot.at <= max_age:
                return self.snapshot
            return await self.probe(timeout)

    @staticmethod
    async def _proxy_in_flight(stub: proxy_pbg.NvlinkProxyStub, timeout: float) -> pb.InfoReply:
        """The proxy's running copy jobs, in the InfoReply shape the load document reads."""
        reply = await stub.InFlight(proxy_pb.Empty(), timeout=timeout)
        return pb.InfoReply(
            role="proxy", in_flight=int(reply.jobs_running), request_ids=reply.request_ids
        )

    # A cancel goes to P and to the D that holds the stream, or every D when that is not
    # known: each target is asked again with backoff until it answers (found or not found) or
    # the stream's deadline passes, so a stopped D still learns of it when it runs again; at
    # most `max_pending_cancels` deliveries (one per target) run at once, a cancel beyond them
    # is dropped, counted (`result="given_up"`) and logged.
    def cancel(
        self, request_id: int, timeout: float, decode: int | None = None, deadline: float | None = None
    ) -> None:
        """Cancel a request in P and in D `decode` (every D when None: the LB has not seen
        which D holds it) without waiting. Each target is tried again, with backoff,
        until it answers or `deadline` (time.monotonic(); default `cancel_retry_s` from
        now) passes; `timeout` bounds one try. Results are counted and logged."""
        targets = self._cancel_targets(decode)
        if len(self._background) >= self.max_pending_cancels:
            for target, _ in targets:
                self._metrics.cancels.labels(target=target, result="given_up").inc()
            log.error(
                "cancel dropped: too many cancels in delivery",
                extra={"request_id": f"{request_id:016x}", "pending": len(self._background),
                       "limit": self.max_pending_cancels},
            )
            return
        until = deadline if deadline is not None else time.monotonic() + self.cancel_retry_s
        req = pb.CancelRequest(request_id=request_id)
        loop = asyncio.get_running_loop()
        for target, stub in targets:
            task = loop.create_task(self._deliver_cancel(target, stub, req, timeout, until))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _cancel_targets(self, decode: int | None) -> list[tuple[str, pbg.PrefillStub | pbg.DecodeStub]]:
        targets: list[tuple[str, pbg.PrefillStub | pbg.DecodeStub]] = [("prefill", self.prefill)]
        for i, (name, stub) in enumerate(zip(self.decode_names, self.decodes, strict=True)):
            if decode is None or decode == i:
                targets.append((name, stub))
        return targets

    async def _deliver_cancel(
        self,
        target: str,
        stub: pbg.PrefillStub | pbg.DecodeStub,
        req: pb.CancelRequest,
        timeout: float,
        until: float,
    ) -> None:
        delay = CANCEL_BACKOFF_S[0]
        tries = 0
        while True:
            tries += 1
            left = until - time.monotonic()
            try:
                reply = await stub.Cancel(req, timeout=max(0.001, min(timeout, left)))
            except grpc.aio.AioRpcError as exc:
                left = until - time.monotonic()
                fields = {"request_id": f"{req.request_id:016x}", "target": target, "tries": tries,
                          "code": exc.code().name, "details": exc.details()}
                if left <= 0 or exc.code() in CANCEL_PERMANENT:
                    self._metrics.cancels.labels(target=target, result="given_up").inc()
                    log.error("cancel given up: the target never answered before the deadline"
                              if left <= 0 else "cancel given up: the target refuses it", extra=fields)
                    return
                self._metrics.cancels.labels(target=target, result="retried").inc()
                if tries == 1:
                    log.warning("cancel failed: retrying until the target answers", extra=fields)
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, CANCEL_BACKOFF_S[1])
                continue
            self._metrics.cancels.labels(
                target=target, result="found" if reply.found else "not_found"
            ).inc()
            if tries > 1:
                log.info("cancel delivered after retries", extra={
                    "request_id": f"{req.request_id:016x}", "target": target, "tries": tries,
                    "found": reply.found})
            return

    async def wait_background(self, timeout: float) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    async def close(self) -> None:
        if self._background:
            log.warning("closing with cancels still in delivery: they are dropped",
                        extra={"pending": len(self._background)})
            for task in list(self._background):
                task.cancel()
            await asyncio.wait(set(self._background), timeout=1.0)
        channels = {
            id(c): c for c in (self.prefill_channel, *self.decode_channels, self.proxy_channel) if c
        }
        for channel in channels.values():
            await channel.close()
