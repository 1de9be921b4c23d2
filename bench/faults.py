"""`pdunit bench faults`-style soak: the fault-injection scenario engine of PROTOCOL.md
section 7, reused by tests/faults/ (bounded and slow runs) and runnable on its own
(`python -m pdunit.bench.faults --transfers 20000 --faults 500`).

Owns: a real local unit (engine/local.py) under live traffic of many short concurrent
streams, the fault injectors, the checks after every fault, the frames canary (every
completed stream's frames equal a reference computed in this process with the same
model) and the report (transfers, faults by kind, KV checks, mismatches, pages leaked).
Transport and device are parameters, so the same engine runs under the GPU harness.

Faults (each one is injected, then checked, then the unit must be back to 0 held pages):
- `p_stop`: SIGSTOP of P while a write is in flight, past the transfer deadline, then
  SIGCONT. D fails the reservations, holds the pages, and frees them on ABORT_ACK.
- `p_kill`: SIGKILL of P mid-transfer, restarted with the same command (the pod's
  kubelet); held pages return on the new instance id.
- `lb_stop`: SIGSTOP of the LB, the consumer of D's frame stream (D's output to the LB
  stalls at the socket); D must keep stepping, no frame may be lost or wrong.
- `slow`: a write paused mid-transfer past its deadline (P's --fault-slow-id).
- `corrupt`: one flipped bit in the rows sent (P's --fault-corrupt-id): D's KV check
  must catch exactly these.
- `held_exit`: three wedged writes (P's --fault-wedge-id) P can never prove quiesced:
  P exits on purpose at 3 held aborts (the guard reports it), D drains above 25 % held
  pages meanwhile and comes back once the restarted P's new instance id frees them.
- `proxy_stop` (--transfer proxy): SIGSTOP of the nvlink-proxy while a copy job is in
  flight, past the transfer deadline, then SIGCONT.
- `tcp_stall` (--transfer tcp): a relay between P's TCP sender and D stalls, the
  chunks arrive after D aborted the request and must be dropped (proof c).
- Replays (the canary's second half): while a failed request's pages are held, a
  marker is written into them from this process (as a late sender would); with tcp,
  late chunks of released requests are sent to D's listener. No live request's frames
  may change.

Never edits the unit's code paths: it drives real processes through signals, HTTP,
their gRPC sockets and the fault-injection flags they expose.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
from pydantic import BaseModel, Field

from pdunit.bench import report
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.ports import free_port
from pdunit.engine.prefill.main import FAULT_ENV
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg

log = logging.getLogger("pdunit.bench.faults")

# Prompt row 0 column 0 of normal prompts stays below these (vocab 1024, EOS 1023).
CORRUPT_ID, SLOW_ID, WEDGE_ID = 1010, 1011, 1012
NORMAL_ID_LIMIT = 1000
# How often each kind comes up among the cheap (no restart) faults.
WEIGHTS = {"corrupt": 3, "slow": 1, "p_stop": 1, "lb_stop": 1, "tcp_stall": 2, "proxy_stop": 2}
KINDS = ("corrupt", "slow", "p_stop", "lb_stop", "p_kill", "held_exit", "tcp_stall", "proxy_stop")


class FaultsConfig(BaseModel):
    """Fault injection under live traffic: counts, unit shape, bounds of the checks."""

    transfer: str = Field("host", description="KV transport of the unit (host | tcp | proxy)")
    device: str = Field("cpu", description="torch device of P and D")
    isolate: bool = Field(False, description="run P, D and the proxy under the pod-isolation harness "
                          "(tests/gpu/harness/pod_isolate.sh: P sees only GPU 0's device node, D only GPU 1's, the "
                          "proxy all, one PID namespace): root on a 2-GPU host, --device cuda")
    model: str = Field("random:tiny:0", description="model spec (the reference uses the same)")
    kinds: str = Field("corrupt,slow,p_stop,lb_stop,p_kill,held_exit",
                       description="fault kinds to cycle through (tcp_stall needs --transfer tcp)")
    transfers: int = Field(2000, ge=0, description="run until at least this many transfers completed")
    faults: int = Field(50, ge=0, description="... and at least this many faults were injected")
    max_seconds: float = Field(600.0, gt=0, description="stop injecting after this long even if counts are short")
    clients: int = Field(8, gt=0, description="concurrent streaming clients")
    prompt_rows: tuple[int, int] = Field((16, 96), description="prompt rows of the traffic")
    frames: tuple[int, int] = Field((4, 12), description="frames per stream of the traffic")
    bank: int = Field(160, gt=0, description="distinct prompts (each has a reference)")
    seed: int = Field(0, description="traffic and fault schedule seed")
    pool_tokens: int = Field(4096, gt=0, description="D's pool rows")
    transfer_deadline_ms: int = Field(1000, gt=0, description="P's --transfer-deadline-ms (D enforces it too)")
    request_deadline_ms: int = Field(4000, gt=0, description="LB --request-deadline-ms")
    chunk_tokens: int = Field(8, ge=0, description="P writes in chunks of this many rows (so stops land mid-write)")
    chunk_delay_ms: float = Field(1.0, ge=0, description="pause between chunks")
    restart_every: int = Field(6, gt=0, description="restart-type faults (p_kill, held_exit) every n-th fault")
    rate_floor_fps: float = Field(8.0, gt=0, description="per-stream frames/s floor of unaffected streams "
                                  "on an idle machine (judge_stalls: the bound is never stricter than this)")
    max_gap_s: float = Field(0.5, gt=0, description="longest silence between two frames of an unaffected stream "
                             "on an idle machine (judge_stalls: the bound is never stricter than this)")
    stall_factor: float = Field(2.0, gt=1, description="a fault kind stalls unaffected streams when its median "
                                "fault is this many times worse than the run's own baseline (judge_stalls)")
    error_bound_s: float = Field(6.0, gt=0, description="longest request -> error time of an affected client")
    recover_timeout_s: float = Field(30.0, gt=0, description="held pages must be back to 0 within this")
    run_dir: str = Field("", description="keep the unit's sockets and process logs here (default: a temp dir)")
    out: str = Field("", description="write the full report as JSON here")
    results: str = Field("", description="also write bench/results/<this>.json/.md (e.g. faults-20261129-cpu)")


# ---------------------------------------------------------------------------- reference


@dataclass
class Prompt:
    rows: list[list[int]]
    frames: int
    temperature: float
    seed: int
    expected: list[list[int]] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        return {"prompt": self.rows, "max_frames": self.frames, "min_frames": self.frames,
                "temperature": self.temperature, "seed": self.seed}


def reference_frames(model: Any, prompt: np.ndarray, max_frames: int, min_frames: int, temperature: float,
                     seed: int) -> list[list[int]]:
    """The frames a stream must produce: prefill + decode of one request on its own
    storage, with the engine's own forward and sampling (float64 for `tiny`)."""
    from pdunit.engine.batching import SeqEntry
    from pdunit.engine.model.sampling import SamplingParams, is_eos, sample_frames
    from pdunit.engine.prefill.runner import PrefillChunk, run_forward, run_prefill

    params = SamplingParams(temperature=temperature, seed=seed, max_frames=max_frames, min_frames=min_frames)
    rows = len(prompt)
    storage = model.new_kv_storage(rows + max_frames)
    frame = run_prefill(model, storage, [PrefillChunk(prompt, np.arange(rows, dtype=np.int64), 0, rows, params)])[0]
    frames = [frame]
    eos = model.config.eos_id
    while not ((is_eos(frame, eos) and len(frames) >= min_frames) or len(frames) >= max_frames):
        pos = rows + len(frames) - 1
        entry = SeqEntry(frame.astype(np.int64)[None, :], np.array([pos], dtype=np.int64),
                         np.array([pos], dtype=np.int64), np.arange(pos + 1, dtype=np.int64))
        frame = sample_frames(run_forward(model, storage, [entry]), [params], [len(frames)], eos)[0]
        frames.append(frame)
    return [f.tolist() for f in frames]


