"""P: the prefill engine of a unit and its gRPC service. Owns P's instance id, the
requests' way in (Submit, Cancel) and the abort answers; the pipeline (pipeline.py)
runs them and the links (links.py) choose each one's D.

P answers D's ABORT with ABORT_ACK only when its transport proves that no write of that
request can land any more (the quiesce of the sender of the D that sent it; of every
sender when that D is unknown). It never answers from a timeout: holding
`max_held_aborts` unanswered aborts it exits on purpose, and its restart (a new
instance id) is the proof D needs for all of them (PROTOCOL.md 3.4).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

from pdunit.engine import metrics as m
from pdunit.engine.kv.prefix_cache import PrefixCache
from pdunit.engine.model.prefill_graphs import PrefillGraphRunner
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.observability import now_ns
from pdunit.engine.packing import pack
from pdunit.engine.prefill.links import DecodeLinks, PeerSpec
from pdunit.engine.prefill.pipeline import PrefillPipeline
from pdunit.engine.prefill.scheduler import PrefillJob, PrefillScheduler
from pdunit.engine.prefill.submit import serve_submit
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from pdunit.engine.tracing import Tracing
from pdunit.engine.transfer.base import Descriptor, KVSender, PoolGeometry
from pdunit.engine.transfer.factory import make_sender

log = logging.getLogger("pdunit.prefill")

EXIT_HELD_ABORTS = 75  # P exits on purpose: its restart proves every held abort


class PrefillEngine:
    def __init__(
        self,
        model: TTSModel,
        model_spec: str,
        device: str,
        storage: torch.Tensor,
        cache: PrefixCache,
        scheduler: PrefillScheduler,
        decode_socket: str,
        transfer: str,
        sender_options: dict[str, str],
        kv_check_sample: int = 1,
        max_held_aborts: int = 3,
        held_abort_grace_s: float = 1.0,
        transfer_deadline_ms: int = 0,
        decode_probe_interval_s: float = 0.5,
        transfer_workers: int = 4,
        graphs: PrefillGraphRunner | None = None,
        forward: Callable[..., list[np.ndarray | None]] | None = None,
        reserve_concurrency: int = 1,
    ) -> None:
        """`forward`: run_prefill's stand-in (PrefillPipeline's `forward`);
        `reserve_concurrency`: PrefillPipeline's (queued requests reserved at once)."""
        self.instance_id = uuid.uuid4().hex
        self.model = model
        self.model_spec = model_spec
        self.device = device
        self.storage = storage
        self.cache = cache
        self.scheduler = scheduler
        self.transfer = transfer
        self.sender_options = sender_options
        self.max_held_aborts = max_held_aborts
        self.held_abort_grace_s = held_abort_grace_s
        self.held_aborts: dict[tuple[str, int], float] = {}  # (D instance, request id) -> since
        self._lock = threading.Lock()
        self.links = DecodeLinks(decode_socket, self.instance_id, self.attach_sender, transfer_deadline_ms,
                                 decode_probe_interval_s)
        self.pipeline = PrefillPipeline(model, device, storage, cache, scheduler, self.links, kv_check_sample,
                                        transfer_workers, graphs, forward, reserve_concurrency)

    def connect(self, timeout_s: float = 120.0) -> None:
        """Handshakes with every D (links.DecodeLinks.connect): P serves only after."""
        self.links.connect(PeerSpec(self.model_spec, self.model.config, self.storage.dtype, self.transfer), timeout_s)

    def attach_sender(self, offered: list[Descriptor], geometry: PoolGeometry) -> KVSender:
        """The sender to one D among the transports it offered: `--transfer`'s, or D's
        best for auto."""
        return make_sender(offered if self.transfer == "auto" else
                           [d for d in offered if d.mode == self.transfer] or offered,
                           geometry, self.device, self.sender_options)

    def start(self) -> None:
        self.pipeline.start()

    def stop(self) -> None:
        self.pipeline.stop()

    # ------------------------------------------------------------------ requests
    def submit(self, job: PrefillJob) -> None:
        job.stamps["p_admitted"] = now_ns()
        self.scheduler.put(job)
        m.P_QUEUE.set(len(self.scheduler))

    def cancel(self, request_id: int, status: pb.Status = pb.CANCELLED, reason: str = "cancelled by the client") -> bool:
        job = self.scheduler.cancel(request_id)
        if job is not None:
            self.pipeline.finish(job, status, reason)
            return True
        job = self.pipeline.mark_cancelled(request_id, status, reason)
        if job is None:
            return False
        # Reserved on a D: only that D's sender can hold a write of it. Not reserved yet:
        # none can, and the pipeline checks `cancelled` before RESERVE and before the
        # write; quiescing every sender keeps a late RESERVE from writing anyway.
        link = self.links.route(request_id)
        for target in [link] if link is not None else self.links:
            if target.sender is not None:
                target.sender.quiesce(request_id)
        return True

    def abort(self, request: pb.AbortRequest) -> pb.AbortReply:
        rid = request.request_id
        addressed = request.identity.receiver_instance
        if addressed and addressed != self.instance_id:
            # Meant for an earlier P (D has not seen this instance yet): this process never
            # wrote that request, and our id in the reply is D's proof (b) for it.
            return pb.AbortReply(ack=False, instance_id=self.instance_id)
        d_instance = request.identity.sender_instance
        # The D that sent the ABORT; unknown (an older D, or none named): every sender must
        # prove quiescence, since any of them could have written the request.
        links = [link for link in self.links if d_instance and link.instance == d_instance] or list(self.links)
        routed = self.links.route(rid)
        if routed is None or routed in links:
            # A request moved to another D before any write (the first D's RESERVE timed
            # out) must not be cancelled by the first D's ABORT: it is alive elsewhere.
            self.cancel(rid, pb.TRANSFER_FAILED, "decode aborted the transfer (it failed there: deadline, "
                        "checksum or cancel)")
        ack = True
        for link in links:  # every one is asked: quiesce also bars later writes
            ack = (link.sender.quiesce(rid) if link.sender is not None else True) and ack
        key = (d_instance, rid)
        now = time.monotonic()
        with self._lock:
            if ack:
                self.held_aborts.pop(key, None)
            else:
                self.held_aborts.setdefault(key, now)
            overdue = [r for (_, r), t in self.held_aborts.items() if now - t >= self.held_abort_grace_s]
            m.P_HELD_ABORTS.set(len(self.held_aborts))
        m.P_ABORTS.labels(answer="ack" if ack else "held").inc()
        if len(overdue) >= self.max_held_aborts:
            log.critical("exiting on purpose: too many held aborts (the restart proves them all)", extra={
                "held_aborts": overdue, "limit": self.max_held_aborts, "event": "PrefillHeldAbortExit"})
            logging.shutdown()
            os._exit(EXIT_HELD_ABORTS)
        return pb.AbortReply(ack=ack, instance_id=self.instance_id)

    # ------------------------------------------------------------------ info
    def info(self) -> pb.InfoReply:
        with self._lock:
            ids = [rid for _, rid in self.held_aborts]
            held = len(self.held_aborts)
        ids += self.pipeline.request_ids() + self.scheduler.request_ids()
        in_flight: set[int] = set()
        for link in self.links:
            if link.sender is not None:
                in_flight.update(link.sender.in_flight())
        return pb.InfoReply(
            role="prefill", instance_id=self.instance_id, peer_instance_id=self.links.instances(), pid=os.getpid(),
            queue=len(self.scheduler), in_flight=len(in_flight), held_aborts=held,
            transfer_mode=self.links.transfer_modes(),
            unready="; ".join(u for link in self.links if (u := getattr(link.sender, "unready", ""))),
            request_ids=pack(np.array(sorted(set(ids)), dtype=np.uint64), "u8"),
        )


class PrefillService(pbg.PrefillServicer):
    def __init__(self, engine: PrefillEngine, tracing: Tracing | None = None) -> None:
        self.tracing = tracing or Tracing("prefill", "")
        self.engine = engine

    async def Submit(self, request, context):  # noqa: N802 - gRPC names
        span = self.tracing.start("prefill.request", now_ns(), context.invocation_metadata(),
                                  request_id=f"{request.request_id:016x}") if self.tracing.enabled else None
        model = self.engine.model
        return await serve_submit(request, model.config, self.engine.submit, self.engine.cancel,
                                  span, model.row_rule, model.depth_sampling)

    async def Cancel(self, request, context):  # noqa: N802
        return pb.CancelReply(found=self.engine.cancel(request.request_id))

    async def Abort(self, request, context):  # noqa: N802
        return self.engine.abort(request)

    async def Info(self, request, context):  # noqa: N802
        return self.engine.info()
