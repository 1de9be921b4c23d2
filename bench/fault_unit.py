"""The unit under fault injection: a real local unit, the traffic it serves and the checks.

Owns `FaultsConfig` (counts, unit shape, bounds of the checks), the prompt bank and its
reference frames (the canary), the streaming clients (`Traffic`, `stream_once`), `Unit`
(a LocalUnit whose P loads bench/fault_injection.py, with handles on P's and D's sockets,
metrics and signals) and the polls the checks wait with (`wait_until`). The scenarios
(fault_scenarios.py) and tests/ drive it. Never edits the unit's code paths: only
signals, HTTP, gRPC sockets and the fault switches P exposes.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
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

# Prompt row 0 column 0 of normal prompts stays below these (vocab 1024, EOS 1023).
CORRUPT_ID, SLOW_ID, WEDGE_ID = 1010, 1011, 1012
SLOW_PAST_DEADLINE_MS = 1200  # a slow write's pause outlasts the transfer deadline by this much
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
    if frame is None:
        raise RuntimeError("reference_frames: the prefill of the whole prompt returned no first frame")
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

    def completed(self, since: float = 0.0) -> int:
        """Streams completed; with `since` (monotonic), only those sent after it."""
        with self._lock:
            return sum(1 for o in self.outcomes if o.ok and o.t0 >= since)


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
                  "--fault-slow-ms", str(cfg.transfer_deadline_ms + SLOW_PAST_DEADLINE_MS), "--fault-wedge-id", str(WEDGE_ID),
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


