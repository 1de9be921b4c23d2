"""The fault suite's P (bench/faults.py, tests/faults/): `python -m
pdunit.bench.fault_injection <pdunit prefill's args> --fault-*` runs P's own serve with
each sender wrapped in a `FaultySender`, which fails the writes of marked prompts.

It starts only with PDUNIT_FAULT_INJECTION=1 (exit 2 otherwise), and must never change
a write whose prompt is not marked: a prompt is marked by the id in its row 0 column 0
(`corrupt` flips one bit of the rows sent, `slow` pauses a write halfway, past its
deadline, `wedge` never completes, so P never proves it quiesced and its abort stays
held). The engine never imports this module: the faults stay off the production path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import threading
import time

import numpy as np
import torch
from pydantic import BaseModel, Field

from pdunit.engine.prefill.main import FAULT_ENV, PrefillConfig, serve
from pdunit.engine.prefill.scheduler import PrefillJob
from pdunit.engine.prefill.worker import PrefillEngine
from pdunit.engine.settings import ConfigError, parse_config
from pdunit.engine.transfer.base import Descriptor, KVSender, PoolGeometry, TransferError

log = logging.getLogger("pdunit.faults")


class FaultFields(BaseModel):
    """The switches (each -1 / 0 / "" = off)."""

    fault_corrupt_id: int = Field(-1, ge=-1, description="flip a bit in the KV rows sent for prompts whose row 0 "
                                  "column 0 is this id")
    fault_slow_id: int = Field(-1, ge=-1, description="such prompts' writes pause halfway for --fault-slow-ms")
    fault_slow_ms: int = Field(0, ge=0, description="the pause of --fault-slow-id writes")
    fault_wedge_id: int = Field(-1, ge=-1, description="such prompts' writes never complete and cannot be "
                                "cancelled, so their aborts stay held")
    fault_tcp_relay: str = Field("", description="host:port the tcp transport connects to instead of D's "
                                 "address (a relay that can stall)")
    fault_chunk_tokens: int = Field(0, ge=0, description="write in chunks of this many tokens (host and tcp), so "
                                    "that a stop lands mid-write")
    fault_chunk_delay_ms: float = Field(0.0, ge=0, description="host transport: pause between chunks")

    def kind(self, prompt: np.ndarray) -> str:
        """The fault a prompt is marked for, "" when none."""
        first = int(prompt[0, 0])
        for kind, marker in (("corrupt", self.fault_corrupt_id), ("slow", self.fault_slow_id),
                             ("wedge", self.fault_wedge_id)):
            if marker >= 0 and first == marker:
                return kind
        return ""


class FaultyPrefillConfig(PrefillConfig, FaultFields):
    """Prefill engine (P) with fault injection (PDUNIT_FAULT_INJECTION=1: the fault suite only)."""


class FaultySender(KVSender):
    """Wraps P's sender to one D: the writes of marked requests (`marked`: request id ->
    kind, shared with the engine that marks them) fail as their kind says; every other
    call goes to `inner` unchanged. A slow write's pause is part of the write: while it
    lasts the write is in flight, so `quiesce` answers False (P holds D's ABORT) and D
    keeps the half-written pages held until the pause ends, as a stalled copy would."""

    def __init__(self, inner: KVSender, marked: dict[int, str], slow_s: float) -> None:
        self.inner = inner
        self.mode = inner.mode
        self.marked = marked
        self.slow_s = slow_s
        self.wedged: set[int] = set()
        self._lock = threading.Lock()  # `pausing`: the write thread changes it, P's ABORT handler reads it
        self.pausing: set[int] = set()

    def write(self, request_id: int, src: torch.Tensor, src_slots: np.ndarray, dst_slots: np.ndarray,
              deadline_unix_ms: int, *, capability: bytes) -> None:
        kind = self.marked.get(request_id, "")
        if not kind:
            self.inner.write(request_id, src, src_slots, dst_slots, deadline_unix_ms, capability=capability)
            return
        log.warning("fault injection", extra={"request_id": request_id, "fault": kind})
        if kind == "corrupt":
            # A copy of the rows with one bit flipped; P's checksum is over the true rows.
            index = torch.from_numpy(np.asarray(src_slots, dtype=np.int64)).to(src.device)
            rows = src.index_select(2, index).contiguous()
            rows.view(-1).view(torch.uint8)[0] ^= 1
            self.inner.write(request_id, rows, np.arange(len(src_slots), dtype=np.int64), dst_slots,
                             deadline_unix_ms, capability=capability)
        elif kind == "slow":
            half = len(src_slots) // 2
            with self._lock:
                self.pausing.add(request_id)
            try:
                self.inner.write(request_id, src, src_slots[:half], dst_slots[:half], deadline_unix_ms,
                                 capability=capability)
                time.sleep(self.slow_s)
            finally:
                with self._lock:
                    self.pausing.discard(request_id)
            self.inner.write(request_id, src, src_slots[half:], dst_slots[half:], deadline_unix_ms,
                             capability=capability)
        elif kind == "wedge":
            self.wedged.add(request_id)
            raise TransferError(f"request {request_id}: write wedged (fault injection): it never completes")

    def quiesce(self, request_id: int) -> bool:
        settled = self.inner.quiesce(request_id)  # always asked: it also bars later writes
        with self._lock:
            pausing = request_id in self.pausing
        return settled and request_id not in self.wedged and not pausing

    def in_flight(self) -> list[int]:
        with self._lock:
            return list(set(self.inner.in_flight()) | self.pausing)

    @property
    def unready(self) -> str:
        """The wrapped sender's reason it cannot write now, if it has one (P's Info)."""
        return getattr(self.inner, "unready", "")

    def close(self) -> None:
        self.inner.close()


class FaultyPrefillEngine(PrefillEngine):
    """P whose senders are `FaultySender`s: it marks each submitted prompt with its fault."""

    sender_options: dict[str, str]

    def __init__(self, *args: object, faults: FaultFields, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.faults = faults
        # request id -> fault kind, marked prompts only; set before the job is queued,
        # so before any write of it
        self.marked: dict[int, str] = {}
        if faults.fault_chunk_tokens:
            chunks = {"chunk_tokens": str(faults.fault_chunk_tokens), "tcp_chunk_tokens": str(faults.fault_chunk_tokens),
                      "chunk_delay_s": str(faults.fault_chunk_delay_ms / 1000)}
            self.sender_options = self.sender_options | chunks

    def submit(self, job: PrefillJob) -> None:
        kind = self.faults.kind(job.prompt)
        if kind:
            self.marked[job.request_id] = kind
        super().submit(job)

    def attach_sender(self, offered: list[Descriptor], geometry: PoolGeometry) -> KVSender:
        relay = self.faults.fault_tcp_relay
        if relay:
            host, _, port = relay.rpartition(":")
            for d in offered:
                if d.mode == "tcp":
                    d.params.update(host=host, port=port)
            log.warning("fault injection: tcp transport goes through a relay", extra={"relay": relay})
        return FaultySender(super().attach_sender(offered, geometry), self.marked,
                            self.faults.fault_slow_ms / 1000)


PROG = "python -m pdunit.bench.fault_injection"


def main(argv: list[str]) -> int:
    """P with fault injection; refused (exit 2) unless started with PDUNIT_FAULT_INJECTION=1."""
    if os.environ.get(FAULT_ENV) != "1":
        message = f"{PROG}: fault injection runs only in a process started with {FAULT_ENV}=1 (the fault suite)"
        print(message, file=sys.stderr)
        raise ConfigError(message)
    cfg = parse_config(FaultyPrefillConfig, argv, PROG)
    return asyncio.run(serve(cfg, functools.partial(FaultyPrefillEngine, faults=cfg)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
