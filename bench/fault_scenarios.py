"""The faults of PROTOCOL.md section 7, each injected, checked, and recovered from.

Owns `Scenario` (one method per kind: p_stop, p_kill, lb_stop, slow, corrupt, held_exit,
proxy_stop, tcp_stall; each must leave the unit at 0 held pages released by the expected
proof), the replays into held pages and late TCP chunks (no live request's frames may
change), the stalling TCP relay and the fault schedule. What each kind does and must
show: docs/performance.md, "What each benchmark measures". Never edits the unit's code
paths: it drives real processes (fault_unit.Unit).
"""

from __future__ import annotations

import random
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from pdunit.bench.fault_unit import (
    CORRUPT_ID,
    SLOW_ID,
    SLOW_PAST_DEADLINE_MS,
    WEDGE_ID,
    WEIGHTS,
    FaultCheckFailed,
    FaultsConfig,
    Outcome,
    Prompt,
    Traffic,
    Unit,
    marked_prompt,
    metric,
    proofs,
    stream_once,
)
from pdunit.engine.proto import pdunit_pb2 as pb

# D's count of the transfers it failed, every reason (engine/metrics.py)
TRANSFERS_FAILED = "pdunit_decode_transfer_failed_total"

# ---------------------------------------------------------------------------- replays


class HostReplayer:
    """Writes a marker into held pages as a late sender would (host transport): attaches
    to D's shared-memory pool with the transport's own sender."""

    def __init__(self, unit: Unit) -> None:
        import torch

        from pdunit.engine.model.config import torch_dtype
        from pdunit.engine.transfer.base import Descriptor, PoolGeometry
        from pdunit.engine.transfer.host import HostSender

        hello = unit.d_hello()
        g = hello.geometry
        self.geometry = PoolGeometry(g.n_layers, g.n_kv_heads, g.head_dim, torch_dtype(g.dtype, pool=True), g.n_slots,
                                     g.page_size)
        desc = next(t for t in hello.transports if t.mode == "host")
        self.sender = HostSender(Descriptor(desc.mode, dict(desc.params), desc.handle), self.geometry)
        self.marker = torch.full((g.n_layers, 2, 256, g.n_kv_heads, g.head_dim), 1.0e6, dtype=self.geometry.dtype)

    def write(self, slots: list[int], tag: int) -> None:
        n = min(len(slots), self.marker.shape[2])
        # host: P writes D's shared memory itself, no capability is checked (a late
        # sender's own would not stop it either): the held state is what protects
        self.sender.write(tag, self.marker, np.arange(n, dtype=np.int64), np.asarray(slots[:n], dtype=np.int64),
                          2**62, capability=b"")

    def close(self) -> None:
        self.sender.close()


def replay_into_held(unit: Unit, replayer: HostReplayer | None, stats: Counter) -> int:
    """For every request D holds now: write the marker into its pages, then check it was
    still held (the write landed in pages no live request owns). Returns replays done."""
    if replayer is None:
        return 0
    before = unit.ownership()
    _check_disjoint(before)
    page = before["page_size"]
    done = 0
    for rid, req in before["requests"].items():
        if req["state"] != "held":
            continue
        slots = [p * page + o for p in req["pages"] for o in range(page)]
        replayer.write(slots, tag=int(rid, 16) ^ 0x5A5A)
        after = unit.ownership()["requests"].get(rid)
        if after is None or after["state"] != "held" or after["pages"] != req["pages"]:
            # Released between the snapshot and the write: then the marker may sit in free
            # or reused pages. The canary (frames) still judges; count it separately.
            stats["replay_raced_release"] += 1
        else:
            stats["replay_into_held"] += 1
        done += 1
    return done


def _check_disjoint(ownership: dict[str, Any]) -> None:
    seen: dict[int, str] = {}
    for rid, req in ownership["requests"].items():
        for p in req["pages"]:
            if p in seen:
                raise FaultCheckFailed(f"page {p} owned by both {seen[p]} and {rid}")
            seen[p] = rid


