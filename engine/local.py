"""`pdunit local`: a whole unit as local processes, started with the same commands a
pod runs (engine/unit_layout.py), for development, `make run`, tests and CPU benchmarks.

Owns the child processes: each runs in its own process group with a parent-death
signal, so neither Ctrl-C, SIGTERM nor a crash of this process leaves an orphan; once
the unit was ready it restarts a child that exits, as a kubelet does (`LocalUnit`).
It never talks to the engines itself except through the LB's HTTP API, and never calls
the unit ready before the LB it started answers as this unit (`unit_name`, drawn per
unit): a stranger on `--lb-port` is not it. Every child logs to
`<run dir>/logs/<name>.log`; so does `pdunit local` itself unless `--log-format` asks.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from pydantic import BaseModel, Field, field_validator, model_validator

from pdunit.engine.audio.pcm import wav_header
from pdunit.engine.edge import is_loopback
from pdunit.engine.lb.load import LoadDocument, LoadDocumentError, read_load_document
from pdunit.engine.observability import (
    PARENT_ENV,
    LogLevel,
    log_config,
    set_on_signals,
    setup_logging,
)
from pdunit.engine.ports import free_port
from pdunit.engine.security import write_secret_file
from pdunit.engine.settings import MonolithPolicy, TransferMode, parse_config
from pdunit.engine.unit_layout import (
    LB_PORT,
    UNIX_SOCKET_PATH_MAX,
    UnitPaths,
    UnitSpec,
    decode_names,
    metrics_block,
    metrics_port_of,
    process_metrics_port,
    unit_commands,
)
from pdunit.kernels.kv_dtype_names import KvCacheDtype

log = logging.getLogger("pdunit.local")

class LocalConfig(BaseModel):
    """Run a whole unit (LB, P, D or a monolith, sidecars) as local processes."""

    model: str = Field("random:tiny:0", description="model spec shared by every engine")
    mode: Literal["pd", "1p2d", "monolith"] = Field("pd", description="pd (P + D) | 1p2d (P + two D's; = pd "
                                                   "with --decoders 2) | monolith")
    decoders: int = Field(1, ge=1, description="pd mode: D processes fed by the one P (sockets decode-0.sock, "
                          "decode-1.sock, ... when more than one)")
    decode_devices: str = Field("", description="pd mode: torch device of each D, a comma list (default: --device)")
    policy: MonolithPolicy = Field("prefill-first", description="monolith policy: prefill-first | chunked")
    chunk_tokens: int = Field(8192, gt=0, description="monolith chunked policy: rows per iteration")
    transfer: TransferMode = Field("host", description="KV transport between P and D")
    device: str = Field("cpu", description="torch device (cpu for the local unit)")
    dtype: str | None = Field(None, description="compute/KV dtype of every engine (default: the model config's; "
                              "bfloat16 puts tiny on the GPU path)")
    kv_cache_dtype: KvCacheDtype = Field("auto", description="KV pool precision of every engine "
                                                       "(their --kv-cache-dtype)")
    prefill_gemm: Literal["bf16", "fp8"] = Field("bf16", description="GEMM precision of P's and the monolith's "
                                                 "forwards with prompt rows (their --prefill-gemm)")
    prefill_graphs: bool | None = Field(None, description="P and the monolith replay prefill CUDA graphs (their "
                                        "--prefill-graphs; default: theirs, on where the model takes the GPU path)")
    pool_tokens: int = Field(65536, gt=0, description="D's KV pool rows")
    cache_tokens: int = Field(65536, gt=0, description="prefix-cache rows of P, and of the monolith (its "
                              "--cache-tokens; 0 there turns its cache off: pass it in extra_monolith_args)")
    lb_port: int = Field(LB_PORT, ge=0, description="LB port (0 = a free one)")
    admin_host: str = Field("127.0.0.1", description="the LB's admin address (POST /v1/admin/drain); other than "
                            "loopback, the unit's run dir gets an admin token file the LB requires")
    admin_port: int = Field(0, ge=0, le=65535, description="the LB's admin port (0 = a free one)")
    metrics_port: int = Field(0, ge=0, le=65535, description="first of the processes' Prometheus ports, laid out "
                              "as a pod's spec.metricsPort: prefill (or the monolith) on it, proxy +1, guard +2, "
                              "decode i +3+i; the LB serves /metrics on its own port; 0 = none")
    run_dir: str | None = Field(None, description="sockets and logs (default: a temp dir, removed after)")
    guard: bool = Field(True, description="start the quiesce-guard sidecar when it is installed")
    load_streams: int = Field(0, ge=0, description="run a short load of this many concurrent streams, then stop")
    load_frames: int = Field(105, gt=0, description="frames per stream of the short load")
    load_prompt_rows: str = Field("1000-2000", description="prompt rows of the short load (a or a-b)")
    load_requests: int = Field(0, ge=0, description="streams in the short load (0 = 2 x load_streams)")
    load_api: Literal["frames", "speech"] = Field(
        "frames", description="the short load's API: frames (/v1/tts/stream) or speech (/v1/audio/speech, "
        "text and voices; needs --codec)")
    codec: str = Field("", description="the codec D (or the monolith) decodes audio with (their --codec, e.g. "
                       "random:mimi-tiny:0 with random:csm-tiny:0); the LB then serves /v1/audio/speech")
    voices: str = Field("", description="the LB's voice store (default with --codec: <run dir>/voices)")
    speak: str = Field("", description="after the load: speak this text through POST /v1/audio/speech (with a "
                       "demo voice uploaded first when the store has none) into --speak-out; needs --codec")
    speak_out: str = Field("out.wav", description="the WAV file --speak writes")
    speak_frames: int = Field(50, gt=0, description="most frames --speak asks for (its max_frames)")
    extra_prefill_args: list[str] = Field(default_factory=list, description="appended to P's command")
    prefill_module: str = Field("", description="run P as `python -m MODULE` with P's arguments instead of "
                                "`pdunit prefill` (the fault suite: pdunit.bench.fault_injection)")
    extra_decode_args: list[str] = Field(default_factory=list, description="appended to D's command")
    extra_monolith_args: list[str] = Field(default_factory=list, description="appended to the monolith's command")
    drain_s: float = Field(0.0, ge=0, description="on stop: how long the LB lets streams in flight finish before "
                           "it cuts them and cancels them in P and D (its --shutdown-timeout-s; a pod's LB takes "
                           "30 s); the engines stop only after the LB")
    extra_lb_args: list[str] = Field(default_factory=list, description="appended to the LB's command")
    extra_guard_args: list[str] = Field(default_factory=list, description="appended to the guard's command")
    wrappers: dict[str, list[str]] = Field(default_factory=dict, description="argv prefix per child name (the "
                                           "pod-isolation harness wraps prefill, decode and proxy on a GPU host)")
    ready_timeout_s: float = Field(120.0, gt=0, description="how long to wait for /readyz")
    rate_floor: float | None = Field(None, ge=0, description="rate-floor admission of D (or the monolith), its "
                                     "--rate-floor in frames/s: 0 = off; default: the engine's (2 x the model's "
                                     "frame rate on the GPU path, off on CPU)")
    step_model: str = Field("", description="the step-time fit file D (or the monolith) seeds its admission with "
                            "(its --step-model)")
    restart: bool = Field(True, description="restart a child that exits, after a backoff of 0.5 s doubling to "
                          "10 s (reset once it stayed up 30 s), as a pod's kubelet does; --no-restart: any "
                          "child's exit stops the unit")
    log_level: LogLevel = Field("info", description="log level of every process")
    log_format: Literal["file", "json", "text"] = Field("file", description="where pdunit local's own log goes: "
                                                        "file = <run dir>/logs/local.log as JSON lines, warnings "
                                                        "also on stderr as text; json or text = stderr in that "
                                                        "format. Every child logs JSON to <run dir>/logs/<name>.log")

    @property
    def n_decoders(self) -> int:
        return max(2, self.decoders) if self.mode == "1p2d" else self.decoders

    def decode_device_list(self) -> list[str]:
        """The torch device of each D, in decode_names order."""
        devices = [d.strip() for d in self.decode_devices.split(",") if d.strip()] or [self.device]
        return devices * self.n_decoders if len(devices) == 1 else devices

    @field_validator("load_prompt_rows")
    @classmethod
    def _rows_are_a_range(cls, v: str) -> str:
        from pdunit.engine.loadgen.workload import parse_range

        lo, _ = parse_range(v, "load_prompt_rows")
        if lo < 1:
            raise ValueError(f"load_prompt_rows {v!r}: give at least 1 row")
        return v

    @field_validator("extra_lb_args")
    @classmethod
    def _lb_keeps_its_unit_name(cls, v: list[str]) -> list[str]:
        if any(a == "--unit-name" or a.startswith("--unit-name=") for a in v):
            raise ValueError("pdunit local names its LB itself (the name is how it knows the LB that answers is "
                             "its own): drop --unit-name")
        return v

    @model_validator(mode="after")
    def _parts_fit(self) -> LocalConfig:
        devices = self.decode_device_list()
        if len(devices) != self.n_decoders:
            raise ValueError(f"--decode-devices {self.decode_devices!r} names {len(devices)} devices for "
                             f"{self.n_decoders} D's: give one device, or one per D")
        block = metrics_block(self.metrics_port, self.n_decoders)
        for name in ("lb_port", "admin_port"):
            if getattr(self, name) in block:
                raise ValueError(f"--metrics-port {self.metrics_port}: its block {block[0]}..{block[-1]} takes "
                                 f"--{name.replace('_', '-')} {getattr(self, name)}: move one of them")
        if self.speak and not self.codec:
            raise ValueError("--speak needs --codec (D turns frames into audio with it)")
        if self.load_api == "speech" and not self.codec:
            raise ValueError("--load-api speech needs --codec (D turns frames into audio with it)")
        if self.lb_port and self.lb_port == self.admin_port:
            raise ValueError(f"--admin-port {self.admin_port} is --lb-port: give the admin port another one "
                             "(or 0 for a free one)")
        return self


@dataclass
class RestartBackoff:
    """The wait before each restart of one child, as the kubelet's: `base_s` doubling up
    to `max_s`, back to `base_s` once a start stayed up `reset_after_s`."""

    base_s: float = 0.5
    max_s: float = 10.0
    reset_after_s: float = 30.0
    failures: int = 0  # exits since the last start that stayed up reset_after_s

    def next_delay(self, up_s: float) -> float:
        """The wait before starting again a child that exited after `up_s` seconds up."""
        if up_s >= self.reset_after_s:
            self.failures = 0
        delay = min(self.max_s, self.base_s * 2 ** self.failures)
        self.failures += 1
        return delay


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    backoff: RestartBackoff = field(default_factory=RestartBackoff)
    restart_at: float | None = None  # exited: when the supervisor starts it again


class Interrupted(Exception):
    """A signal asked `pdunit local` to stop while the unit was starting."""


class StartFailed(RuntimeError):
    """The unit did not start; the message says why and what to change."""


# Supervision: a child that exits after the unit was first ready is started again with
# the same command after a backoff (`RestartBackoff`), the others keep serving;
# `--no-restart` stops the whole unit instead. A child that exits before the unit was
# first ready fails the start (a command that cannot start is a configuration error, not
# a crash). With its log in the run dir, the terminal shows the unit's summary.
@dataclass
class LocalUnit:
    """Starts and stops one unit; usable from tests and benchmarks as a context manager."""

    cfg: LocalConfig
    run_dir: Path = field(init=False)
    children: list[Child] = field(default_factory=list)
    lb_port: int = 0
    admin_port: int = 0
    guard_port: int = 0
    # The LB's --unit-name: drawn per unit, it is how wait_ready knows that the LB answering
    # on lb_port is the one this unit started (a subclass with commands of its own names its
    # LB so too); lb_instance: that LB's own id, once it answered.
    unit_name: str = field(default_factory=lambda: f"local-{secrets.token_hex(6)}")
    lb_instance: str = ""
    why_not: str = ""  # what the last look at the LB found, when it was not this unit's ready LB
    # A temp run dir is removed at stop(); with keep_logs (the CLI's), all of it but logs/.
    keep_logs: bool = False
    _own_dir: bool = False
    # Set from a signal handler: start() and wait_ready() stop waiting and raise
    # Interrupted (a handler must not raise itself: see main()).
    interrupted: threading.Event = field(default_factory=threading.Event)
    # The supervisor (cfg.restart, once ready): its thread, its stop, and the lock that
    # makes a restart (its own or restart()'s) one step against a look at the children.
    _supervisor: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    _children_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.cfg.run_dir:
            self.run_dir = Path(self.cfg.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:
            # unix socket paths must stay short (108 bytes): a short temp dir
            self.run_dir = Path(tempfile.mkdtemp(prefix="pdu-"))
            self._own_dir = True
        block = metrics_block(self.cfg.metrics_port, self.n_decoders)  # LocalConfig keeps lb_port out of it
        self.lb_port = self.cfg.lb_port
        while not self.lb_port or self.lb_port in block:
            self.lb_port = free_port()
        self.admin_port = self.cfg.admin_port
        while not self.admin_port or self.admin_port in block or self.admin_port == self.lb_port:
            self.admin_port = free_port()
        self.guard_port = metrics_port_of(self.cfg.metrics_port, "guard") or free_port()
        # The unit's secrets, drawn as the operator draws the pod's Secret: the commands name them
        write_secret_file(self.unit_secret_file)
        if self.admin_token_file:
            write_secret_file(self.admin_token_file)
        if self.voices_token_file:
            write_secret_file(self.voices_token_file)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    @property
    def logs_dir(self) -> Path:
        """Where every child (and `pdunit local` itself, by default) writes its log."""
        return self.run_dir / "logs"

    @property
    def on_cpu(self) -> bool:
        return all(d == "cpu" for d in [self.cfg.device, *self.cfg.decode_device_list()])

    @property
    def admin_url(self) -> str:
        host = f"[{self.cfg.admin_host}]" if ":" in self.cfg.admin_host else self.cfg.admin_host
        return f"http://{host}:{self.admin_port}/v1/admin"

    def sock(self, name: str) -> str:
        return self.paths.sock(name)

    @property
    def unit_secret_file(self) -> str:
        """The P<->D secret (the pod's Secret key), drawn with the unit."""
        return str(self.run_dir / "unit.secret")

    @property
    def admin_token_file(self) -> str | None:
        """The LB admin bearer token, drawn with the unit; None on a loopback admin
        address, where the LB needs none."""
        return None if is_loopback(self.cfg.admin_host) else str(self.run_dir / "admin.token")

    @property
    def voices_token_file(self) -> str | None:
        """The bearer token of the voice store's writes (the LB's --voices-token-file),
        drawn with the unit; what --speak and the speech load upload with. None without a
        codec (no store)."""
        return str(self.run_dir / "voices.token") if self.cfg.codec else None

    def voices_auth(self) -> dict[str, str]:
        """The header a voice upload or delete of this unit's store needs."""
        path = self.voices_token_file
        return {"Authorization": f"Bearer {Path(path).read_text().strip()}"} if path else {}

    @property
    def n_decoders(self) -> int:
        return self.cfg.n_decoders

    @property
    def decode_names(self) -> list[str]:
        """Child (and socket) names of the D's: `decode`, or `decode-0`, `decode-1`, ..."""
        return decode_names(self.n_decoders)

    def _decode_devices(self) -> list[str]:
        return self.cfg.decode_device_list()  # LocalConfig checked that it names one per D

    def metrics_urls(self) -> dict[str, str]:
        """Child name -> its /metrics URL: the LB's and the guard's (on its HTTP port) always,
        the others' with metrics_port."""
        urls = {"lb": f"{self.url}/metrics"}
        for child in self.children:
            base = self.cfg.metrics_port
            port = self.guard_port if child.name == "guard" else process_metrics_port(base, child.name)
            if port:
                urls[child.name] = f"http://127.0.0.1:{port}/metrics"
        return urls

    @property
    def paths(self) -> UnitPaths:
        """The unit's sockets and secret files: the pod's layout in this run dir."""
        return UnitPaths(str(self.run_dir), self.unit_secret_file, self.admin_token_file, self.voices_token_file)

    def layout(self) -> UnitSpec:
        """This unit as engine/unit_layout.py describes a pod's: its paths and ports are
        this machine's, its HTTP servers listen on loopback, and the engine options of
        `pdunit local` it has of its own (pool sizes, log level, ...) are set."""
        c = self.cfg
        mono = c.mode == "monolith"
        return UnitSpec(
            model=c.model, transfer=c.transfer, mode="monolith" if mono else "pd", device=c.device,
            decode_devices=tuple(self._decode_devices()), decoders=self.n_decoders,
            kv_cache_dtype=c.kv_cache_dtype, dtype=c.dtype, prefill_gemm=c.prefill_gemm,
            prefill_graphs=c.prefill_graphs, cache_tokens=c.cache_tokens, pool_tokens=c.pool_tokens,
            monolith_policy=c.policy if mono else None, chunk_tokens=c.chunk_tokens if mono else None,
            rate_floor=c.rate_floor, step_model=c.step_model,
            codec=c.codec, voices=(c.voices or str(self.run_dir / "voices")) if c.codec else "",
            lb_port=self.lb_port, lb_host="127.0.0.1", admin_port=self.admin_port, admin_host=c.admin_host,
            unit_name=self.unit_name, metrics_port=c.metrics_port,
            guard=c.guard and _installed("pdunit.sidecars.quiesce_guard.main"), guard_port=self.guard_port,
            guard_host="127.0.0.1", log_level=c.log_level,
            extra_args={"prefill": c.extra_prefill_args, "decode": c.extra_decode_args,
                        "lb": ["--shutdown-timeout-s", f"{c.drain_s:g}", *c.extra_lb_args],
                        "monolith": c.extra_monolith_args, "guard": c.extra_guard_args},
            paths=self.paths, program=(sys.executable, "-m", "pdunit.engine.cli"),
        )

    def commands(self) -> list[tuple[str, list[str]]]:
        """The commands the pod's containers run (engine/unit_layout.unit_commands), in
        start order; `prefill_module` swaps P's program only."""
        spec = self.layout()
        cmds = unit_commands(spec)
        if self.cfg.prefill_module and "prefill" in cmds:
            args = cmds["prefill"][len(spec.program) + 1:]  # after `<program> prefill`
            cmds["prefill"] = [sys.executable, "-m", self.cfg.prefill_module, *args]
        return list(cmds.items())

    def start(self) -> LocalUnit:
        """Starts every child. A --lb-port or --admin-port that another process holds now
        fails the start before any child runs (wait_ready's identity check still catches
        one taken later)."""
        for flag, host, port in (("--lb-port", "127.0.0.1", self.cfg.lb_port),
                                 ("--admin-port", self.cfg.admin_host, self.cfg.admin_port)):
            reason = _cannot_listen(host, port) if port else None
            if reason:
                raise StartFailed(f"{flag} {port}: cannot listen on {host}:{port} ({reason}); another process "
                                  f"holds it: stop that process, or give {flag} 0 for a free port")
        too_long = self.paths.too_long_socket(self.n_decoders)
        if too_long:
            raise StartFailed(f"--run-dir {self.run_dir}: the unit's socket {too_long} is {len(too_long.encode())} "
                              f"bytes, over the {UNIX_SOCKET_PATH_MAX} a unix socket path holds: give a shorter "
                              "--run-dir (or none: a short temp dir)")
        self.logs_dir.mkdir(exist_ok=True)
        for name, argv in self.commands():
            argv = self.cfg.wrappers.get(name, []) + argv
            log_path = self.logs_dir / f"{name}.log"
            self.children.append(Child(name, argv, _spawn(argv, log_path), log_path))
            log.info("started", extra={"child": name, "pid": self.children[-1].proc.pid,
                                       "cmd": " ".join(argv[2:])})
            if name == "proxy":
                self._wait_proxy()  # D and P register with it at start: it must listen first
        return self

    def _wait_proxy(self) -> None:
        proc = self.child("proxy").proc
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        paths = [Path(self.sock("proxy")), Path(self.sock("proxy") + ".auth")]
        while not all(p.exists() for p in paths):
            self._check_interrupted()
            if proc.poll() is not None:
                raise StartFailed(f"proxy exited with {proc.returncode}; its log:\n{self.tail('proxy')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"proxy sockets {[str(p) for p in paths]} absent after {self.cfg.ready_timeout_s}s")
            time.sleep(0.05)

    def restart(self, name: str, timeout_s: float = 10.0) -> Child:
        """Start `name` again now with the same command and log file, once its old process
        is gone (a test's or the fault suite's restart; the supervisor's waits its
        backoff). A child still running is SIGKILLed first (its process group, so nothing
        of it survives)."""
        child = self.child(name)
        with self._children_lock:
            if child.proc.poll() is None:
                _signal_group(child.proc, signal.SIGCONT)
                _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait(timeout=timeout_s)
            self._respawn(child)
        return child

    def _respawn(self, child: Child) -> None:
        """A new process for `child` (its old one has exited); the caller holds _children_lock."""
        old = child.proc.returncode
        child.proc = _spawn(child.argv, child.log_path)
        child.started_at = time.monotonic()
        child.restart_at = None
        child.restarts += 1
        log.warning("restarted", extra={"child": child.name, "pid": child.proc.pid, "previous_exit": old,
                                        "restarts": child.restarts})

    @property
    def supervising(self) -> bool:
        return self._supervisor is not None

    def supervise(self) -> None:
        """From now on, restart every child that exits (cfg.restart; the kubelet's job in a
        pod), on a thread of its own until stop(). Without cfg.restart nothing happens:
        the caller watches the children (main() stops the unit at the first exit)."""
        if not self.cfg.restart or self._supervisor is not None:
            return
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        recovering = False  # a child was restarted and the unit has not been ready since
        while not self._stopping.wait(0.1):
            recovering |= self.supervise_once(time.monotonic())
            if recovering and self.answers_ready(timeout_s=0.5):
                recovering = False
                log.info("unit ready again", extra={"restarts": json.dumps(self.restarts()),
                                                    "lb_instance": self.lb_instance})

    def supervise_once(self, now: float) -> bool:
        """One look at the children: an exit found is logged and its restart scheduled
        after the child's backoff; a restart that is due is done. True when one was."""
        restarted = False
        with self._children_lock:
            for child in self.children:
                if self._stopping.is_set():
                    return restarted
                code = child.proc.poll()
                if code is None:
                    continue
                if child.restart_at is None:
                    delay = child.backoff.next_delay(now - child.started_at)
                    child.restart_at = now + delay
                    log.warning("child exited: restarting it after its backoff", extra={
                        "child": child.name, "exit_code": code, "attempt": child.restarts + 1,
                        "backoff_s": delay, "up_s": round(now - child.started_at, 1)})
                elif now >= child.restart_at:
                    self._respawn(child)
                    restarted = True
        return restarted

    def restarts(self) -> dict[str, int]:
        """Child name -> how many times it was started again."""
        return {c.name: c.restarts for c in self.children}

    def answers_ready(self, timeout_s: float = 1.0) -> bool:
        """Whether the LB on `url` is this unit's and ready: its /readyz answers 200 and its
        /v1/load names `unit_name` (then `lb_instance` is its id). `why_not` says what
        the last look found otherwise."""
        try:
            r = httpx.get(f"{self.url}/readyz", timeout=timeout_s)
            if r.status_code != 200:
                self.why_not = f"/readyz answers {r.status_code}: {r.text[:300]}"
                return False
            doc = read_load_document(httpx.get(f"{self.url}/v1/load", timeout=max(timeout_s, 5.0)).content)
        except httpx.HTTPError as exc:
            self.why_not = f"{self.url}: {exc or type(exc).__name__}"
            return False
        except LoadDocumentError as exc:  # our LB always answers one: this is not it
            self.why_not = f"{self.url}/v1/load: {exc}: another process holds port {self.lb_port}"
            return False
        if doc.unit != self.unit_name:
            self.why_not = (f"{self.url} answers as unit {doc.unit!r}, not as this unit's LB ({self.unit_name}): "
                            f"another process holds port {self.lb_port}")
            return False
        self.lb_instance = doc.lb_instance
        return True

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until the LB this unit started answers ready (`answers_ready`). Before
        supervision, a child that exits fails the wait at once; under it (after a restart)
        its restart is waited for."""
        deadline = time.monotonic() + (timeout_s or self.cfg.ready_timeout_s)
        self.why_not = ""
        stranger = ""  # a look that found another unit's LB on the port: decisive, kept over later timeouts
        while time.monotonic() < deadline:
            self._check_interrupted()
            for child in self.children if not self.supervising else []:
                if child.proc.poll() is not None:
                    seen = f"\n(before it exited: {self.why_not})" if self.why_not else ""
                    raise StartFailed(f"{child.name} exited with {child.proc.returncode} before the unit was "
                                      f"ready; its log ({child.log_path}):\n{self.tail(child.name)}{seen}")
            if self.answers_ready():
                log.info("unit ready", extra={"url": self.url, "unit_name": self.unit_name,
                                              "lb_instance": self.lb_instance})
                return
            if "another process holds port" in self.why_not:
                stranger = self.why_not
            self.interrupted.wait(0.2)
        raise TimeoutError(f"unit not ready after {timeout_s or self.cfg.ready_timeout_s}s: "
                           f"{stranger or self.why_not}")

    def _check_interrupted(self) -> None:
        if self.interrupted.is_set():
            raise Interrupted("stopped before the unit was ready")

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.child(name).log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, StopIteration):
            return ""

    def stop(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM the LB and wait for its exit, then every other child; SIGKILL whatever
        outlives its timeout_s. The LB goes alone first: new streams stop entering while the
        engines still serve its drain (cfg.drain_s) and answer its cancels (signalled with it,
        they were gone and it retried its cancels to them). The supervisor stops first:
        nothing stopped here is started again."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=timeout_s)
        first = [c for c in self.children if c.name == "lb"]
        self._terminate(first, timeout_s)
        self._terminate([c for c in reversed(self.children) if c not in first], timeout_s)
        codes: dict[str, int | None] = {c.name: c.proc.returncode for c in self.children}
        if self._own_dir and self.keep_logs:
            for path in self.run_dir.iterdir():  # sockets and secrets go, the logs stay
                if path.is_dir() and path != self.logs_dir:
                    shutil.rmtree(path, ignore_errors=True)
                elif not path.is_dir():
                    path.unlink(missing_ok=True)
        elif self._own_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return codes

    def _terminate(self, children: list[Child], timeout_s: float) -> None:
        """SIGTERM `children` together, wait up to timeout_s for them all, SIGKILL the rest."""
        for child in children:
            if child.proc.poll() is None:
                _signal_group(child.proc, signal.SIGCONT)  # a stopped child cannot handle SIGTERM
                _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("did not stop on SIGTERM: killing", extra={"child": child.name})
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait(timeout=5)

    def __enter__(self) -> LocalUnit:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.supervise()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **{PARENT_ENV: str(os.getpid())})
    with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
        # own session and process group (stop() signals the group), set up by C code
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _cannot_listen(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port now (None: it could), binding as the LB
    binds (engine/edge.bind_socket: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def run_short_load(unit: LocalUnit) -> dict:
    from pdunit.engine.loadgen.driver import LoadConfig, run_load
    from pdunit.engine.loadgen.workload import parse_range

    c = unit.cfg
    lo, hi = parse_range(c.load_prompt_rows, "load_prompt_rows")
    cfg = LoadConfig(
        url=unit.url, concurrency=[c.load_streams], requests=c.load_requests or 2 * c.load_streams,
        prompt_rows=(lo, hi), frames=(c.load_frames, c.load_frames), mode_label=f"local-{c.mode}",
        gpus=0, api=c.load_api, voices_token_file=unit.voices_token_file or "",
    )
    return run_load(cfg)


DEMO_VOICE = "pdunit-demo"


def demo_clip(sample_rate: int, seconds: float = 2.0) -> bytes:
    """A synthetic voice clip (a gliding tone with a little noise), 16-bit PCM: a stand-in
    for a person's recording, so `--speak` runs without any file."""
    from pdunit.engine.audio.pcm import float_to_pcm16

    t = np.arange(int(sample_rate * seconds)) / sample_rate
    tone = 0.3 * np.sin(2 * np.pi * (0.05 * sample_rate + 0.02 * sample_rate * t) * t)
    noise = 0.02 * np.random.default_rng(0).standard_normal(t.size)
    return float_to_pcm16(tone + noise)


def speak(unit: LocalUnit) -> dict[str, Any]:
    """--speak: one POST /v1/audio/speech (WAV), written to --speak-out as it comes; the demo
    voice is uploaded first when the store lacks it. Returns what print_speech reports."""
    c = unit.cfg
    with httpx.Client(base_url=unit.url, timeout=120) as h:
        audio = h.get("/v1/model").raise_for_status().json()["audio"]
        rate = int(audio["sample_rate"])
        if h.get(f"/v1/voices/{DEMO_VOICE}").status_code == 404:
            clip = base64.b64encode(demo_clip(rate)).decode()
            h.post("/v1/voices", json={"name": DEMO_VOICE, "transcript": "This is a demo voice.", "audio": clip,
                                       "audio_format": "pcm"}, headers=unit.voices_auth()).raise_for_status()
        body = {"model": c.model, "voice": DEMO_VOICE, "input": c.speak, "response_format": "wav",
                "max_frames": c.speak_frames}
        path = Path(c.speak_out).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        first_byte: float | None = None
        size = 0
        with h.stream("POST", "/v1/audio/speech", json=body) as resp, path.open("wb") as out:
            if resp.status_code != 200:
                resp.read()
                raise RuntimeError(f"POST /v1/audio/speech answered {resp.status_code}: {resp.text}")
            for chunk in resp.iter_bytes():
                if first_byte is None:
                    first_byte = time.perf_counter() - start
                out.write(chunk)
                size += len(chunk)
            samples = max(0, size - 44) // 2
            out.seek(0)  # the streamed header said "unknown length": patch in the real one
            out.write(wav_header(rate, samples))
    return {"path": str(path), "samples": samples, "rate": rate, "frames": samples // int(audio["samples_per_frame"]),
            "first_byte_s": first_byte or 0.0, "seconds": time.perf_counter() - start}


def print_speech(unit: LocalUnit, spoken: dict[str, Any]) -> int:
    c = unit.cfg
    duration = spoken["samples"] / spoken["rate"]
    print(f"\nspeech: {spoken['path']}: {duration:.2f} s of audio ({spoken['frames']} frames, "
          f"{spoken['rate']} Hz, 16-bit mono); first audio byte after {1000 * spoken['first_byte_s']:.0f} ms, "
          f"all of it after {spoken['seconds']:.2f} s", flush=True)
    if c.model.startswith("random:") or c.codec.startswith("random:"):
        print(f"        it is noise: {c.model} and {c.codec} have random weights; the text went through the "
              "tokenizer, the prompt, the engines and the codec, but nothing learned to speak", flush=True)
    return 0 if spoken["samples"] else 1


def _run_interruptibly(unit: LocalUnit, work: Callable[[LocalUnit], dict]) -> dict | None:
    """`work(unit)` on a thread of its own, its result; None when a signal came first (the
    unit's stop then ends the work's requests, and the daemon thread with the process)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = work(unit)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="short-load", daemon=True)
    thread.start()
    while thread.is_alive() and not unit.interrupted.wait(0.2):
        pass
    if thread.is_alive():
        return None
    if "error" in out:
        raise out["error"]
    return out["result"]


def print_short_load(unit: LocalUnit, result: dict[str, Any], load: LoadDocument) -> int:
    """The short load's report for a person: the stream table, what its pass column
    judges, the KV counters and the verdict; returns the exit code (1: a stream failed or a
    KV check mismatched; the pass column's capacity criteria do not decide it)."""
    from pdunit.engine.loadgen.driver import COLUMNS, pass_criteria
    from pdunit.engine.loadgen.summary import text_table

    m = result["machine"]
    gpu = f"{m['gpu_count']} x {m['gpu_model']}" if m["gpu_count"] else "no GPU"
    print(f"\nmachine: {gpu}; {m['cpu_count']} CPUs ({m['cpu_model']})")
    print(text_table(result["rows"], COLUMNS))
    for row in result["rows"]:
        if row["error_kinds"]:
            print(f"stream errors at {row['concurrency']} streams: {row['error_kinds']}")
    print(f"pass: the GPU criteria: {pass_criteria(result['config'])}")
    if unit.on_cpu:
        print("      this unit runs on the CPU, where they are not expected to hold (pass False is no fault); "
              "here the run checks that every stream completes and every KV check matches")
    checks, mismatches = load.kv_checks_total, load.kv_mismatch_total
    print(f"KV checks: {checks}  mismatches: {mismatches}  held pages: {load.held_pages}  "
          f"transfer: {load.transfer_mode}")
    streams = sum(r.get("streams", 0) for r in result["rows"])
    errors = sum(r.get("errors", 0) for r in result["rows"])
    if errors or mismatches:
        print(f"result: FAILED (exit 1): {errors} of {streams} streams failed, {mismatches} KV mismatches; "
              f"the logs are in {unit.logs_dir}")
        return 1
    print(f"result: OK (exit 0): {streams} of {streams} streams completed without an error, {checks} KV checks, "
          f"no mismatch")
    return 0


def main(argv: list[str]) -> int:
    cfg = parse_config(LocalConfig, argv, "pdunit local")
    unit = LocalUnit(cfg)
    unit.keep_logs = True  # a temp run dir loses its sockets and secrets at stop, never the logs it printed
    unit.logs_dir.mkdir(exist_ok=True)
    to_file = cfg.log_format == "file"
    setup_logging("local", cfg.log_level, "text" if cfg.log_format == "file" else cfg.log_format,
                  unit.logs_dir / "local.log" if to_file else None)
    log_config(log, cfg)
    print(f"pdunit local: starting a {cfg.mode} unit; every process logs to {unit.logs_dir}/<name>.log"
          + (" (this one's warnings also here)" if to_file else ""), file=sys.stderr, flush=True)

    # Ctrl-C / SIGTERM: stop the children, then exit 0. The signals set an event that
    # every wait below watches (through a pipe: set_on_signals). Raising KeyboardInterrupt
    # from a handler (Python's way) lost the signal when it landed in the GC callback that
    # times collections (the exception is reported there and dropped, and the unit kept
    # serving), or inside Popen.poll() between its lock's acquire and release (every later
    # wait on that child then times out).
    set_on_signals(unit.interrupted)
    try:
        try:
            unit.start()
            unit.wait_ready()
        except (StartFailed, TimeoutError) as exc:
            # the terminal's copy is the print (readable with the child's log tail); the log
            # keeps it at info, so that file mode's warnings on stderr do not show it twice
            log.info("the unit did not start", extra={"reason": str(exc)})
            print(f"pdunit local: the unit did not start: {exc}", file=sys.stderr)
            return 1
        print(f"unit ready at {unit.url}  (unit {unit.unit_name}, LB instance {unit.lb_instance[:8]}; logs: "
              f"{unit.logs_dir})", flush=True)
        print("metrics: " + "  ".join(f"{name} {url}" for name, url in unit.metrics_urls().items()), flush=True)
        token = unit.admin_token_file
        print(f"admin: {unit.admin_url}" + (f"  (bearer token in {token})" if token else ""), flush=True)
        if unit.voices_token_file:
            print(f"voices: {unit.url}/v1/voices  (uploads and deletes: the bearer token in "
                  f"{unit.voices_token_file})", flush=True)
        unit.supervise()
        if cfg.load_streams or cfg.speak:
            code = 0
            if cfg.load_streams:
                print(f"load: {cfg.load_requests or 2 * cfg.load_streams} streams of {cfg.load_frames} frames, "
                      f"{cfg.load_streams} at a time", flush=True)
                result = _run_interruptibly(unit, run_short_load)
                if result is None:
                    return 0
                load = read_load_document(httpx.get(f"{unit.url}/v1/load", timeout=5).content)
                code = print_short_load(unit, result, load)
            if cfg.speak:
                try:
                    spoken = _run_interruptibly(unit, speak)
                except (httpx.HTTPError, RuntimeError, OSError, KeyError, TypeError) as exc:
                    print(f"speech: FAILED: {exc}; the logs are in {unit.logs_dir}", file=sys.stderr, flush=True)
                    return 1
                if spoken is None:
                    return 0
                code = max(code, print_speech(unit, spoken))
            return code
        print("Ctrl-C stops the unit" + (" (a child that exits is restarted)." if cfg.restart else
                                         "; so does any child's exit (--no-restart)."), flush=True)
        while not unit.interrupted.is_set() and (cfg.restart or all(c.proc.poll() is None for c in unit.children)):
            unit.interrupted.wait(0.5)
        if unit.interrupted.is_set():
            return 0
        dead = [c for c in unit.children if c.proc.poll() is not None]
        for c in dead:
            print(f"{c.name} exited with {c.proc.returncode}:\n{unit.tail(c.name)}", file=sys.stderr)
        return 1
    except Interrupted:
        return 0
    finally:
        codes = unit.stop()
        log.info("unit stopped", extra={"exit_codes": json.dumps(codes), "restarts": json.dumps(unit.restarts())})
        print(f"pdunit local: stopped; the logs are in {unit.logs_dir}", file=sys.stderr, flush=True)
