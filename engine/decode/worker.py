"""D: the decode engine of a unit and its gRPC service. Owns the paged KV pool and the
page-state contract of PROTOCOL.md: pages reserved for a transfer go to another request
only after proof that no write of the failed transfer can land (ABORT_ACK from P, a new
P instance id heard from P itself on P's socket, or the transport's receiver state).
A timeout is never proof, and neither is an instance id that a message to D's socket
claims. Threads: gRPC and the expiry/abort/probe loops on the asyncio loop, the decode
steps in a StepLoop (engine/step_loop.py); the pool and the batcher are thread-safe.
`--debug-port` (never set in a pod) serves the pool's ownership map on loopback for
the fault suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from pdunit.engine import metrics as m
from pdunit.engine.audio.codec_stage import NO_CODEC, CodecStage
from pdunit.engine.decode.admission import AdmissionControl
from pdunit.engine.decode.batcher import RUNNING, DecodeBatcher, StepOutput, Stream
from pdunit.engine.decode.hub import FrameHub
from pdunit.engine.decode.overlap import OverlapScheduler
from pdunit.engine.decode.step_forward import StepForward
from pdunit.engine.grpc_server import CHANNEL_OPTIONS, unix_target
from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.kv.pool import NoCapacity, PagePool, PageState, Proof
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.observability import now_ns
from pdunit.engine.packing import pack, unpack
from pdunit.engine.playback import real_time_fps
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.proto.row_rule import hello_rules
from pdunit.engine.proto.sampling import sampling_from_pb
from pdunit.engine.security import security_event
from pdunit.engine.step_loop import StepLoop, publish_step
from pdunit.engine.step_pad import StepPad
from pdunit.engine.tracing import DECODE_STAGES, SpanTable, Tracing
from pdunit.engine.transfer.base import KVReceiver, PoolGeometry

log = logging.getLogger("pdunit.decode")

# D's channel to P reconnects fast: after P restarts, D must hear the new instance id
# (proof b) as soon as the new P serves, not after gRPC's default backoff (1 s growing
# to 120 s).
P_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 50),
                     ("grpc.min_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 250)]
CLAIM_RECHECK_S = 0.1     # how often P is asked while a claimed instance id is unchecked
MAX_PENDING_CLAIMS = 16   # unchecked claims kept; more (a flood while P is stopped) are dropped


@dataclass
class Reservation:
    request_id: int
    p_instance: str
    deadline_unix_ms: int
    n_tokens: int
    dst_slots: np.ndarray
    stamps: dict[str, int] = field(default_factory=dict)
    max_frames: int = 0  # total_tokens - n_tokens of its RESERVE: the frames it will decode
    audio: bool = False  # its RESERVE asked for audio: admission charges the codec's cost


@dataclass
class Held:
    request_id: int
    p_instance: str
    since: float
    reason: str


class DecodeEngine:
    def __init__(
        self,
        model: TTSModel,
        model_spec: str,
        geometry: PoolGeometry,
        pool: PagePool,
        receiver: KVReceiver,
        hub: FrameHub,
        prefill_socket: str,
        max_batch: int,
        held_drain_fraction: float = 0.25,
        abort_resend_s: float = 0.2,
        probe_interval_s: float = 0.5,
        cuda_graphs: bool = True,
        overlap: bool = False,
        admission: AdmissionControl | None = None,
        codec: CodecStage | None = None,
        audio_format: pb.AudioFormat | None = None,
    ) -> None:
        """`codec` (--codec; None: no codec, audio requests are refused) decodes the frames
        of streams that ask for audio; `audio_format` is what Hello announces of it."""
        self.instance_id = uuid.uuid4().hex
        self.admission = admission  # rate-floor admission (engine/decode/admission.py); None = off
        self.codec = codec
        self.audio_format = audio_format
        self.model = model
        self.model_spec = model_spec
        self.geometry = geometry
        self.pool = pool
        self.receiver = receiver
        self.storage = receiver.storage
        self.hub = hub
        self.prefill_socket = prefill_socket
        self.held_drain_fraction = held_drain_fraction
        self.abort_resend_s = abort_resend_s
        self.probe_interval_s = probe_interval_s
        self.batcher = DecodeBatcher(model, pool, self.storage, max_batch)
        self.step_forward = StepForward(model, self.storage, cuda_graphs, max_batch)
        self.overlap = OverlapScheduler(model, self.batcher, self.step_forward) if overlap else None
        self.reservations: dict[int, Reservation] = {}
        self.held: dict[int, Held] = {}
        self.p_instance = ""          # P's instance id as P answered on its own socket (never a claim)
        self._p_heard: set[str] = set()  # every instance id P answered with; all but the newest are dead
        # unchecked claims: id -> (monotonic of the first, where each message claiming it came)
        self._p_claims: dict[str, tuple[float, list[str]]] = {}
        self._p_loop: asyncio.AbstractEventLoop | None = None  # the probe loop's, to wake it from any thread
        self._p_wake: asyncio.Event | None = None
        self._p_asking: asyncio.Future[str] | None = None
        self._lock = threading.Lock()
        self._draining = False
        self._step = 0
        # bumped (under the lock) whenever a reservation comes or goes: with the step it
        # keys the cached headroom (`headroom`)
        self._held_version = 0
        # audio streams past COMMIT's reservation whose first frame (and its codec chunk)
        # is being published outside the engine lock, not yet in the batcher (`commit`);
        # a Cancel meanwhile marks them in `_committing_cancelled`
        self._committing: dict[int, Stream] = {}
        self._committing_cancelled: set[int] = set()
        self.loop = StepLoop("decode-step", self._step_once, model.device)
        self.step_pad = StepPad()  # --synthetic-step-ms (tests and benchmarks; engine/step_pad.py): off
        self.traces = SpanTable(Tracing("decode", ""))  # main sets it from --otlp-endpoint
        if codec is not None:
            codec.on_fail = self._end_failed_audio
        self._p_channel: grpc.aio.Channel | None = None
        self._check_stream: torch.cuda.Stream | None = None  # COMMIT checksums (GPU), made on first use

    # ------------------------------------------------------------------ state
    @property
    def draining(self) -> bool:
        return self._draining

    def _update_draining(self) -> None:
        frac = self.pool.held_pages / max(1, self.pool.n_pages)
        now = frac > self.held_drain_fraction
        if now != self._draining:
            self._draining = now
            m.D_DRAINING.set(1 if now else 0)
            log.warning(
                "draining: held pages above threshold" if now else "draining ended: held pages under threshold",
                extra={"held_pages": self.pool.held_pages, "pool_pages": self.pool.n_pages,
                       "threshold": self.held_drain_fraction},
            )

    def _update_gauges(self) -> None:
        for state, n in self.pool.counts().items():
            m.D_POOL_PAGES.labels(state=state).set(n)
        m.D_STREAMS.set(len(self.batcher))

    def fail_transfer(self, request_id: int, status: pb.Status, reason: str, message: str) -> None:
        """A transfer failed: its pages go HELD (never free), LB hears now, P gets ABORTs."""
        with self._lock:
            res = self.reservations.pop(request_id, None)
            if res is None:
                return
            self._held_version += 1
            self.pool.hold(request_id)
            self.held[request_id] = Held(request_id, res.p_instance, time.monotonic(), reason)
        self._revoke(request_id)
        m.D_TRANSFER_FAILED.labels(reason=reason).inc()
        log.warning("transfer failed: pages held until proof", extra={
            "request_id": request_id, "reason": reason, "detail": message, "p_instance": res.p_instance})
        self.hub.publish_error(request_id, status, message)
        self.traces.close(request_id, {}, (), f"transfer failed: {reason}")
        self._update_draining()
        self._update_gauges()

    def release_held(self, request_id: int, proof: Proof) -> None:
        with self._lock:
            held = self.held.pop(request_id, None)
            if held is None:
                return
            self.pool.release_held(request_id, proof)
        m.D_HELD_RELEASED.labels(proof=proof.value).inc()
        log.info("held pages released", extra={"request_id": request_id, "proof": proof.value,
                                               "held_s": round(time.monotonic() - held.since, 3)})
        self._update_draining()
        self._update_gauges()

    # ------------------------------------------------------------------ P's instance: proof (b)
    def claim_p_instance(self, claim: str, seen_on: str) -> None:
        """An instance id on a message to D's socket (Hello, Reserve, Commit). Only a
        claim: anyone who reaches D's socket can write one (PROTOCOL.md 2). A claim of an
        id D has not heard from P makes the probe loop ask P now, on P's own socket;
        only P's answer there counts (`_heard_from_p`). Callable from any thread."""
        if not claim or claim == self.p_instance or claim in self._p_heard:
            return
        with self._lock:
            full = claim not in self._p_claims and len(self._p_claims) >= MAX_PENDING_CLAIMS
            if not full:
                seen = self._p_claims.setdefault(claim, (time.monotonic(), []))[1]
                if len(seen) < 64:  # each claiming message is one event when the claim is settled
                    seen.append(seen_on)
        if full:
            security_event("forged_instance_claim", claimed=claim, seen_on=seen_on, p_instance=self.p_instance,
                           detail=f"more than {MAX_PENDING_CLAIMS} claims unchecked (P does not answer): dropped")
            return
        loop, wake = self._p_loop, self._p_wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closing: nothing to wake
                loop.call_soon_threadsafe(wake.set)

    def _heard_from_p(self, instance: str, asked_at: float) -> None:
        """P's instance id in P's own answer (Info, Abort) on `prefill_socket`, the socket D
        was configured with and dialed itself: the only word for it D takes. A new one is
        proof (b): the old process cannot write any more. Claims made before the question
        (`asked_at`, monotonic) are settled: one P never answered with is a forgery and
        changes nothing."""
        if not instance:
            return
        if instance != self.p_instance and instance in self._p_heard:
            # An instance P's successor already replaced answering again: two processes on
            # P's socket. Never go back: that would "prove" the successor gone.
            log.error("an earlier P instance answered on P's socket: ignored", extra={
                "answered": instance, "p_instance": self.p_instance, "prefill_socket": self.prefill_socket})
            return
        with self._lock:
            old, self.p_instance = self.p_instance, instance
            self._p_heard.add(instance)
            settled = {c: v for c, v in self._p_claims.items() if v[0] <= asked_at or c == instance}
            for claim in settled:
                del self._p_claims[claim]
        for claim, (_, seen) in settled.items():
            if claim not in self._p_heard:
                for seen_on in seen:
                    security_event("forged_instance_claim", claimed=claim, seen_on=seen_on, p_instance=instance,
                                   prefill_socket=self.prefill_socket)
        if not old or old == instance:
            return
        m.D_P_INSTANCE_CHANGES.inc()
        log.warning("P restarted: P answered with a new instance id", extra={"old": old, "new": instance})
        with self._lock:
            stale = [r for r, res in self.reservations.items() if res.p_instance != instance]
        for rid in stale:
            self.fail_transfer(rid, pb.TRANSFER_FAILED, "p_restarted", "prefill restarted during the transfer")
        with self._lock:
            # Only requests of an instance P itself answered with: its successor answering
            # proves that process gone. A request attributed to anything else has no proven
            # writer to be gone; it waits for ABORT_ACK.
            proven = [r for r, h in self.held.items() if h.p_instance != instance and h.p_instance in self._p_heard]
        for rid in proven:
            self.release_held(rid, Proof.NEW_INSTANCE)

    async def ask_p(self, timeout: float = 1.0) -> str:
        """Asks P for its instance id on P's own socket ('' when P does not answer within
        `timeout`). Callers at the same time share one question."""
        if self._p_asking is None or self._p_asking.done():
            self._p_asking = asyncio.ensure_future(self._ask_p_once(timeout, time.monotonic()))
        return await asyncio.shield(self._p_asking)

    async def _ask_p_once(self, timeout: float, asked_at: float) -> str:
        try:
            info = await self._p_stub().Info(pb.Empty(), timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError:
            return ""
        self._heard_from_p(info.instance_id, asked_at)
        return info.instance_id

    async def refuse_unproven_sender(self, claim: str) -> pb.ReserveReply | None:
        """A RESERVE is made only for the P instance that P itself answers with on its own
        socket: proof (b) later frees the reservation's pages by that instance, so it
        must be P's word, not the message's. Returns the refusal, or None to go on."""
        if not claim:
            return pb.ReserveReply(status=pb.INVALID, instance_id=self.instance_id,
                                   message="identity.sender_instance is empty: a Reserve names the P instance "
                                           "that writes the request (P's instance_id)")
        if claim == self.p_instance:
            return None
        self.claim_p_instance(claim, "reserve")
        heard = await self.ask_p()
        if claim == self.p_instance:
            return None
        if not heard:
            return pb.ReserveReply(status=pb.TRANSFER_FAILED, instance_id=self.instance_id,
                                   message=f"identity.sender_instance {claim} is not P's instance as D last heard it "
                                           f"({self.p_instance or 'none yet'}) and P at {self.prefill_socket} did not "
                                           "answer Info to confirm it: retry once P answers")
        return pb.ReserveReply(status=pb.INVALID, instance_id=self.instance_id,
                               message=f"identity.sender_instance {claim} is not the P at {self.prefill_socket} "
                                       f"(it answers {heard}): only that P reserves pages in this D")

    # ------------------------------------------------------------------ transfer exchange
    def identity_ok(self, ident: pb.Identity) -> bool:
        return not ident.receiver_instance or ident.receiver_instance == self.instance_id

    def reserve(self, req: pb.ReserveRequest) -> pb.ReserveReply:
        if not self.identity_ok(req.identity):
            return pb.ReserveReply(status=pb.STALE_INSTANCE, instance_id=self.instance_id,
                                   message="receiver instance changed: handshake again")
        if self._draining:
            return pb.ReserveReply(status=pb.DRAINING, instance_id=self.instance_id,
                                   message="decode is draining: held pages above threshold")
        if req.n_tokens <= 0 or req.total_tokens < req.n_tokens:
            return pb.ReserveReply(status=pb.INVALID, instance_id=self.instance_id,
                                   message=f"n_tokens={req.n_tokens} total_tokens={req.total_tokens}")
        max_frames = req.total_tokens - req.n_tokens
        if req.audio and self.codec is None:  # refused before any page is taken (COMMIT checks again)
            return pb.ReserveReply(status=pb.INVALID, instance_id=self.instance_id, message=NO_CODEC)
        if self.admission is not None:
            alone = self.admission.alone_fits(req.n_tokens, max_frames, req.audio)
            if not alone.admit and not alone.engine_bound:  # else judged below: a 503
                return pb.ReserveReply(status=pb.INVALID, instance_id=self.instance_id,
                                       message="rate_floor: even alone this stream would break the floor "
                                               f"({alone.worst_ms:.1f} ms steps at its end, budget "
                                               f"{alone.budget_ms:.1f} ms): ask for fewer frames")
        with self._lock:
            if req.request_id in self.reservations or self.pool.state_of(req.request_id) is not None:
                return pb.ReserveReply(status=pb.INVALID, instance_id=self.instance_id,
                                       message=f"request {req.request_id} already has pages in D")
            if self.admission is not None:  # under the lock: two RESERVEs never both take the last room
                verdict = self.admission.judge(self._lifetimes(), req.n_tokens, max_frames, audio=req.audio)
                if not verdict.admit:
                    log.info("stream refused: rate floor", extra={
                        "request_id": req.request_id, "worst_ms": round(verdict.worst_ms, 2),
                        "budget_ms": round(verdict.budget_ms, 2), "at_step": verdict.at_step})
                    return pb.ReserveReply(status=pb.RATE_FLOOR, instance_id=self.instance_id,
                                           message=verdict.reason())
            try:
                slots = self.pool.reserve(req.request_id, req.n_tokens, req.total_tokens)
            except NoCapacity as exc:
                return pb.ReserveReply(status=pb.NO_CAPACITY, instance_id=self.instance_id, message=str(exc))
            self._held_version += 1
            self.reservations[req.request_id] = Reservation(
                req.request_id, req.identity.sender_instance, req.deadline_unix_ms, req.n_tokens, slots,
                stamps={"d_reserved": now_ns()}, max_frames=max_frames, audio=req.audio)
        self._update_gauges()
        # The write capability (PROTOCOL.md 3.1), outside the engine lock: the proxy's
        # receiver tells its sidecar. Granted after the reservation exists and checked
        # live afterwards, so a reservation that ended meanwhile (its revoke may have run
        # before this grant) never leaves a grant behind.
        try:
            capability = self.receiver.grant(req.request_id, slots, req.deadline_unix_ms)
        except Exception as exc:  # no capability, no write: the pages go held like any failed transfer
            log.error("write capability not granted", extra={"request_id": req.request_id, "error": str(exc)})
            self.fail_transfer(req.request_id, pb.TRANSFER_FAILED, "grant_failed", f"write grant failed: {exc}")
            return pb.ReserveReply(status=pb.TRANSFER_FAILED, instance_id=self.instance_id,
                                   message=f"decode could not grant the write capability: {exc}")
        with self._lock:
            live = req.request_id in self.reservations
        if not live:
            self._revoke(req.request_id)
            return pb.ReserveReply(status=pb.UNKNOWN_REQUEST, instance_id=self.instance_id,
                                   message="the reservation ended before it was granted (deadline or cancel)")
        return pb.ReserveReply(status=pb.STATUS_OK, dst_slots=pack(slots, "i8"), instance_id=self.instance_id,
                               capability=capability)

    def _lifetimes(self) -> list[tuple[int, ...]]:
        """(context, frames to come, audio) of every stream D holds: decoding, waiting for
        the batch, and reserved but not committed (they will decode too). Under the lock."""
        committing = [(s.prompt_tokens + s.frames_out, max(0, s.params.max_frames - s.frames_out), True)
                      for s in self._committing.values()]
        return self.batcher.lifetimes(audio=True) + committing + [(r.n_tokens, r.max_frames, r.audio)
                                                                  for r in self.reservations.values()]

    def headroom(self) -> int:
        """Streams like the recent ones D would still admit (-1: admission off). Computed
        at most once per step and change of the held set (a reservation made, committed or
        failed): every Info probe asks, and the answer is a projection over the held
        streams' lifetimes."""
        if self.admission is None:
            return -1

        def held() -> list[tuple[int, ...]]:
            with self._lock:
                return self._lifetimes()

        return self.admission.export_for((self._step, self._held_version), held)

    def _revoke(self, request_id: int) -> None:
        """The reservation's write capability ends (COMMIT, held): receivers that check
        capabilities (tcp, proxy) apply no write of it any more."""
        try:
            self.receiver.revoke(request_id)
        except Exception as exc:  # the pages' own state (held / decoding) still stands
            log.error("write capability not revoked", extra={"request_id": request_id, "error": str(exc)})

    def commit(self, req: pb.CommitRequest) -> pb.CommitReply:
        if not self.identity_ok(req.identity):
            return pb.CommitReply(status=pb.STALE_INSTANCE, instance_id=self.instance_id)
        if req.audio and self.codec is None:
            self.fail_transfer(req.request_id, pb.INVALID, "no_codec", NO_CODEC)
            return pb.CommitReply(status=pb.INVALID, instance_id=self.instance_id, message=NO_CODEC)
        with self._lock:
            res = self.reservations.get(req.request_id)
            if res is None or self.pool.state_of(req.request_id) != PageState.RESERVED:
                return pb.CommitReply(status=pb.UNKNOWN_REQUEST, instance_id=self.instance_id,
                                      message="no live reservation (expired, cancelled or failed)")
            self.pool.mark_filled(req.request_id)
        self._revoke(req.request_id)  # before the checksum: no write lands after it reads the rows
        got = self._checksum(res.dst_slots, max(1, req.checksum_sample))
        m.KV_CHECKS.inc()
        if got != req.checksum:
            m.KV_MISMATCH.inc()
            self.fail_transfer(req.request_id, pb.CHECKSUM_MISMATCH, "checksum",
                               f"KV checksum mismatch: P sent {req.checksum:#x}, D read {got:#x}")
            return pb.CommitReply(status=pb.CHECKSUM_MISMATCH, instance_id=self.instance_id)
        stamps = dict(req.stamps.ns)
        stamps.update(res.stamps)
        first = unpack(req.first_frame, "i4").astype(np.int32)
        stream = Stream(req.request_id, req.prompt_tokens, sampling_from_pb(req.sampling), first.copy(),
                        frames_out=1, stamps=stamps, audio=req.audio)
        # Under the engine lock from the reservation's end to the batcher's admission (or,
        # for an audio stream, to `_committing`): a Cancel in between finds the request in
        # one of them (see `cancel`).
        with self._lock:
            if self.reservations.pop(req.request_id, None) is None:  # failed meanwhile
                return pb.CommitReply(status=pb.UNKNOWN_REQUEST, instance_id=self.instance_id)
            self._held_version += 1
            self.pool.start_decoding(req.request_id)
            stamps["d_committed"] = now_ns()
            audio = stream.audio and self.codec is not None
            if audio:
                self.codec.open(req.request_id)  # type: ignore[union-attr]  # under the lock: the idle sweep sees it
            if len(self.batcher) + len(self._committing) >= self.batcher.max_batch:
                self.batcher.admit(stream)  # the batch is full: first_out stays False, the batcher emits it
                audio = False
            elif audio:
                self._committing[stream.request_id] = stream
            else:
                self._publish_first_frame(stream)
        if audio:
            self._publish_first_audio_frame(stream)
        self.loop.work.set()
        self._update_gauges()
        return pb.CommitReply(status=pb.STATUS_OK, instance_id=self.instance_id)

    # The first frame (P sampled it) goes to the LB at COMMIT, not with D's next step: it
    # needs nothing from D, and the next step boundary is one to two steps away (22-26 ms
    # p50 at 128+ streams on the H200s). A stream that this frame ends (EOS past
    # min_frames, or max_frames == 1) never enters the batch. Unless the batch is full
    # (`--max-batch` streams running, waiting or committing): the stream then waits for
    # room, and a first frame sent now would open a gap of that wait inside the stream
    # (its rate and worst 1-s window count from its first frame); its first frame goes
    # out with the step that takes it in, so the wait falls before it, where the TTFA
    # budget covers it. An audio stream's first frame carries its first PCM chunk: the
    # codec's call is made outside the engine lock (`_publish_first_audio_frame`).
    def _first_frame(self, stream: Stream) -> tuple[StepOutput, bool]:
        code = self.batcher.finish_code(stream, stream.last_frame)
        ended = code != RUNNING
        out = StepOutput(request_ids=np.array([stream.request_id], dtype=np.uint64),
                         frames=stream.last_frame[None, :].astype(np.int32), finished=np.array([code], np.uint8),
                         started=[stream], ended=[stream] if ended else [])
        return out, ended

    def _publish_first_frame(self, stream: Stream) -> None:
        """A frames stream's first frame; called under the engine lock (no codec call)."""
        out, ended = self._first_frame(stream)
        publish_step(self.hub, self._step, out, self.codec)
        m.D_FRAMES.inc()
        self._admit_after_first_frame(stream, ended)

    def _publish_first_audio_frame(self, stream: Stream) -> None:
        """An audio stream's first frame with its first chunk, published outside the engine
        lock (the codec's call held it for that long: Reserve, Cancel and Info waited; on
        the CPU with the tiny codec ~25 ms p50 against ~0.06 ms for a frames stream). The
        stream waits in `_committing` meanwhile, so no step decodes it before its first
        frame is out; then it joins the batch, or ends if it was cancelled meanwhile."""
        out, ended = self._first_frame(stream)
        publish_step(self.hub, self._step, out, self.codec)  # the codec decodes the first chunk here
        m.D_FRAMES.inc()
        rid = stream.request_id
        with self._lock:
            self._committing.pop(rid, None)
            self._held_version += 1
            if rid in self._committing_cancelled:
                self._committing_cancelled.discard(rid)
                self.pool.finish(rid)
                if self.codec is not None:
                    self.codec.drop([rid])
                return
            self._admit_after_first_frame(stream, ended)

    def _admit_after_first_frame(self, stream: Stream, ended: bool) -> None:
        """Under the engine lock: the stream joins the batch, or its pages are freed if its
        first frame ended it (or its codec failed on it: a StreamError went out)."""
        if not ended and stream.audio and self.codec is not None and stream.request_id not in self.codec:
            ended = True
        if ended:
            self.pool.finish(stream.request_id)
            return
        stream.first_out = True
        self.batcher.admit(stream)

    def _checksum(self, slots: np.ndarray, sample: int) -> int:
        """D's checksum of a committed transfer's rows. On a GPU it runs on a stream of its
        own: on the default stream it would queue behind the decode step in flight (the
        H200 waterfall shows 7-11 ms from transfer end to D's commit at 128+ streams; not
        yet measured with this change). The rows are final when COMMIT arrives
        (P's write or the proxy's copy completed before it sent COMMIT), and no decode
        step touches a reserved request's pages."""
        if not self.storage.is_cuda:
            return kv_checksum(self.storage, slots, sample)
        if self._check_stream is None:
            self._check_stream = torch.cuda.Stream(device=self.storage.device)
        with torch.cuda.stream(self._check_stream):
            return kv_checksum(self.storage, slots, sample)

    def cancel(self, request_id: int, status: pb.Status = pb.STATUS_OK, message: str = "") -> bool:
        """The client went away (status OK), or P gave up on the transfer (its status and
        message reach the client as they are)."""
        with self._lock:  # a committing request is in `reservations`, `_committing` or the batcher
            decoding = self.batcher.cancel(request_id)
            if not decoding and request_id in self._committing:
                self._committing_cancelled.add(request_id)  # its COMMIT ends it once its first frame is out
                decoding = True
            pending = not decoding and request_id in self.reservations
        if decoding:
            self.loop.work.set()
            return True
        if pending:
            if status == pb.STATUS_OK:
                self.fail_transfer(request_id, pb.CANCELLED, "cancelled", "cancelled by the client")
            else:
                self.fail_transfer(request_id, status, "prefill_gave_up", message or pb.Status.Name(status))
        return pending

    def expire_reservations(self) -> None:
        now_ms = int(time.time() * 1000)
        with self._lock:
            late = [r for r, res in self.reservations.items() if res.deadline_unix_ms and now_ms > res.deadline_unix_ms]
        for rid in late:
            self.fail_transfer(rid, pb.DEADLINE_EXCEEDED, "deadline", "KV transfer did not commit before its deadline")

    # ------------------------------------------------------------------ decode steps
    def _step_once(self) -> bool:
        if self.overlap is not None:
            return self._overlap_step_once()
        dropped = self.batcher.take_cancelled()
        if dropped:
            with self._lock:  # streams left between steps: the cached headroom is stale
                self._held_version += 1
        if self.codec is not None:
            self.codec.drop(dropped)
        self._traces_end(dropped, [])
        new = self.batcher.take_incoming()
        streams, entries = self.batcher.decode_entries()
        if not streams and not new:
            self._sweep_audio()
            self._update_gauges()
            return False
        t0 = time.perf_counter()
        tokens = sum(s.prompt_tokens + s.frames_out for s in streams)
        logits = self.step_forward(entries) if entries else None
        self.step_pad.wait(t0, len(streams))  # in the forward's place: before any stream changes
        out = self.batcher.apply(streams, logits, new)
        self._step += 1
        cost = publish_step(self.hub, self._step, out, self.codec)
        self._traces_end([], out.ended)
        self._observe_delivery(out)
        seconds = time.perf_counter() - t0
        m.D_STEP_SECONDS.observe(seconds)
        if self.admission is not None and streams:
            self.admission.observe(len(streams), tokens, seconds * 1000, codec=cost)
        m.D_STEP_BATCH.observe(len(out.request_ids))
        m.D_FRAMES.inc(len(out.request_ids))
        if out.ended:
            self._update_draining()
            self._update_gauges()
        return True

    def _traces_end(self, dropped: list[int], ended: list[Stream]) -> None:
        """Close the trace spans of streams that left the batch (engine/tracing.py)."""
        for rid in dropped:
            self.traces.close(rid, {}, (), "cancelled")
        for s in ended:
            self.traces.close(s.request_id, s.stamps, DECODE_STAGES, frames=s.frames_out)

    def _observe_delivery(self, out: StepOutput) -> None:
        """A published step's ended streams, and now and then the running ones: the rates
        they delivered feed admission's budget (engine/decode/rate_feedback.py)."""
        if self.admission is not None:
            self.admission.observe_delivery(out.ended, self.batcher.running.values)

    def _overlap_step_once(self) -> bool:
        """One iteration of the overlap pipeline (engine/decode/overlap.py): queues step
        n+1, then publishes step n's frames."""
        assert self.overlap is not None
        t0 = time.perf_counter()
        worked, out = self.overlap.step_once()
        if self.overlap.dropped:
            with self._lock:  # streams left between steps: the cached headroom is stale
                self._held_version += 1
        if self.codec is not None:
            self.codec.drop(self.overlap.dropped)
        self._traces_end(self.overlap.dropped, [])
        if not worked:
            self._sweep_audio()
            self._update_gauges()
            return False
        cost = None
        if out is not None:
            self._step += 1
            cost = publish_step(self.hub, self._step, out, self.codec)
            self._traces_end([], out.ended)
            self._observe_delivery(out)
            m.D_STEP_BATCH.observe(len(out.request_ids))
            m.D_FRAMES.inc(len(out.request_ids))
            if out.ended:
                self._update_draining()
                self._update_gauges()
        self.step_pad.wait(t0, len(out.request_ids) if out is not None else 0)
        seconds = time.perf_counter() - t0
        m.D_STEP_SECONDS.observe(seconds)
        if self.admission is not None and out is not None and len(out.request_ids):
            # one pipeline period = one frame per stream: the step time the floor sees
            self.admission.observe(len(out.request_ids), self.batcher.context_tokens(), seconds * 1000,
                                   codec=cost)
        return True

    def _sweep_audio(self) -> None:
        """Idle: no codec slot outlives its stream, whatever path forgot the stream. Under
        the engine lock: a COMMIT opens a stream's slot and admits it under it too."""
        if self.codec is None or not len(self.codec):
            return
        with self._lock:
            gone = self.codec.retain(self.batcher.request_ids() + list(self._committing))
        if gone:
            log.warning("codec slots of streams no longer decoding freed", extra={"request_ids": gone})

    def _end_failed_audio(self, request_id: int) -> None:
        """The codec failed on a stream (its StreamError is out): the stream ends as a
        cancelled one (the batcher's own lock; never the engine's, which COMMIT holds)."""
        if self.batcher.cancel(request_id):
            self.loop.work.set()

    # ------------------------------------------------------------------ expiry, abort + probe loops
    def _p_stub(self) -> pbg.PrefillStub:
        if self._p_channel is None:
            self._p_channel = grpc.aio.insecure_channel(unix_target(self.prefill_socket), options=P_CHANNEL_OPTIONS)
        return pbg.PrefillStub(self._p_channel)

    def end_orphaned_streams(self, request_ids: list[int]) -> int:
        """Streams no frames subscriber can receive any more (FrameHub: their LB went
        away and nobody took them over): ended as a client's cancel ends them, so none
        decodes to max frames for nobody. Returns how many were still running."""
        return sum(1 for rid in request_ids if self.cancel(rid))

    async def expiry_loop(self, interval_s: float = 0.05) -> None:
        """Fails reservations past their deadline. Its own loop: the client's error must
        not wait behind ABORTs to a stopped P."""
        while True:
            await asyncio.sleep(interval_s)
            self.expire_reservations()

    async def abort_loop(self) -> None:
        """Re-sends ABORT for every held request until proof (PROTOCOL.md 3.4), all held
        requests at once, so one unanswered ABORT does not delay the others."""
        while True:
            await asyncio.sleep(self.abort_resend_s)
            held = list(self.held.values())
            if held:
                await asyncio.gather(*(self._abort_once(h) for h in held))

    async def _abort_once(self, held: Held) -> None:
        rid = held.request_id
        if self.receiver.receiver_quiesced(rid):
            self.release_held(rid, Proof.RECEIVER_STATE)
            return
        m.D_ABORTS_SENT.inc()
        asked_at = time.monotonic()
        try:
            reply = await self._p_stub().Abort(
                pb.AbortRequest(request_id=rid, identity=pb.Identity(
                    sender_instance=self.instance_id, receiver_instance=held.p_instance,
                    budget_ms=int(self.abort_resend_s * 1000))),
                timeout=max(0.5, self.abort_resend_s * 2))
        except grpc.aio.AioRpcError:
            return  # P unreachable or stopped: not a proof, keep re-sending
        # P's own answer on P's socket: a new instance id in it is proof (b) for every
        # request of the old instance, this one included (`_heard_from_p`).
        self._heard_from_p(reply.instance_id, asked_at)
        if reply.ack and (reply.instance_id == held.p_instance or not reply.instance_id):
            # Never an ACK of another instance: a new P cannot vouch for the old one's writes.
            self.release_held(rid, Proof.ABORT_ACK)

    async def probe_loop(self) -> None:
        """Asks P for its instance id on P's own socket: every `probe_interval_s` with no
        traffic too (PROTOCOL.md 4: a draining D must not wait for a Reserve that never
        comes to learn that P restarted), and at once when a message claims a new id
        (`claim_p_instance`), again every CLAIM_RECHECK_S while such a claim is unchecked."""
        self._p_loop = asyncio.get_running_loop()
        self._p_wake = wake = asyncio.Event()
        while True:
            wake.clear()
            await self.ask_p()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), CLAIM_RECHECK_S if self._p_claims else self.probe_interval_s)

    # ------------------------------------------------------------------ info
    def ownership(self) -> dict:
        """Debug view (--debug-port): every request owning pages, its state and pages."""
        requests = {}
        for rid in self.pool.requests():
            try:
                requests[f"{rid:016x}"] = {"state": self.pool.state_of(rid).name.lower(),  # type: ignore[union-attr]
                                           "pages": self.pool.pages_of(rid).tolist()}
            except (KeyError, AttributeError):
                continue  # released meanwhile
        return {"instance_id": self.instance_id, "p_instance": self.p_instance,
                "page_size": self.pool.page_size, "pool_pages": self.pool.n_pages, "requests": requests,
                "stats": self.pool.stats()}

    def info(self) -> pb.InfoReply:
        with self._lock:
            ids = list(self.reservations) + list(self.held) + list(self._committing)
        ids += self.batcher.request_ids()
        return pb.InfoReply(
            role="decode", instance_id=self.instance_id, peer_instance_id=self.p_instance, pid=os.getpid(),
            queue=len(self.reservations), in_flight=len(self.batcher),
            held_pages=self.pool.held_pages, pool_pages=self.pool.n_pages, free_pages=self.pool.free_pages,
            draining=self._draining, transfer_mode=self.receiver.mode,
            unready=getattr(self.receiver, "unready", ""),  # e.g. the proxy restarted: registering again
            headroom_streams=self.headroom(),
            kv_checks_total=int(m.KV_CHECKS._value.get()), kv_mismatch_total=int(m.KV_MISMATCH._value.get()),
            request_ids=pack(np.array(sorted(set(ids)), dtype=np.uint64), "u8"),
        )

    def hello(self) -> pb.HelloReply:
        g = self.geometry
        reply = pb.HelloReply(
            instance_id=self.instance_id,
            geometry=pb.PoolGeometry(n_layers=g.n_layers, n_kv_heads=g.n_kv_heads, head_dim=g.head_dim,
                                     dtype=str(g.dtype).replace("torch.", ""), n_slots=g.n_slots,
                                     page_size=g.page_size),
            n_codebooks=self.model.config.n_codebooks,
            vocab_sizes=pack(np.array(self.model.config.vocab_sizes, dtype=np.int64), "i8"),
            eos_id=self.model.config.eos_id,
            model=self.model_spec,
            **hello_rules(self.model.row_rule, self.model.depth_sampling),
            frame_rate_hz=real_time_fps(self.audio_format.frame_rate_hz if self.audio_format else None,
                                        self.model.frame_rate_hz),
        )
        if self.audio_format is not None:
            reply.audio_format.CopyFrom(self.audio_format)
        for d in self.receiver.descriptors():
            reply.transports.append(pb.TransportDescriptor(mode=d.mode, params=d.params, handle=d.handle))
        return reply