class StallRelay:
    """A TCP relay between P's tcp sender and D's listener that can stall P -> D: the
    chunks of a stalled sender arrive late (PROTOCOL.md section 6)."""

    def __init__(self, target: Any) -> None:
        self._target = target          # callable -> (host, port) of D's listener
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self._target())
            for s in (conn, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [conn, up]
            threading.Thread(target=self._pipe, args=(conn, up, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, conn, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if gated:
                    self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.flowing.set()
        self.listener.close()
        for s in self._socks:
            s.close()


def send_late_chunk(host: str, port: int, request_id: int, geometry_row_bytes: int,
                    secret: bytes | None = None) -> str:
    """A CHUNK of an aborted/released request straight to D's tcp listener (no BEGIN),
    under a capability that is not the request's (this process never had it). Without
    `secret` the listener must cut the connection before reading it ("closed"); with
    the unit's secret it must drop it and answer the terminal state. Returns the reply."""
    from pdunit.engine.transfer.base import CAPABILITY_BYTES
    from pdunit.engine.transfer.tcp import (
        ABORTED,
        CHUNK,
        COMPLETED,
        HEADER,
        MAGIC,
        VERSION,
        client_handshake,
    )

    payload = bytes(CAPABILITY_BYTES) + b"\x7f" * geometry_row_bytes
    with socket.create_connection((host, port), timeout=5) as s:
        if secret is not None:
            client_handshake(s, secret, f"{host}:{port}")
        try:
            s.sendall(HEADER.pack(MAGIC, VERSION, CHUNK, 0, request_id, 0, 1, 1000, 0, len(payload)) + payload)
        except (BrokenPipeError, ConnectionResetError):
            return "closed"
        head = b""
        while len(head) < HEADER.size:
            try:
                part = s.recv(HEADER.size - len(head))
            except ConnectionResetError:
                return "closed"
            if not part:
                return "closed"
            head += part
        typ = HEADER.unpack(head)[2]
        if secret is None and typ != ABORTED:  # the handshake's challenge: D must cut us off now
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            except TimeoutError:
                return "left open"
            return "closed"
    return {ABORTED: "aborted", COMPLETED: "completed"}.get(typ, str(typ))


# ---------------------------------------------------------------------------- faults


@dataclass
class FaultRecord:
    kind: str
    t_start: float
    t_end: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


class Scenario:
    def __init__(self, cfg: FaultsConfig, unit: Unit, bank: list[Prompt], relay: StallRelay | None = None) -> None:
        self.cfg = cfg
        self.unit = unit
        self.bank = bank
        self.relay = relay
        self.faults: list[FaultRecord] = []
        self.fault_outcomes: list[Outcome] = []
        self.fault_refusals: list[str] = []  # fault requests refused at admission, then retried
        self.stats: Counter = Counter()
        self.violations: list[str] = []
        # A fresh connection per fault request: between faults the client idles for about
        # the LB's keep-alive timeout (uvicorn's 5 s), and a request sent on a pooled
        # connection the LB is closing at that moment never reaches it ("Server
        # disconnected without sending a response"): a fault injected into nothing.
        self.client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        self.replayer = HostReplayer(unit) if cfg.transfer == "host" else None
        self.seq = 0

    # -- helpers
    def _fault_request(self, marker: int, tag: str, rows: int = 48, frames: int = 8) -> Outcome:
        self.seq += 1
        body = {"prompt": marked_prompt(marker, rows, self.cfg.seed * 7919 + self.seq),
                "max_frames": frames, "min_frames": frames}
        out = stream_once(self.client, self.unit.url, body, tag=tag)
        deadline = time.monotonic() + self.cfg.recover_timeout_s
        # Refused at the door (503 not_ready, Retry-After): the fault was never injected.
        # Ask again as a client honouring Retry-After would; each refusal is reported.
        while out.status == 503 and out.code == "not_ready" and time.monotonic() < deadline:
            self.fault_refusals.append(f"{tag}: {out.message}")
            time.sleep(0.25)
            out = stream_once(self.client, self.unit.url, body, tag=tag)
        self.fault_outcomes.append(out)
        return out

    def _expect_error(self, out: Outcome, codes: tuple[str, ...], what: str) -> None:
        latency = out.t_end - out.t0
        if out.ok:
            self.violations.append(f"{what}: the request succeeded, expected an error {codes}")
        elif out.code not in codes:
            self.violations.append(f"{what}: error {out.code!r} ({out.message}), expected one of {codes}")
        if latency > self.cfg.error_bound_s:
            self.violations.append(f"{what}: the client waited {latency:.2f}s for its error "
                                   f"(bound {self.cfg.error_bound_s}s)")

    def _recovered(self, rec: FaultRecord, proofs_before: dict[str, float], expect_proof: str | None) -> None:
        """Held pages back to 0, released only with proof of the expected kind (with tcp
        D's own receiver state, proof (c), comes first for every kind)."""
        if expect_proof and self.cfg.transfer == "tcp":
            expect_proof = "receiver_state"
        t = time.monotonic()
        try:
            self.unit.wait(lambda: self.unit.d_info().held_pages == 0, self.cfg.recover_timeout_s,
                           f"held pages back to 0 after {rec.kind}")
        except FaultCheckFailed as exc:
            raise FaultCheckFailed(f"{exc}\n{self.unit.diagnosis()}") from None
        rec.detail["recover_s"] = round(time.monotonic() - t, 3)
        after = proofs(self.unit.d_metrics())
        delta = {k: after.get(k, 0) - proofs_before.get(k, 0) for k in after}
        rec.detail["released_by_proof"] = {k: v for k, v in delta.items() if v}
        if expect_proof and not delta.get(expect_proof):
            self.violations.append(f"{rec.kind}: expected releases by proof {expect_proof}, saw {delta}")
        # The next fault starts from a ready unit (the LB re-probes P and D every 0.25 s).
        self.unit.wait(lambda: httpx.get(f"{self.unit.url}/readyz", timeout=2).status_code == 200,
                       self.cfg.recover_timeout_s, f"the unit ready again after {rec.kind}")

    def _wait_in_flight(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.unit.p_info(0.5)
            if info is not None and info.in_flight > 0:
                return True
        return False

    def _granted(self) -> set[str]:
        """The requests D has granted pages for whose transfer has not committed."""
        return {rid for rid, req in self.unit.ownership()["requests"].items() if req["state"] in ("reserved", "filled")}

    def _stall_past_deadline(self, rec: FaultRecord, metrics0: dict[str, float], at_most_s: float) -> None:
        """Returns once the stall just begun (P, its relay or the proxy stopped) has
        outlasted the transfer deadline: none of the transfers D had granted at the
        start is still open, and D failed at least one since the start (at D's deadline,
        or P's: P gives up and says so). When none fails (P was between writes, or they
        all committed), after `at_most_s`, the fixed window these stalls had. Timed by D
        itself: a late expiry on a loaded machine lengthens the stall instead of ending
        it before D acted. `metrics0`: D's, scraped before the stall."""
        t0 = time.monotonic()
        granted = self._granted()
        failed0 = metric(metrics0, TRANSFERS_FAILED)
        scraped = 0.0

        def past_deadline() -> bool:
            nonlocal scraped
            if granted & self._granted():
                return False
            now = time.monotonic()
            if now - scraped < 0.2:  # a scrape costs D tens of ms: not at every look
                return False
            scraped = now
            rec.detail["transfers_failed"] = metric(self.unit.d_metrics(), TRANSFERS_FAILED) - failed0
            return rec.detail["transfers_failed"] > 0 or now - t0 >= at_most_s

        self.unit.wait(past_deadline, self.cfg.transfer_deadline_ms / 1000 + self.cfg.recover_timeout_s,
                       f"D failing the transfers stalled by {rec.kind} at their deadline")
        rec.detail["stalled_s"] = round(time.monotonic() - t0, 3)

    def _replay_while_held(self, rec: FaultRecord, request: threading.Thread, after_s: float) -> None:
        """Replay into held pages while the fault's `request` is in flight and `after_s`
        after it failed: D holds a paused write's pages from its deadline (when the request
        fails) until P, resumed, answers the ABORT, so the window is anchored on the
        request's failure, however late a loaded machine lets the request reach D."""
        ended: float | None = None
        while ended is None or time.monotonic() < ended + after_s:
            if replay_into_held(self.unit, self.replayer, self.stats):
                rec.detail["replayed"] = True
                return
            if ended is None and not request.is_alive():
                ended = time.monotonic()
            time.sleep(0.05)

    # -- the faults
    def corrupt(self) -> FaultRecord:
        rec = FaultRecord("corrupt", time.monotonic())
        before = proofs(self.unit.d_metrics())
        out = self._fault_request(CORRUPT_ID, "corrupt")
        self._expect_error(out, ("checksum_mismatch",), "corrupted rows")
        self._recovered(rec, before, "abort_ack")
        return rec

    def slow(self) -> FaultRecord:
        rec = FaultRecord("slow", time.monotonic())
        before = proofs(self.unit.d_metrics())
        result: list[Outcome] = []
        t = threading.Thread(target=lambda: result.append(self._fault_request(SLOW_ID, "slow")))
        t.start()
        # P pauses mid-write past the deadline: D holds the half-written pages from the
        # deadline until P, past its pause, answers the ABORT
        self._replay_while_held(rec, t, SLOW_PAST_DEADLINE_MS / 1000 + 0.3)
        t.join()
        self._expect_error(result[0], ("transfer_failed", "deadline_exceeded"), "write paused past its deadline")
        self._recovered(rec, before, "abort_ack")
        return rec

    def p_stop(self) -> FaultRecord:
        rec = FaultRecord("p_stop", time.monotonic())
        metrics0 = self.unit.d_metrics()
        before = proofs(metrics0)
        rec.detail["mid_transfer"] = self._wait_in_flight()
        self.unit.signal("prefill", signal.SIGSTOP)
        try:
            self._stall_past_deadline(rec, metrics0, self.cfg.transfer_deadline_ms / 1000 + 0.3)
            rec.detail["held_while_stopped"] = self.unit.d_info().held_pages
            replay_into_held(self.unit, self.replayer, self.stats)
            if rec.detail["held_while_stopped"] and self.cfg.transfer != "tcp":
                self._unanswered_abort(rec)
        finally:
            self.unit.signal("prefill", signal.SIGCONT)
        self._recovered(rec, before, "abort_ack" if rec.detail["held_while_stopped"] else None)
        return rec

    def _unanswered_abort(self, rec: FaultRecord) -> None:
        """While P is stopped and D holds pages: until D has sent an ABORT P cannot
        answer (it re-sends them; the ACK that frees the pages answers one of them)."""
        sent0 = metric(self.unit.d_metrics(), "pdunit_decode_aborts_sent_total")
        try:
            self.unit.wait(lambda: metric(self.unit.d_metrics(), "pdunit_decode_aborts_sent_total") > sent0,
                           self.cfg.recover_timeout_s, "an ABORT from D to the stopped P", interval=0.1)
        except FaultCheckFailed as exc:
            self.violations.append(f"{rec.kind}: D holds pages and sent no ABORT: {exc}")

    def proxy_stop(self) -> FaultRecord:
        """SIGSTOP of the nvlink-proxy mid-transfer, past the deadline: D holds the
        pages; for a job the stopped proxy holds, P cannot prove quiescence until the
        proxy runs again and finishes or drops it (the frames canary checks that no late
        copy landed in a live request's pages)."""
        rec = FaultRecord("proxy_stop", time.monotonic())
        metrics0 = self.unit.d_metrics()
        before = proofs(metrics0)
        rec.detail["mid_transfer"] = self._wait_in_flight()
        self.unit.signal("proxy", signal.SIGSTOP)
        try:
            self._stall_past_deadline(rec, metrics0, self.cfg.transfer_deadline_ms / 1000 + 0.3)
            rec.detail["held_while_stopped"] = self.unit.d_info().held_pages
            rec.detail["released_while_stopped"] = {
                k: v - before.get(k, 0) for k, v in proofs(self.unit.d_metrics()).items() if v - before.get(k, 0)}
        finally:
            self.unit.signal("proxy", signal.SIGCONT)
        self._recovered(rec, before, "abort_ack" if rec.detail["held_while_stopped"] else None)
        return rec

    def lb_stop(self) -> FaultRecord:
        rec = FaultRecord("lb_stop", time.monotonic())
        frames0 = metric(self.unit.d_metrics(), "pdunit_decode_frames_total")
        self.unit.signal("lb", signal.SIGSTOP)
        try:
            time.sleep(1.0)
            frames1 = metric(self.unit.d_metrics(), "pdunit_decode_frames_total")
        finally:
            self.unit.signal("lb", signal.SIGCONT)
        rec.detail["d_frames_while_lb_stopped"] = frames1 - frames0
        # D's streams in flight at the stop keep decoding: its step loop never waits on
        # the LB. (Zero is legal only when D had nothing to decode.)
        if frames1 == frames0 and self.unit.d_info().in_flight:
            self.violations.append("lb_stop: D emitted no frame while its consumer was stopped")
        self._recovered(rec, proofs(self.unit.d_metrics()), None)
        return rec

    def p_kill(self) -> FaultRecord:
        rec = FaultRecord("p_kill", time.monotonic())
        metrics0 = self.unit.d_metrics()
        before = proofs(metrics0)
        rec.detail["mid_transfer"] = self._wait_in_flight()
        old = self.unit.d_info().peer_instance_id
        self.unit.signal("prefill", signal.SIGKILL)
        # reservations of the dead P expire: held
        self._stall_past_deadline(rec, metrics0, self.cfg.transfer_deadline_ms / 1000 + 0.2)
        rec.detail["held_while_dead"] = self.unit.d_info().held_pages
        replay_into_held(self.unit, self.replayer, self.stats)
        self.unit.restart_p()
        new = self.unit.d_info().peer_instance_id
        if new == old:
            self.violations.append("p_kill: D still reports the old P instance after the restart")
        self._recovered(rec, before, "new_instance" if rec.detail["held_while_dead"] else None)
        return rec

    def held_exit(self) -> FaultRecord:
        """Three wedged writes: P exits on purpose (75) at 3 held aborts; their pages are
        > 25 % of the pool, so D drains until the new P instance frees them."""
        rec = FaultRecord("held_exit", time.monotonic())
        before = proofs(self.unit.d_metrics())
        over0 = self.unit.guard_status().get("actions_total", {}).get("p_over_limit", 0)
        pool = self.unit.d_info().pool_pages
        frames = max(8, int(pool * 0.30 / 3) - 96 + 1)
        results: list[Outcome] = []
        threads = [threading.Thread(target=lambda: results.append(
            self._fault_request(WEDGE_ID, "wedge", rows=96, frames=frames))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for out in results:
            self._expect_error(out, ("transfer_failed",), "wedged write")
        saw_draining = False
        proc = self.unit.local.child("prefill").proc
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            saw_draining |= self.unit.d_info().draining
            replay_into_held(self.unit, self.replayer, self.stats)
            time.sleep(0.05)
        code = proc.poll()
        rec.detail["p_exit_code"] = code
        if code != 75:
            self.violations.append(f"held_exit: P exit code {code}, expected 75 (held aborts at the limit)")
        saw_draining |= self.unit.d_info().draining
        rec.detail["d_drained"] = saw_draining
        if not saw_draining:
            self.violations.append(f"held_exit: D never drained while holding ~30% of {pool} pages")
        self.unit.restart_p()
        self._recovered(rec, before, "new_instance")
        self.unit.wait(lambda: not self.unit.d_info().draining, 10, "D back from draining")
        status = self.unit.guard_status()
        rec.detail["guard_actions"] = sorted({a["kind"] for a in status.get("recent_actions", [])
                                              if a.get("at", 0) >= time.time() - (time.monotonic() - rec.t_start)})
        if status.get("actions_total", {}).get("p_over_limit", 0) <= over0:
            self.violations.append(f"held_exit: the guard did not report P over its held-abort limit "
                                   f"(its actions: {rec.detail['guard_actions']})")
        return rec

    def tcp_stall(self) -> FaultRecord:
        assert self.relay is not None, "tcp_stall needs --transfer tcp and the relay"
        rec = FaultRecord("tcp_stall", time.monotonic())
        metrics0 = self.unit.d_metrics()
        before = proofs(metrics0)
        dropped0 = metric(metrics0, "pdunit_tcp_chunks_total")
        self._wait_in_flight()
        self.relay.flowing.clear()
        try:
            # the stalled chunks stay in the relay until D aborted their requests
            self._stall_past_deadline(rec, metrics0, self.cfg.transfer_deadline_ms / 1000 + 0.5)
        finally:
            self.relay.flowing.set()
        self._recovered(rec, before, "receiver_state")
        m = self.unit.d_metrics()
        drops = {k.split('"')[1]: v for k, v in m.items() if k.startswith("pdunit_tcp_chunks_total") and "dropped" in k}
        rec.detail["tcp_dropped_chunks_total"] = drops
        rec.detail["tcp_chunks_delta"] = metric(m, "pdunit_tcp_chunks_total") - dropped0
        return rec

    def replay_late_chunks(self, rec: FaultRecord) -> None:
        """tcp: a late CHUNK of every request that failed in this fault's window, sent
        straight to D's listener after D released its pages: without the unit's secret
        D must cut the connection, with it D must drop the chunk (it carries no capability
        of the request's) and answer the terminal state."""
        from pdunit.engine.security import read_secret_file

        hello = self.unit.d_hello()
        desc = next(t for t in hello.transports if t.mode == "tcp")
        secret = read_secret_file(self.unit.local.unit_secret_file)
        failed = [o for o in self.traffic.outcomes + self.fault_outcomes
                  if not o.ok and o.request_id and o.t0 <= rec.t_end and o.t_end >= rec.t_start]
        for o in failed[:20]:
            for who, stat, allowed in ((None, "tcp_late_chunk_unauthenticated_", ("closed",)),
                                       (secret, "tcp_late_chunk_answered_", ("aborted", "completed"))):
                reply = send_late_chunk(desc.params["host"], int(desc.params["port"]), int(o.request_id, 16),
                                        _row_bytes(hello), secret=who)
                self.stats[stat + reply] += 1
                if reply not in allowed:
                    who_says = "without" if who is None else "with"
                    self.violations.append(f"late tcp chunk of {o.request_id} {who_says} the unit's secret: D "
                                           f"answered {reply!r}, expected {' or '.join(allowed)}")

    traffic: Traffic


def _row_bytes(hello: pb.HelloReply) -> int:
    g = hello.geometry
    width = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}[g.dtype]
    return g.n_layers * 2 * g.n_kv_heads * g.head_dim * width


# ---------------------------------------------------------------------------- the run


def schedule(kinds: list[str], restart_every: int, rng: random.Random) -> Any:
    """Endless fault sequence: restart-type faults every `restart_every`-th, others shuffled."""
    restarts = [k for k in kinds if k in ("p_kill", "held_exit")]
    cheap = [k for k in kinds if k not in restarts]
    i = 0
    r = 0
    while True:
        i += 1
        if restarts and (i % restart_every == 0 or not cheap):
            yield restarts[r % len(restarts)]
            r += 1
        else:
            yield rng.choices(cheap, weights=[WEIGHTS.get(k, 1) for k in cheap])[0]


