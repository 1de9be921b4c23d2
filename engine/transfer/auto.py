"""`--transfer auto`: find the best transport that really works, at start, with proof.

D's `AutoReceiver` allocates ONE pool and offers every mode that can reach it, best first,
and the modes it cannot serve (probe only, or `unavailable` with the exact error). P's
`probe_auto` tries them in ORDER, each with a real mapping and a VERIFIED test transfer
(checksums of what landed in D's memory, never a device attribute), picks the first that
passes and logs the choice and every failure reason. Nothing downgrades later without a
new probe. Must never write probe rows into D's pool slots: a probe writes each mode's
probe region, under that mode's probe authorisation, never under a reservation's capability.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from prometheus_client import Counter

from pdunit.engine.kv.checksum import kv_checksum
from pdunit.engine.metrics import role_metric
from pdunit.engine.transfer.attach import attach
from pdunit.engine.transfer.base import (
    Descriptor,
    KVReceiver,
    KVSender,
    PoolGeometry,
    TransferError,
    exact_pattern,
)
from pdunit.engine.transfer.options import proxy_socket, tcp_address, unit_secret

log = logging.getLogger("pdunit.transfer.auto")

ORDER = ("fabric", "posix-fd", "ipc", "host", "proxy", "tcp")
PROBE_ROWS = 4

# P chooses (its sender's probe); P's worker exports the mode it then uses
# (pdunit_transfer_mode), as for a mode named by --transfer.
PROBES = role_metric(Counter("pdunit_transfer_probe_total", "Verified test transfers by mode and outcome",
                             ["mode", "outcome"], registry=None), "prefill")


@dataclass
class ProbeResult:
    mode: str
    ok: bool
    detail: str
    seconds: float = 0.0
    probe_only: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "ok": self.ok, "detail": self.detail,
                "seconds": round(self.seconds, 4), "probe_only": self.probe_only}


@dataclass
class AutoReport:
    chosen: str
    results: list[ProbeResult] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "results": [r.as_dict() for r in self.results]}


# ---------------------------------------------------------------- D side
class AutoReceiver(KVReceiver):
    """D side: allocates ONE pool and offers every mode that can reach it, best
    first: fabric and posix-fd (when a FABRIC cuMem allocation succeeds), else ipc
    (cudaMalloc pool); then proxy (when the sidecar answers) and tcp. A mode the pool
    cannot serve is offered "probe only" on a tiny allocation of its own, so P still
    reports whether it would work; a mode D could not set up at all is offered with its
    exact error (`unavailable`; tcp without the unit's secret is one). Every part checks
    the same write grants, so a reservation has one capability whichever mode P uses."""

    mode = "auto"

    def __init__(self, geometry: PoolGeometry, device: str, options: dict[str, str]) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self.parts: list[KVReceiver] = []
        self.unavailable: list[Descriptor] = []
        self.tcp: Any = None
        storage: torch.Tensor
        fabric_pool = False
        if self.device.type == "cuda":
            from pdunit.engine.transfer.fabric import FabricReceiver
            from pdunit.engine.transfer.ipc import IpcReceiver
            from pdunit.engine.transfer.posix_fd import PosixFdReceiver

            try:
                main: KVReceiver = FabricReceiver(geometry, device)
                fabric_pool = True
                probe_only = [(PosixFdReceiver, "posix-fd"), (IpcReceiver, "ipc")]
            except Exception as e:
                reason = f"FABRIC pool allocation failed: {e}"
                log.warning("fabric not available", extra={"error": str(e)})
                self.unavailable.append(Descriptor("fabric", {"unavailable": reason}))
                main = IpcReceiver(geometry, device)
                fabric_pool = False
                probe_only = [(PosixFdReceiver, "posix-fd")]
            self.parts.append(main)
            storage = main.storage
            tiny = PoolGeometry(geometry.n_layers, geometry.n_kv_heads, geometry.head_dim,
                                geometry.dtype, 16, 1)
            for cls, mode in probe_only:
                try:
                    self.parts.append(_ProbeOnly(cls(tiny, device)))
                except Exception as e:
                    self.unavailable.append(Descriptor(mode, {"unavailable": f"D cannot export {mode} memory: {e}"}))
        else:
            from pdunit.engine.transfer.host import HostReceiver

            main = HostReceiver(geometry)
            self.parts.append(main)
            storage = main.storage
        self._storage = storage
        try:
            from pdunit.engine.transfer.proxy import ProxyReceiver

            if self.device.type == "cuda" and fabric_pool:
                raise TransferError("D's pool is a FABRIC cuMem allocation; proxy regions are legacy "
                                    "IPC or POSIX-fd memory (fabric itself is the better path)")
            self.parts.append(ProxyReceiver(geometry, device, proxy_socket(options), storage=storage)
                              if self.device.type == "cuda" else _proxy_on_host(geometry, device, options, main))
        except Exception as e:
            self.unavailable.append(Descriptor("proxy", {"unavailable": f"nvlink-proxy not usable: {e}"}))
        try:
            from pdunit.engine.transfer.tcp import TcpReceiver

            secret = unit_secret(options, "D's tcp KV listener")
        except TransferError as e:
            log.warning("tcp not offered", extra={"error": str(e)})
            self.unavailable.append(Descriptor("tcp", {"unavailable": str(e)}))
        else:
            try:
                host, port, advertise = tcp_address(options)
                self.tcp = TcpReceiver(geometry, device, host, port, storage=storage, advertise_host=advertise,
                                       secret=secret)
                self.parts.append(self.tcp)
            except Exception as e:
                self.unavailable.append(Descriptor("tcp", {"unavailable": f"tcp listener failed: {e}"}))
        # One reservation, one capability, whichever part P writes through.
        for part in self.parts:
            part.grants = self.grants

    @property
    def storage(self) -> torch.Tensor:
        return self._storage

    def descriptors(self) -> list[Descriptor]:
        out = [d for p in self.parts for d in p.descriptors()] + self.unavailable
        return sorted(out, key=lambda d: ORDER.index(d.mode) if d.mode in ORDER else len(ORDER))

    def grant(self, request_id: int, dst_slots: np.ndarray, deadline_unix_ms: int) -> bytes:
        """One capability for every part (they share `self.grants`); the proxy, a third
        party, hears of it through its own receiver."""
        proxy = next((p for p in self.parts if p.mode == "proxy"), None)
        if proxy is None:
            return self.grants.grant(request_id, dst_slots, deadline_unix_ms)
        capability = proxy.grant(request_id, dst_slots, deadline_unix_ms)
        self.grants.grant(request_id, dst_slots, deadline_unix_ms, capability=capability)
        return capability

    def revoke(self, request_id: int) -> None:
        for part in self.parts:
            part.revoke(request_id)
        self.grants.revoke(request_id)

    def receiver_quiesced(self, request_id: int) -> bool:
        # Only tcp makes D the writer. A request tcp never saw may be in flight on
        # another transport: not proven here (P's ABORT_ACK must prove it).
        if self.tcp is not None and self.tcp.known(request_id):
            return self.tcp.receiver_quiesced(request_id)
        return False

    def close(self) -> None:
        for p in reversed(self.parts):
            p.close()


def _proxy_on_host(geometry: PoolGeometry, device: str, options: dict[str, str], host_rx: Any) -> KVReceiver:
    """CPU: register the host pool's shm segment with the proxy."""
    from pdunit.engine.transfer.proxy import ProxyReceiver

    return ProxyReceiver(geometry, device, proxy_socket(options), shm_pool=host_rx)


class _ProbeOnly(KVReceiver):
    """A tiny receiver offered only so P can report whether the mode would work."""

    def __init__(self, inner: KVReceiver) -> None:
        self.inner = inner
        self.mode = inner.mode

    @property
    def storage(self) -> torch.Tensor:
        return self.inner.storage

    def descriptors(self) -> list[Descriptor]:
        out = []
        for d in self.inner.descriptors():
            out.append(Descriptor(d.mode, {**d.params, "probe_only": "1"}, d.handle))
        return out

    def close(self) -> None:
        self.inner.close()


# ---------------------------------------------------------------- P side
def _probe_source(geometry: PoolGeometry, device: str) -> tuple[torch.Tensor, np.ndarray]:
    shape = (geometry.n_layers, 2, PROBE_ROWS * 2, geometry.n_kv_heads, geometry.head_dim)
    src = exact_pattern(shape, geometry.dtype, time.time_ns() & 0xFFFFFFFF)
    slots = np.array([5, 0, 7, 2][:PROBE_ROWS], dtype=np.int64)  # scattered, out of order
    return src.to(device), slots


def probe_one(descriptor: Descriptor, geometry: PoolGeometry, device: str,
              options: dict[str, str]) -> tuple[KVSender | None, ProbeResult]:
    mode = descriptor.mode
    probe_only = descriptor.params.get("probe_only") == "1"
    if "unavailable" in descriptor.params:
        return None, ProbeResult(mode, False, descriptor.params["unavailable"])
    t0 = time.perf_counter()
    sender: KVSender | None = None
    try:
        # A probe-only offer is attached like a real one: the probe is the real test.
        usable = Descriptor(mode, {k: v for k, v in descriptor.params.items() if k != "probe_only"},
                            descriptor.handle)
        if probe_only and "n_slots" in descriptor.params:
            # the probe-only allocation is tiny: attach with its own slot count
            geometry = dataclasses.replace(geometry, n_slots=int(descriptor.params["n_slots"]))
        sender = attach(usable, geometry, device, options)
        if mode == "host":
            detail = "attached to D's shared-memory pool (host mode has no probe region)"
        else:
            src, slots = _probe_source(geometry, device)
            expected = kv_checksum(src, slots)
            rid = (1 << 63) | (time.time_ns() & ((1 << 62) - 1))
            got = sender.probe(src, slots, rid)  # type: ignore[attr-defined]
            seen = got[1] if isinstance(got, tuple) else int(got)
            if isinstance(got, tuple) and got[0] != expected:
                raise TransferError(f"source checksum {got[0]} != local {expected}")
            if seen != expected:
                raise TransferError(f"verified test transfer failed: D's probe rows checksum {seen}, expected {expected}")
            detail = f"verified test transfer of {PROBE_ROWS} rows x {geometry.n_layers * 2} planes (checksum {expected:#x})"
        PROBES.labels(mode, "ok").inc()
        if probe_only:
            sender.close()
            return None, ProbeResult(mode, True, detail + "; probe only: D's pool is not exported this way",
                                     time.perf_counter() - t0, probe_only=True)
        return sender, ProbeResult(mode, True, detail, time.perf_counter() - t0)
    except Exception as e:
        PROBES.labels(mode, "failed").inc()
        if sender is not None:
            try:
                sender.close()
            except Exception:  # closing a half-open sender: the probe error is the news
                pass
        return None, ProbeResult(mode, False, f"{type(e).__name__}: {e}", time.perf_counter() - t0, probe_only)


def log_choice(report: AutoReport, device: str) -> None:
    """The choice and every probe's outcome; a warning when GPU pools ended on tcp, the one
    choice that must not pass quietly (the operator's TcpFallback condition says it too)."""
    if report.chosen == "tcp" and not str(device).startswith("cpu"):
        log.warning("transfer auto fell back to tcp: every faster mode failed its verified probe",
                    extra={"mode": report.chosen, "report": report.as_dict()})
    else:
        log.info("transfer mode chosen", extra={"mode": report.chosen, "report": report.as_dict()})


def probe_auto(descriptors: list[Descriptor], geometry: PoolGeometry, device: str,
               options: dict[str, str]) -> tuple[KVSender, AutoReport]:
    """Probe D's offers in ORDER; return the first verified sender and the full report.
    With options["probe_all"] == "1" every mode is probed (the harness's report).

    P side: fabric -> posix-fd -> ipc -> host -> proxy -> tcp, each with a real mapping
    and a verified test transfer into D's probe region (tcp: under a probe grant D issues
    to the authenticated peer); the choice and every failure reason are logged, and P then
    exports the mode it uses as `pdunit_transfer_mode{pdunit_transfer_mode=...}`."""
    probe_all = options.get("probe_all") == "1"
    ranked = sorted(descriptors, key=lambda d: ORDER.index(d.mode) if d.mode in ORDER else len(ORDER))
    chosen: KVSender | None = None
    report = AutoReport(chosen="")
    for desc in ranked:
        if chosen is not None and not probe_all:
            break
        sender, result = probe_one(desc, geometry, device, options)
        report.results.append(result)
        log.info("transfer probe", extra={"mode": desc.mode, "ok": result.ok, "detail": result.detail,
                                          "probe_only": result.probe_only})
        if sender is not None:
            if chosen is None:
                chosen = sender
                report.chosen = desc.mode
            else:
                sender.close()
    if chosen is None:
        reasons = "; ".join(f"{r.mode}: {r.detail}" for r in report.results)
        raise TransferError(f"auto: no transfer mode passed a verified test transfer ({reasons})")
    log_choice(report, device)
    chosen.auto_report = report  # type: ignore[attr-defined]
    return chosen, report