def build_bank(cfg: FaultsConfig) -> list[Prompt]:
    import torch

    from pdunit.engine.model.loader import load_model

    torch.set_num_threads(1)
    model = load_model(cfg.model)
    rng = np.random.default_rng(cfg.seed)
    vocab = model.config.vocab_sizes
    bank = []
    for i in range(cfg.bank):
        n = int(rng.integers(cfg.prompt_rows[0], cfg.prompt_rows[1] + 1))
        rows = np.stack([rng.integers(0, min(v, NORMAL_ID_LIMIT), size=n) for v in vocab], axis=1)
        frames = int(rng.integers(cfg.frames[0], cfg.frames[1] + 1))
        temperature, seed = (0.0, 0) if i % 3 else (0.9, int(rng.integers(1, 2**31)))
        p = Prompt(rows.tolist(), frames, temperature, seed)
        p.expected = reference_frames(model, rows, frames, frames, temperature, seed)
        bank.append(p)
    return bank


def marked_prompt(marker: int, rows: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, NORMAL_ID_LIMIT, size=(rows, 11))
    prompt[0, 0] = marker
    return prompt.tolist()


# ---------------------------------------------------------------------------- traffic


@dataclass
class Outcome:
    bank: int                    # index in the bank, -1 for fault requests
    t0: float                    # monotonic: request sent
    t_end: float                 # monotonic: last record (or error) received
    frame_times: list[float]
    frames: list[list[int]]
    status: int                  # HTTP status
    code: str                    # "" when done, else the error code
    message: str = ""
    request_id: str = ""
    tag: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.code