class DecodeService(pbg.DecodeServicer):
    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        engine.hub.end_orphans_with(engine.end_orphaned_streams, engine.batcher.request_ids)

    async def Hello(self, request, context):  # noqa: N802 - gRPC names
        self.engine.claim_p_instance(request.sender_instance, "hello")
        return self.engine.hello()

    async def Reserve(self, request, context):  # noqa: N802
        t0 = now_ns()
        refused = await self.engine.refuse_unproven_sender(request.identity.sender_instance)
        if refused is not None:
            return refused
        reply = self.engine.reserve(request)
        if reply.status == pb.STATUS_OK and self.engine.traces.tracing.enabled:  # ends with the stream
            self.engine.traces.open(request.request_id, "decode.stream", t0, context.invocation_metadata())
        return reply

    async def Commit(self, request, context):  # noqa: N802
        self.engine.claim_p_instance(request.identity.sender_instance, "commit")
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.commit, request)

    async def Frames(self, request, context):  # noqa: N802
        log.info("frames subscriber connected", extra={"subscriber": request.subscriber})
        subscription = self.engine.hub.subscribe(request.subscriber)
        await context.send_initial_metadata(())  # the LB knows it is subscribed from here on
        async for message in subscription:
            yield message

    async def Cancel(self, request, context):  # noqa: N802
        return pb.CancelReply(found=self.engine.cancel(request.request_id, request.status, request.message))

    async def Info(self, request, context):  # noqa: N802
        return self.engine.info()


def serve_debug(engine: DecodeEngine, port: int) -> None:
    """GET /debug/pool on 127.0.0.1:`port`: the ownership map. Fault-injection only."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/debug/pool":
                self.send_error(404, "only /debug/pool")
                return
            body = json.dumps(engine.ownership()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="decode-debug", daemon=True).start()
    log.warning("debug endpoint on: pool ownership is readable", extra={"port": port})