def stream_once(client: httpx.Client, url: str, body: dict[str, Any], bank: int = -1, tag: str = "",
                timeout: float = 60.0) -> Outcome:
    t0 = time.monotonic()
    frames: list[list[int]] = []
    times: list[float] = []
    try:
        with client.stream("POST", f"{url}/v1/tts/stream", json=body, timeout=timeout) as r:
            rid = r.headers.get("x-pdunit-request-id", "")
            if r.status_code != 200:
                r.read()
                try:
                    err = r.json().get("error", {})
                except ValueError:
                    err = {"code": f"http_{r.status_code}", "message": r.text[:200]}
                return Outcome(bank, t0, time.monotonic(), [], [], r.status_code, err.get("code", "?"),
                               err.get("message", ""), rid, tag)
            last: dict[str, Any] = {}
            for line in r.iter_lines():
                if not line:
                    continue
                rec = json.loads(line)
                if "frame" in rec:
                    frames.append(rec["frame"])
                    times.append(time.monotonic())
                else:
                    last = rec
            if last.get("done"):
                return Outcome(bank, t0, time.monotonic(), times, frames, 200, "", "", rid, tag)
            err = last.get("error", {"code": "truncated", "message": "stream ended without a final record"})
            return Outcome(bank, t0, time.monotonic(), times, frames, 200, err.get("code", "?"),
                           err.get("message", ""), rid, tag)
    except httpx.HTTPError as exc:
        return Outcome(bank, t0, time.monotonic(), times, frames, 0, "client_" + type(exc).__name__, str(exc),
                       "", tag)


class Traffic:
    """`clients` threads streaming bank prompts back to back until stopped."""

    def __init__(self, url: str, bank: list[Prompt], clients: int, seed: int) -> None:
        self.url = url
        self.bank = bank
        self.clients = clients
        self.seed = seed
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True, name=f"client-{i}")
                         for i in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    def _run(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        with httpx.Client() as client:
            while not self._stop.is_set():
                k = rng.randrange(len(self.bank))
                out = stream_once(client, self.url, self.bank[k].body(), bank=k)
                with self._lock:
                    self.outcomes.append(out)
                if out.status in (429, 503) or out.status == 0:
                    time.sleep(0.25)  # Retry-After semantics, shortened: the unit is recovering

    def completed(self) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.ok)


# ---------------------------------------------------------------------------- the unit


class Unit:
    """A LocalUnit with the handles the suite needs: P/D sockets, D's metrics and debug
    ports, signals to children, P's supervised restart."""

    def __init__(self, cfg: FaultsConfig, run_dir: str | None = None, tcp_relay_port: int = 0) -> None:
        self.cfg = cfg
        self.d_metrics_port = free_port()
        self.d_debug_port = free_port()
        self.p_metrics_port = free_port()
        p_args = ["--transfer-deadline-ms", str(cfg.transfer_deadline_ms),
                  "--fault-chunk-tokens", str(cfg.chunk_tokens),
                  "--fault-chunk-delay-ms", str(cfg.chunk_delay_ms),
                  "--fault-corrupt-id", str(CORRUPT_ID), "--fault-slow-id", str(SLOW_ID),
                  "--fault-slow-ms", str(cfg.transfer_deadline_ms + 1200), "--fault-wedge-id", str(WEDGE_ID),
                  "--metrics-port", str(self.p_metrics_port)]
        if tcp_relay_port:
            p_args += ["--fault-tcp-relay", f"127.0.0.1:{tcp_relay_port}"]
        wrappers = isolation_wrappers() if cfg.isolate else {}
        # P's --fault-* switches exist only in bench/fault_injection.py, which starts only under FAULT_ENV=1
        wrappers["prefill"] = wrappers.get("prefill", []) + ["env", f"{FAULT_ENV}=1"]
        self.local = LocalUnit(LocalConfig(
            wrappers=wrappers, restart=False,  # P's restarts are the scenario's (restart_p)
            mode="pd", model=cfg.model, transfer=cfg.transfer, device=cfg.device, pool_tokens=cfg.pool_tokens,
            cache_tokens=16384, lb_port=0, guard=True, log_level="warning", run_dir=run_dir,
            prefill_module="pdunit.bench.fault_injection", extra_prefill_args=p_args,
            extra_decode_args=["--metrics-port", str(self.d_metrics_port), "--debug-port", str(self.d_debug_port)],
            extra_lb_args=["--request-deadline-ms", str(cfg.request_deadline_ms), "--probe-interval-s", "0.25",
                           "--frame-timeout-ms", "5000"],
            extra_guard_args=["--interval-ms", "100"],
        ))
        self._d = pbg.DecodeStub(grpc.insecure_channel(f"unix:{self.local.sock('decode')}"))
        self._p = pbg.PrefillStub(grpc.insecure_channel(f"unix:{self.local.sock('prefill')}"))

    def __enter__(self) -> Unit:
        self.local.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.local.__exit__(*exc)

    @property
    def url(self) -> str:
        return self.local.url

    def pid(self, name: str) -> int:
        return self.local.child(name).proc.pid

    def signal(self, name: str, sig: int) -> None:
        os.killpg(self.pid(name), sig)

    def d_info(self) -> pb.InfoReply:
        return self._d.Info(pb.Empty(), timeout=5)

    def p_info(self, timeout: float = 1.0) -> pb.InfoReply | None:
        try:
            return self._p.Info(pb.Empty(), timeout=timeout)
        except grpc.RpcError:
            return None

    def d_hello(self) -> pb.HelloReply:
        return self._d.Hello(pb.HelloRequest(), timeout=5)

    def d_metrics(self) -> dict[str, float]:
        return report.scrape_metrics(self.d_metrics_port)

    def ownership(self) -> dict[str, Any]:
        return httpx.get(f"http://127.0.0.1:{self.d_debug_port}/debug/pool", timeout=5).json()

    def guard_status(self) -> dict[str, Any]:
        return httpx.get(f"http://127.0.0.1:{self.local.guard_port}/status", timeout=5).json()

    def wait(self, predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
        return wait_until(predicate, timeout, what, interval)

    def wait_p_ready(self, timeout: float = 60.0) -> None:
        self.wait(lambda: (i := self.p_info()) is not None and i.transfer_mode != "", timeout, "P answering Info")
        self.wait(lambda: httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200, timeout, "LB ready")

    def diagnosis(self) -> str:
        """Where a stuck unit stands: D's held requests, P's held aborts, the last log
        lines of P, D and the proxy (a failed check must say why, not only that)."""
        parts = []
        try:
            held = {k: v["state"] for k, v in self.ownership()["requests"].items() if v["state"] == "held"}
            parts.append(f"D held requests: {held}")
        except (httpx.HTTPError, KeyError) as exc:
            parts.append(f"D ownership unavailable: {exc}")
        p = self.p_info()
        parts.append("P: no answer to Info" if p is None else
                     f"P: instance {p.instance_id[:8]} held_aborts {p.held_aborts} queue {p.queue} "
                     f"in_flight {p.in_flight}")
        for name in ("prefill", "decode", "proxy"):
            parts.append(f"--- {name} log tail:\n{self.local.tail(name, 25)}")
        return "\n".join(parts)

    def restart_p(self) -> None:
        self.local.restart("prefill")
        self.wait_p_ready()


def isolation_wrappers() -> dict[str, list[str]]:
    """The pod's device view for P (GPU 0), D (GPU 1) and the proxy (all GPUs), by the
    GPUs' device minors: inside, P's and D's own GPU is each one's device 0."""
    from pdunit.bench.transfer import ISOLATE, gpus

    found = gpus()
    if len(found) < 2:
        raise ValueError(f"isolate: needs 2 GPUs under /proc/driver/nvidia/gpus, found {len(found)}")
    if os.geteuid() != 0:
        raise ValueError("isolate: the harness makes mount namespaces and needs root")
    wrap = ["bash", str(ISOLATE)]
    return {"prefill": wrap + [found[0]["minor"], "--"], "decode": wrap + [found[1]["minor"], "--"],
            "proxy": wrap + ["all", "--"]}


class FaultCheckFailed(AssertionError):
    pass


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    """Polls `predicate` until it returns something truthy (returned); FaultCheckFailed
    naming `what` and the last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise FaultCheckFailed(f"timed out after {timeout:g}s waiting for {what}; last value {value!r}")


def proofs(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        m = re.match(r'pdunit_decode_held_released_total\{proof="(\w+)"\}', key)
        if m:
            out[m.group(1)] = value
    return out


def metric(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


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

    def _replay_while_held(self, rec: FaultRecord, window_s: float) -> None:
        deadline = time.monotonic() + window_s
        while time.monotonic() < deadline:
            if replay_into_held(self.unit, self.replayer, self.stats):
                rec.detail["replayed"] = True
                return
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
        # P pauses mid-write past the deadline: D holds the half-written pages meanwhile.
        self._replay_while_held(rec, self.cfg.transfer_deadline_ms / 1000 + 1.5)
        t.join()
        self._expect_error(result[0], ("transfer_failed", "deadline_exceeded"), "write paused past its deadline")
        self._recovered(rec, before, "abort_ack")
        return rec

    def p_stop(self) -> FaultRecord:
        rec = FaultRecord("p_stop", time.monotonic())
        before = proofs(self.unit.d_metrics())
        rec.detail["mid_transfer"] = self._wait_in_flight()
        self.unit.signal("prefill", signal.SIGSTOP)
        try:
            time.sleep(self.cfg.transfer_deadline_ms / 1000 + 0.3)
            rec.detail["held_while_stopped"] = self.unit.d_info().held_pages
            replay_into_held(self.unit, self.replayer, self.stats)
            time.sleep(0.3)
        finally:
            self.unit.signal("prefill", signal.SIGCONT)
        self._recovered(rec, before, "abort_ack" if rec.detail["held_while_stopped"] else None)
        return rec

    def proxy_stop(self) -> FaultRecord:
        """SIGSTOP of the nvlink-proxy mid-transfer, past the deadline: D holds the
        pages; for a job the stopped proxy holds, P cannot prove quiescence until the
        proxy runs again and finishes or drops it (the frames canary checks that no late
        copy landed in a live request's pages)."""
        rec = FaultRecord("proxy_stop", time.monotonic())
        before = proofs(self.unit.d_metrics())
        rec.detail["mid_transfer"] = self._wait_in_flight()
        self.unit.signal("proxy", signal.SIGSTOP)
        try:
            time.sleep(self.cfg.transfer_deadline_ms / 1000 + 0.3)
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
        before = proofs(self.unit.d_metrics())
        rec.detail["mid_transfer"] = self._wait_in_flight()
        old = self.unit.d_info().peer_instance_id
        self.unit.signal("prefill", signal.SIGKILL)
        time.sleep(self.cfg.transfer_deadline_ms / 1000 + 0.2)  # reservations of the dead P expire: held
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
        before = proofs(self.unit.d_metrics())
        dropped0 = metric(self.unit.d_metrics(), "pdunit_tcp_chunks_total")
        self._wait_in_flight()
        self.relay.flowing.clear()
        try:
            time.sleep(self.cfg.transfer_deadline_ms / 1000 + 0.5)
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


def run(cfg: FaultsConfig, run_dir: str | None = None) -> dict[str, Any]:
    kinds = [k.strip() for k in cfg.kinds.split(",") if k.strip()]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"kinds: unknown {sorted(unknown)}; known: {', '.join(KINDS)}")
    if "tcp_stall" in kinds and cfg.transfer != "tcp":
        raise ValueError("kinds: tcp_stall needs --transfer tcp")
    if "proxy_stop" in kinds and cfg.transfer != "proxy":
        raise ValueError("kinds: proxy_stop needs --transfer proxy")
    if cfg.isolate and cfg.device != "cuda":
        raise ValueError(f"device: --isolate needs --device cuda (each engine sees its own GPU as device 0), "
                         f"got {cfg.device!r}")
    t_bank = time.monotonic()
    bank = build_bank(cfg)
    bank_s = time.monotonic() - t_bank
    relay = None
    unit_holder: dict[str, Unit] = {}
    if cfg.transfer == "tcp":
        def target() -> tuple[str, int]:
            hello = unit_holder["unit"].d_hello()
            d = next(t for t in hello.transports if t.mode == "tcp")
            return d.params["host"], int(d.params["port"])

        relay = StallRelay(target)
    unit = Unit(cfg, run_dir, tcp_relay_port=relay.port if relay else 0)
    unit_holder["unit"] = unit
    t_start = time.monotonic()
    try:
        with unit:
            report = _drive(cfg, unit, bank, kinds, relay)
    finally:
        if relay is not None:
            relay.close()
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    report["reference_s"] = round(bank_s, 1)
    return report


def _drive(cfg: FaultsConfig, unit: Unit, bank: list[Prompt], kinds: list[str],
           relay: StallRelay | None) -> dict[str, Any]:
    scenario = Scenario(cfg, unit, bank, relay)
    traffic = Traffic(unit.url, bank, cfg.clients, cfg.seed)
    scenario.traffic = traffic
    rng = random.Random(cfg.seed)
    checks0 = unit.d_info()
    traffic.start()
    t0 = time.monotonic()
    plan = schedule(kinds, cfg.restart_every, rng)
    try:
        time.sleep(1.0)  # warm traffic before the first fault
        while time.monotonic() - t0 < cfg.max_seconds:
            if traffic.completed() >= cfg.transfers and len(scenario.faults) >= cfg.faults:
                break
            kind = next(plan)
            rec = getattr(scenario, kind)()
            rec.t_end = time.monotonic()
            if cfg.transfer == "tcp":
                scenario.replay_late_chunks(rec)
            scenario.faults.append(rec)
            log.info("fault done", extra={"kind": kind, **rec.detail})
            time.sleep(0.2)
    finally:
        traffic.stop()
    # Quiesce: nothing held, nothing in flight, every page free.
    unit.wait(lambda: (i := unit.d_info()).held_pages == 0 and i.in_flight == 0 and i.queue == 0,
              cfg.recover_timeout_s, "the unit idle after the run")
    end = unit.d_info()
    return evaluate(cfg, scenario, traffic, checks0, end, time.monotonic() - t0)


def _stream_timing(o: Outcome) -> tuple[float, float, float]:
    """(frames/s from first to last frame, longest gap s, when that gap began)."""
    t = o.frame_times
    span = t[-1] - t[0]
    rate = (len(t) - 1) / span if span > 0 else float("inf")
    i = max(range(len(t) - 1), key=lambda k: t[k + 1] - t[k])
    return rate, t[i + 1] - t[i], t[i]


def judge_stalls(cfg: FaultsConfig, completed: list[Outcome], faults: list[FaultRecord]) -> dict[str, Any]:
    """Did a kind of fault slow or stall the streams it did not touch (PROTOCOL.md 7:
    unaffected streams keep their rate)? Judged against a baseline this run measures,
    never against an idle machine's numbers: load on the machine slows every fault's
    streams alike, and with them the baseline; a D that stops stepping during one kind
    of fault slows that kind's faults alone.

    Each unaffected stream (>= 4 frames, outside every lb_stop window: that fault stalls
    its own streams' output) counts for the fault that was running (injection to the
    end of its checks, not the error window's extra second, which reaches into the next
    fault) when its longest gap between two frames began. Per fault: the longest such
    gap and the lowest such stream's frame rate. A kind's baseline is the median over the run's faults of the other
    kinds. A kind fails when its median fault's gap is over max(max_gap_s, stall_factor
    x baseline), or its rate under min(rate_floor_fps, baseline / stall_factor). One
    descheduled process pausing a stream once moves one fault, not a kind's median; a
    kind that stalls in under half of its faults, or a run of a single kind (no
    baseline), is not caught here.

    Returns the report's stall fields and `violations`; `streams_under_floor` counts the
    unaffected streams under the idle-machine bounds (a figure, not a verdict)."""
    windows = [(f.t_start, f.t_end, f.kind) for f in faults]
    lb_stops = [(f.t_start, f.t_end + 1.0) for f in faults if f.kind == "lb_stop"]
    gap_of: dict[int, float] = {}
    rate_of: dict[int, float] = {}
    rates: list[float] = []
    gaps: list[float] = []
    under: list[tuple[float, float]] = []
    for o in completed:
        if len(o.frame_times) < 4 or any(o.t0 <= b and o.t_end >= a for a, b in lb_stops):
            continue
        rate, gap, g0 = _stream_timing(o)
        rates.append(rate)
        gaps.append(gap)
        if rate < cfg.rate_floor_fps or gap > cfg.max_gap_s:
            under.append((round(rate, 1), round(gap, 3)))
        for i, (a, b, _) in enumerate(windows):
            if a <= g0 <= b:  # the fault that was running when the stream's longest gap began
                rate_of[i] = min(rate_of.get(i, float("inf")), rate)
                gap_of[i] = max(gap_of.get(i, 0.0), gap)
    violations: list[str] = []
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({k for _, _, k in windows} - {"lb_stop"}):
        mine = [i for i, (_, _, k) in enumerate(windows) if k == kind]
        kind_gaps = sorted(gap_of[i] for i in mine if i in gap_of)
        kind_rates = sorted(rate_of[i] for i in mine if i in rate_of)
        other_gaps = [g for i, g in gap_of.items() if windows[i][2] != kind]
        other_rates = [r for i, r in rate_of.items() if windows[i][2] != kind]
        row: dict[str, Any] = {"faults": len(mine), "faults_measured": len(kind_gaps)}
        if kind_gaps and other_gaps:
            median, baseline = float(np.median(kind_gaps)), float(np.median(other_gaps))
            bound = max(cfg.max_gap_s, cfg.stall_factor * baseline)
            row.update(gap_median_s=round(median, 3), gap_worst_s=round(kind_gaps[-1], 3),
                       gap_baseline_s=round(baseline, 3), gap_bound_s=round(bound, 3))
            if median > bound:
                violations.append(
                    f"{kind}: unaffected streams stalled: the median of its {len(kind_gaps)} faults' longest gap "
                    f"is {median:.3f}s, over {bound:.3f}s (max of max_gap_s {cfg.max_gap_s} and stall_factor "
                    f"{cfg.stall_factor} x {baseline:.3f}s, the median of this run's other faults); "
                    f"per fault: {[round(g, 3) for g in kind_gaps]}")
        if kind_rates and other_rates:
            median, baseline = float(np.median(kind_rates)), float(np.median(other_rates))
            bound = min(cfg.rate_floor_fps, baseline / cfg.stall_factor)
            row.update(fps_median_of_slowest=round(median, 1), fps_baseline=round(baseline, 1),
                       fps_bound=round(bound, 1))
            if median < bound:
                violations.append(
                    f"{kind}: unaffected streams slowed: the median of its {len(kind_rates)} faults' slowest stream "
                    f"ran {median:.1f} frames/s, under {bound:.1f} (min of rate_floor_fps {cfg.rate_floor_fps} and "
                    f"{baseline:.1f}, the median of this run's other faults, / stall_factor {cfg.stall_factor}); "
                    f"per fault: {[round(r, 1) for r in kind_rates]}")
        by_kind[kind] = row
    finite = sorted(r for r in rates if r != float("inf"))
    return {
        "rate_floor_fps": cfg.rate_floor_fps,
        "max_gap_s": cfg.max_gap_s,
        "stalls_by_kind": by_kind,
        "streams_under_floor": len(under),
        "stream_fps_p1": round(finite[len(finite) // 100], 1) if finite else None,
        "stream_fps_p50": round(finite[len(finite) // 2], 1) if finite else None,
        "stream_max_gap_p99_s": round(sorted(gaps)[int(len(gaps) * 0.99)], 3) if gaps else None,
        "stream_max_gap_worst_s": round(max(gaps), 3) if gaps else None,
        "violations": violations,
    }


def evaluate(cfg: FaultsConfig, scenario: Scenario, traffic: Traffic, start: pb.InfoReply, end: pb.InfoReply,
             seconds: float) -> dict[str, Any]:
    violations = list(scenario.violations)
    windows = [(f.t_start, f.t_end + 1.0, f.kind) for f in scenario.faults]

    def in_window(o: Outcome) -> set[str]:
        """The kinds of every fault window the request overlaps (empty: unaffected)."""
        return {kind for a, b, kind in windows if o.t0 <= b and o.t_end >= a}

    outcomes = traffic.outcomes
    completed = [o for o in outcomes if o.ok]
    mismatched = []
    for o in completed:
        if o.frames != scenario.bank[o.bank].expected:
            mismatched.append(o)
    if mismatched:
        o = mismatched[0]
        violations.append(f"canary: {len(mismatched)} completed streams differ from the reference "
                          f"(first: request {o.request_id}, bank {o.bank}, {len(o.frames)} frames)")
    errors = [o for o in outcomes if not o.ok]
    errors_by_code: Counter = Counter()
    outside = []
    slow_errors = []
    for o in errors:
        errors_by_code[o.code or f"http_{o.status}"] += 1
        if not in_window(o):
            outside.append(o)
        elif o.status != 200 and o.t_end - o.t0 > cfg.error_bound_s:
            slow_errors.append(o)
    if outside:
        o = outside[0]
        violations.append(f"{len(outside)} traffic requests failed outside every fault window "
                          f"(first: {o.status} {o.code}: {o.message})")
    if slow_errors:
        o = slow_errors[0]
        violations.append(f"{len(slow_errors)} affected clients waited longer than {cfg.error_bound_s}s for "
                          f"their error (worst {max(e.t_end - e.t0 for e in slow_errors):.2f}s: {o.code})")
    # Unaffected streams keep their rate: judged against this run's own baseline.
    stalls = judge_stalls(cfg, completed, scenario.faults)
    violations += stalls.pop("violations")
    faults_by_kind = Counter(f.kind for f in scenario.faults)
    corrupt_injected = faults_by_kind.get("corrupt", 0)
    checks = end.kv_checks_total - start.kv_checks_total
    mismatches = end.kv_mismatch_total - start.kv_mismatch_total
    if mismatches != corrupt_injected:
        violations.append(f"kv_mismatch_total rose by {mismatches}, injected corruptions {corrupt_injected}")
    leaked = end.pool_pages - end.free_pages
    if leaked:
        violations.append(f"{leaked} pages not free once the unit is idle")
    wedged = 3 * faults_by_kind.get("held_exit", 0)
    return {
        "seconds": round(seconds, 1),
        "transfers": checks + wedged,
        "transfers_committed": checks,
        "streams_completed": len(completed),
        "streams_failed": len(errors),
        "errors_by_code": dict(errors_by_code),
        "faults": len(scenario.faults),
        "faults_by_kind": dict(faults_by_kind),
        "fault_requests": len(scenario.fault_outcomes),
        "kv_checks": checks,
        "kv_mismatches": mismatches,
        "kv_mismatches_injected": corrupt_injected,
        "kv_mismatches_unexpected": max(0, mismatches - corrupt_injected),
        "canary_streams_checked": len(completed),
        "canary_mismatches": len(mismatched),
        "replays": dict(scenario.stats),
        "pages_leaked": leaked,
        **stalls,
        "fault_details": [{"kind": f.kind, "seconds": round(f.t_end - f.t_start, 2), **f.detail}
                          for f in scenario.faults],
        "violations": violations,
    }


def write_results(report: dict[str, Any], cfg: FaultsConfig, command: str, stem: str) -> tuple[Path, Path]:
    """bench/results/<stem>.json and .md in the BENCHMARKS.md section 6 shape."""
    import platform

    doc: dict[str, Any] = {
        "bench": "faults",
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "device": cfg.device},
        "command": command,
        "config": cfg.model_dump(),
        "rows": [{k: v for k, v in d.items()} for d in report["fault_details"]],
        "summary": {k: v for k, v in report.items() if k != "fault_details"},
    }
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    jpath, mpath = out / f"{stem}.json", out / f"{stem}.md"
    jpath.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    s: dict[str, Any] = doc["summary"]
    lines = [f"# faults — {stem}", "", f"Command: `{command}`", "",
             f"Machine: {doc['machine']['cpus']} CPUs, {doc['machine']['platform']}, device {cfg.device}, "
             f"transport {cfg.transfer}", "",
             "| transfers | faults | KV checks | mismatches (injected / unexpected) | canary mismatches | "
             "pages leaked | streams ok / failed | violations |",
             "|---|---|---|---|---|---|---|---|",
             f"| {s['transfers']} | {s['faults']} | {s['kv_checks']} | {s['kv_mismatches']} "
             f"({s['kv_mismatches_injected']} / {s['kv_mismatches_unexpected']}) | {s['canary_mismatches']} | "
             f"{s['pages_leaked']} | {s['streams_completed']} / {s['streams_failed']} | {len(s['violations'])} |",
             "", "Faults by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(s["faults_by_kind"].items())),
             "", "Errors seen by clients (all inside fault windows): "
             + ", ".join(f"{k} {v}" for k, v in sorted(s["errors_by_code"].items())),
             "", f"Replays: {s['replays']}",
             "", f"Per-stream frame rate of unaffected streams: p1 {s['stream_fps_p1']}/s, "
             f"p50 {s['stream_fps_p50']}/s; {s['streams_under_floor']} under the idle-machine floor "
             f"({s['rate_floor_fps']}/s, {s['max_gap_s']} s gaps; a figure, not the verdict)", "",
             "Stalls by kind (each kind's median fault against the run's other faults):",
             "", "| kind | faults | longest gap median / bound s | slowest stream fps median / bound |",
             "|---|---|---|---|",
             *(f"| {k} | {r['faults']} | {r.get('gap_median_s')} / {r.get('gap_bound_s')} | "
               f"{r.get('fps_median_of_slowest')} / {r.get('fps_bound')} |" for k, r in s["stalls_by_kind"].items()),
             ""]
    mpath.write_text("\n".join(lines))
    return jpath, mpath


def main(argv: list[str]) -> int:
    from pdunit.engine.observability import setup_logging
    from pdunit.engine.settings import parse_config

    cfg = parse_config(FaultsConfig, argv, "pdunit bench faults")
    setup_logging("bench-faults", "warning")
    report = run(cfg, cfg.run_dir or None)
    summary = {k: v for k, v in report.items() if k != "fault_details"}
    print(json.dumps(summary, indent=2, default=str))
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    if cfg.results:
        paths = write_results(report, cfg, "python -m pdunit.bench.faults " + " ".join(argv), cfg.results)
        print("wrote", *paths)
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
