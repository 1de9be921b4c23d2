"""Probe: does the upstream Mooncake transfer engine move one pdunit KV request between
two GPUs of this host, how fast, and bit-exactly? (issue 4, item 6; BENCHMARKS.md s. 2/6)

Owns: running PyPI `mooncake-transfer-engine-cuda13` (`mooncake.engine.TransferEngine`)
on the request shape of `bench/transfer.py` -- a KV pool [layers, 2, slots, kv_heads,
head_dim] bf16, source pool ("P") on one GPU, destination pool ("D") on another, a
2048-token request laid out contiguously and fully fragmented -- once per transport the
engine can select ("nvlink_intra", "nvlink", "tcp", "tcp_tuned" -- tcp with the
per-peer queue limits raised as TCP deployments do -- and "rdma" where RDMA devices
exist), and writing one JSON with, per transport, either timings that passed a bit-exact
check or the exact stage and error where it stopped.

How the engine is driven (learned from mooncake/engine.pyi and the engine's sources):
`TransferEngine.initialize(local_hostname, "P2PHANDSHAKE", protocol, device_name)`
needs no metadata server; a peer's segment is then named "host:<get_rpc_port()>". The
`protocol` string chooses the Python allocator (and initialize refuses one the build
lacks); the data transport is chosen at initialize from environment variables
(MC_INTRANODE_NVLINK -> "nvlink_intra", MC_FORCE_TCP -> "tcp", MC_FORCE_MNNVL ->
"nvlink", MC_FORCE_HCA -> "rdma", otherwise rdma if an HCA is found, else tcp), and the
engine may quietly install another one than asked. So every attempt
reads the engine's own log line ("Using ... transport") and a transport other than the
one asked for is reported as a failure of that attempt, never measured under its name.

Each attempt runs in two fresh processes (the target D and the initiator P: the
intra-node transport opens D's memory with cudaIpcOpenMemHandle, which cannot open a
handle of its own process), with a time limit, so a hung or crashing C++ call ends that
attempt and no other. P streams its progress as JSON lines; what it reported before a
timeout or crash is kept.

Must never: report a case as a success unless every transfer call returned 0 and D
verified every destination row equal to its source row and every row outside the
destination slots unchanged; import pdunit (it runs from a bare checkout on the device
machine: torch, numpy, the standard library and mooncake only); leave a child process
running.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

SEED_SRC, SEED_DST, LAYOUT_SEED = 11, 29, 7

# TCP's per-peer admission limits at the largest counts the engine accepts (65535), as
# vLLM/Dynamo TCP deployments set them, and a queued-bytes cap above one request (1 GiB);
# the defaults (1024 transfers) reject big batches.
_TCP_TUNED = {"MC_TCP_LANES_PER_PEER": "8", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
              "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535", "MC_TCP_ADMISSION_TIMEOUT_MS": "120000",
              "MC_TCP_MAX_QUEUED_BYTES_PER_PEER": str(1 << 30)}


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One way of running the engine: the protocol string given to initialize, and the
    environment that makes the engine install that data transport."""

    protocol: str
    env: dict[str, str]


ATTEMPTS: dict[str, Attempt] = {
    "nvlink_intra": Attempt("nvlink_intra", {"MC_INTRANODE_NVLINK": "1"}),
    "nvlink": Attempt("nvlink", {"MC_FORCE_MNNVL": "1"}),
    "tcp": Attempt("tcp", {"MC_FORCE_TCP": "1"}),
    "tcp_tuned": Attempt("tcp", {"MC_FORCE_TCP": "1", **_TCP_TUNED}),
    "rdma": Attempt("rdma", {"MC_FORCE_HCA": "1"}),
}
PROTOCOLS = tuple(ATTEMPTS)
# Presence, not value, is what the engine tests (getenv(...) != nullptr): a variable
# set to "0" still selects. Every attempt therefore starts from none of these.
SELECTOR_VARS = ("MC_INTRANODE_NVLINK", "MC_FORCE_MNNVL", "MC_FORCE_TCP", "MC_FORCE_HCA",
                 "MC_FORCE_SHM", "MC_USE_NVLINK_IPC", *_TCP_TUNED)
# The engine's log line that names the data transport it installed.
TRANSPORT_LINES = (
    (re.compile(r"Using Intra-Node NVLink transport"), "nvlink_intra"),
    (re.compile(r"Using (cross-node )?NVLink transport"), "nvlink"),
    (re.compile(r"Using RDMA transport \(|installTransport, type=rdma"), "rdma"),
    (re.compile(r"Using TCP transport \(|installTransport, type=tcp|using TCP transport only"), "tcp"),
    (re.compile(r"using SHM transport only"), "shm"),
)
CASES = ("single", "contiguous", "fragmented", "fragmented_pages")
PROBE_ROWS = 1024


# ====================================================================== request shape
@dataclasses.dataclass(frozen=True)
class Geometry:
    """One KV pool: [layers, 2 (k/v), n_slots, kv_heads, head_dim], 2-byte elements."""

    layers: int = 36
    kv_heads: int = 8
    head_dim: int = 128
    n_slots: int = 8192
    elem_bytes: int = 2

    @property
    def planes(self) -> int:
        return self.layers * 2

    @property
    def row_elems(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.elem_bytes

    @property
    def token_bytes(self) -> int:
        return self.planes * self.row_bytes

    @property
    def pool_bytes(self) -> int:
        return self.planes * self.n_slots * self.row_bytes

    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.n_slots, self.kv_heads, self.head_dim)


def request_layouts(tokens: int, n_slots: int, seed: int = LAYOUT_SEED) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(source slots, destination slots) of one request, as bench/transfer.py lays it out:
    contiguous runs at a quarter and at half of the pool, or two independent random
    permutations (every slot distinct on each side)."""
    if tokens < 1:
        raise ValueError(f"tokens={tokens}: a request needs at least one token")
    base = n_slots // 4
    if 2 * base + tokens > n_slots:
        raise ValueError(f"tokens={tokens} does not fit a pool of n_slots={n_slots}: "
                         f"the contiguous layout needs n_slots >= 2*tokens")
    rng = np.random.default_rng(seed)
    return {
        "contiguous": (np.arange(tokens, dtype=np.int64) + base, np.arange(tokens, dtype=np.int64) + 2 * base),
        "fragmented": (rng.permutation(n_slots)[:tokens].astype(np.int64),
                       rng.permutation(n_slots)[:tokens].astype(np.int64)),
    }


@dataclasses.dataclass(frozen=True)
class Segments:
    """Byte copies, offsets relative to each pool's base: src[i] -> dst[i], length[i]."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def head(self, n: int) -> Segments:
        return Segments(self.src[:n], self.dst[:n], self.length[:n])


def plan_segments(geo: Geometry, src_slots: np.ndarray, dst_slots: np.ndarray, *, coalesce: bool = True) -> Segments:
    """One copy per (plane, run of rows), plane-major. With `coalesce`, consecutive rows
    whose source AND destination slots both advance by one merge into one copy (what
    upstream connectors do): the contiguous layout becomes one segment per plane, a
    fully fragmented one stays about one copy per row."""
    s = np.asarray(src_slots, dtype=np.int64)
    t = np.asarray(dst_slots, dtype=np.int64)
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"src_slots {s.shape} and dst_slots {t.shape} must be 1-D of one length")
    for name, v in (("src_slots", s), ("dst_slots", t)):
        if v.size and (v.min() < 0 or v.max() >= geo.n_slots):
            raise ValueError(f"{name} out of range [0, {geo.n_slots})")
        if np.unique(v).size != v.size:
            raise ValueError(f"{name} has repeated slots: a request's slots must be distinct")
    brk = np.ones(s.size, dtype=bool)
    if coalesce:
        brk[1:] = (s[1:] != s[:-1] + 1) | (t[1:] != t[:-1] + 1)
    starts = np.flatnonzero(brk)
    runs = np.diff(np.append(starts, s.size))
    plane = np.arange(geo.planes, dtype=np.int64)[:, None] * geo.n_slots
    row = geo.row_bytes
    src = ((plane + s[starts][None, :]) * row).ravel().astype(np.uint64)
    dst = ((plane + t[starts][None, :]) * row).ravel().astype(np.uint64)
    length = np.broadcast_to(runs * row, (geo.planes, starts.size)).ravel().astype(np.uint64)
    return Segments(src, dst, length)


def page_fields(geo: Geometry, src_base: int, dst_base: int) -> np.ndarray:
    """The [planes, 5] int64 table of batch_transfer_sync_write_pages: per plane
    (src_base, src_stride, dst_base, dst_stride, length); page i of field f copies
    `length` bytes from src_base + src_pages[i]*src_stride to dst_base + dst_pages[i]*dst_stride."""
    plane_bytes = geo.n_slots * geo.row_bytes
    p = np.arange(geo.planes, dtype=np.int64)
    f = np.empty((geo.planes, 5), dtype=np.int64)
    f[:, 0] = src_base + p * plane_bytes
    f[:, 1] = geo.row_bytes
    f[:, 2] = dst_base + p * plane_bytes
    f[:, 3] = geo.row_bytes
    f[:, 4] = geo.row_bytes
    return f


# ====================================================================== content + checks
def pattern_words(seed: int, index: Any) -> Any:
    """A deterministic 16-bit word per global element index (int64 tensor), computed on
    the index's device, so D can recompute P's rows without seeing P's memory. The shifts
    fold high bits down, so rows 64 apart do not repeat each other."""
    import torch

    v = index * 0x2545F491 + seed * 0x3C6EF372
    v = v ^ (v >> 23) ^ (v >> 41)
    return ((v & 0xFFFF) - 32768).to(torch.int16)


def fill_pattern(pool: Any, seed: int, chunk: int = 1 << 24) -> None:
    """Write pattern_words(seed, flat element index) into a contiguous 2-byte pool."""
    import torch

    flat = pool.view(torch.int16).view(-1)
    for lo in range(0, flat.numel(), chunk):
        hi = min(lo + chunk, flat.numel())
        flat[lo:hi] = pattern_words(seed, torch.arange(lo, hi, dtype=torch.int64, device=pool.device))


def _plane_words(pool: Any, geo: Geometry) -> Any:
    import torch

    if tuple(pool.shape) != geo.shape() or not pool.is_contiguous():
        raise ValueError(f"pool shape {tuple(pool.shape)} is not the contiguous {geo.shape()}")
    return pool.view(torch.int16).view(geo.planes, geo.n_slots, geo.row_elems)


def _verdict(bad: int, clobbered: int, checked: int, first: list[int] | None) -> dict[str, Any]:
    where = None if first is None else {"layer": first[0] // 2, "kv": first[0] % 2, "slot": first[1]}
    return {"ok": bad == 0 and clobbered == 0, "rows_checked": checked, "bad_rows": bad,
            "clobbered_rows": clobbered, "first_mismatch": where}


def check_rows(pool: Any, geo: Geometry, src_slots: Any, dst_slots: Any,
               seed_src: int = SEED_SRC, seed_dst: int = SEED_DST) -> dict[str, Any]:
    """D's pool after a request: every destination row must hold the source pool's row
    (pattern seed_src), every other row its own earlier content (pattern seed_dst).
    Counts rows, per plane, so a wrong row is named by (layer, kv, slot)."""
    import torch

    words = _plane_words(pool, geo)
    dev = pool.device
    s = torch.as_tensor(np.asarray(src_slots, dtype=np.int64), device=dev)
    t = torch.as_tensor(np.asarray(dst_slots, dtype=np.int64), device=dev)
    in_dst = torch.zeros(geo.n_slots, dtype=torch.bool, device=dev)
    in_dst[t] = True
    e = torch.arange(geo.row_elems, dtype=torch.int64, device=dev)
    plane_idx = torch.arange(geo.n_slots * geo.row_elems, dtype=torch.int64, device=dev)
    bad = clobbered = 0
    first: list[int] | None = None
    for p in range(geo.planes):
        plane0 = p * geo.n_slots
        expected = pattern_words(seed_dst, plane0 * geo.row_elems + plane_idx).view(geo.n_slots, geo.row_elems)
        expected[t] = pattern_words(seed_src, (plane0 + s)[:, None] * geo.row_elems + e[None, :])
        diff = (words[p] != expected).any(dim=1)
        bad += int((diff & in_dst).sum())
        clobbered += int((diff & ~in_dst).sum())
        if first is None and bool(diff.any()):
            first = [p, int(torch.nonzero(diff)[0, 0])]
    return _verdict(bad, clobbered, geo.planes * int(t.numel()), first)


def check_flat(pool: Any, geo: Geometry, nbytes: int,
               seed_src: int = SEED_SRC, seed_dst: int = SEED_DST) -> dict[str, Any]:
    """D's pool after one flat write of the first `nbytes` of P's pool to the first
    `nbytes` of D's: rows below nbytes hold P's content, every row above it D's own."""
    import torch

    if nbytes % geo.row_bytes or not 0 < nbytes <= geo.pool_bytes:
        raise ValueError(f"nbytes={nbytes} must be a positive multiple of the row ({geo.row_bytes} B) "
                         f"within the pool ({geo.pool_bytes} B)")
    words = _plane_words(pool, geo)
    dev = pool.device
    rows_in = nbytes // geo.row_bytes
    plane_idx = torch.arange(geo.n_slots * geo.row_elems, dtype=torch.int64, device=dev)
    slot = torch.arange(geo.n_slots, dtype=torch.int64, device=dev)
    bad = clobbered = 0
    first: list[int] | None = None
    for p in range(geo.planes):
        g = p * geo.n_slots * geo.row_elems + plane_idx
        inside = (p * geo.n_slots + slot) < rows_in
        expected = torch.where(inside.repeat_interleave(geo.row_elems),
                               pattern_words(seed_src, g), pattern_words(seed_dst, g))
        diff = (words[p] != expected.view(geo.n_slots, geo.row_elems)).any(dim=1)
        bad += int((diff & inside).sum())
        clobbered += int((diff & ~inside).sum())
        if first is None and bool(diff.any()):
            first = [p, int(torch.nonzero(diff)[0, 0])]
    return _verdict(bad, clobbered, rows_in, first)


# ====================================================================== engine log
def installed_transport(log_text: str) -> str | None:
    """The data transport the engine says it installed, from its own log, or None."""
    for line in log_text.splitlines():
        for rx, name in TRANSPORT_LINES:
            if rx.search(line):
                return name
    return None


def log_excerpt(path: Path, tail: int = 25, errors: int = 25) -> dict[str, list[str]]:
    """The log's last lines and its glog error/fatal/warning lines (E/F/W prefixed)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return {"tail": [f"(log unreadable: {e})"], "errors": []}
    flagged = [ln for ln in lines if re.match(r"^[EFW]\d{4} ", ln) or "Error" in ln or "error" in ln]
    return {"tail": lines[-tail:], "errors": flagged[-errors:]}


# ====================================================================== child plumbing
class Channel:
    """JSON lines over one end of a socketpair (P <-> D control)."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.buf = b""

    def send(self, **msg: Any) -> None:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def recv(self, timeout: float | None) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError("the peer process closed the control socket (it exited)")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        out: dict[str, Any] = json.loads(line)
        return out

    def call(self, timeout: float, **msg: Any) -> dict[str, Any]:
        self.send(**msg)
        return self.recv(timeout)


def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _exc(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _import_engine() -> tuple[Any, Any]:
    # torch first: engine.so needs libcudart.so.13, which torch's CUDA wheels load.
    import torch

    torch.set_num_threads(1)
    from mooncake import engine

    return torch, engine


def _flags(engine: Any) -> dict[str, Any]:
    return {k: getattr(engine, k) for k in sorted(dir(engine)) if k.startswith("SUPPORT_")}


def _read_log(log: Path, start: int = 0) -> str:
    sys.stderr.flush()
    try:
        with open(log, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _log_size(log: Path) -> int:
    sys.stderr.flush()
    return log.stat().st_size if log.exists() else 0


def _engine_said(log: Path, start: int, levels: str = "EF", keep: int = 5) -> str:
    """The engine's own glog lines of the given severities written since `start`."""
    said = [ln.strip() for ln in _read_log(log, start).splitlines() if re.match(rf"^[{levels}]\d{{4}} ", ln)]
    return "; the engine logged: " + (" | ".join(said[-keep:]) or "no such line")


def _new_engine(engine: Any, protocol: str, log: Path) -> tuple[Any, str | None]:
    te = engine.TransferEngine()
    before = _log_size(log)
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise _StageError("initialize", f'TransferEngine.initialize("127.0.0.1", "P2PHANDSHAKE", '
                                        f'"{protocol}", "") returned {rc}' + _engine_said(log, before))
    got = installed_transport(_read_log(log))
    if got is not None and got != protocol:
        raise _StageError("initialize", f"asked for transport '{protocol}' but the engine installed '{got}' "
                                        f"(its log says so): a silent fallback, not measured under '{protocol}'")
    return te, got


class _StageError(Exception):
    def __init__(self, stage: str, error: str) -> None:
        super().__init__(error)
        self.stage, self.error = stage, error


def role_target(args: argparse.Namespace) -> int:
    """D: owns the destination pool, registers it, resets and verifies it on request."""
    ch = Channel(args.ctl_fd)
    geo = _geo_from(args)
    stage = "import"
    try:
        torch, engine = _import_engine()
        stage = "setup"
        torch.cuda.set_device(args.device)
        pool = torch.empty(geo.shape(), dtype=torch.bfloat16, device=f"cuda:{args.device}")
        fill_pattern(pool, SEED_DST)
        torch.cuda.synchronize()
        stage = "initialize"
        te, transport = _new_engine(engine, ATTEMPTS[args.attempt].protocol, Path(args.log))
        stage = "register"
        rc = te.register_memory(pool.data_ptr(), geo.pool_bytes)
        if rc != 0:
            raise _StageError("register", f"register_memory(dst pool, {geo.pool_bytes}) returned {rc}")
        ch.send(event="ready", segment=f"127.0.0.1:{te.get_rpc_port()}", base=pool.data_ptr(),
                size=geo.pool_bytes, transport=transport, flags=_flags(engine))
    except BaseException as e:
        err = (e.stage, e.error) if isinstance(e, _StageError) else (stage, _exc(e))
        try:
            ch.send(event="error", stage=err[0], error=err[1])
        except OSError:
            pass  # P already gave up (its own initialize failed first); it reported that
        _quit(0)
    while True:
        try:
            cmd = ch.recv(None)
        except (EOFError, OSError):
            _quit(0)
        try:
            torch.cuda.synchronize()
            if cmd["op"] == "quit":
                ch.send(ok=True)
                _quit(0)
            elif cmd["op"] == "reset":
                fill_pattern(pool, SEED_DST)
                torch.cuda.synchronize()
                ch.send(ok=True)
            elif cmd["op"] == "verify" and "flat_bytes" in cmd:
                ch.send(**check_flat(pool, geo, int(cmd["flat_bytes"])))
            elif cmd["op"] == "verify":
                ch.send(**check_rows(pool, geo, cmd["src_slots"], cmd["dst_slots"]))
            else:
                ch.send(ok=False, error=f"unknown op {cmd['op']!r}")
        except BaseException as e:
            try:
                ch.send(ok=False, error=_exc(e))
            except OSError:
                _quit(0)  # P is gone


def _quit(code: int) -> NoReturn:
    # The engine's destructors join its worker threads, and a C++ call cannot be timed
    # out from Python; the parent owns cleanup, so leave without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def role_initiator(args: argparse.Namespace) -> int:
    """P: owns the source pool, initiates every write, times it, asks D to verify."""
    ch = Channel(args.ctl_fd)
    geo = _geo_from(args)
    deadline = args.deadline
    stage = "import"
    _emit(event="begin", stage=stage)
    try:
        torch, engine = _import_engine()
        _emit(event="info", flags=_flags(engine), torch=torch.__version__, cuda=torch.version.cuda)
        stage = "setup"
        _emit(event="begin", stage=stage)
        n = torch.cuda.device_count()
        if n < 2 or max(args.device, args.peer_device) >= n:
            raise _StageError("setup", f"needs CUDA devices {args.device} and {args.peer_device}, found {n}")
        torch.cuda.set_device(args.device)
        _emit(event="info", gpus=[torch.cuda.get_device_name(i) for i in range(n)],
              peer_access=bool(torch.cuda.can_device_access_peer(args.device, args.peer_device)))
        src = torch.empty(geo.shape(), dtype=torch.bfloat16, device=f"cuda:{args.device}")
        fill_pattern(src, SEED_SRC)
        torch.cuda.synchronize()
        stage = "initialize"
        _emit(event="begin", stage=stage)
        te, transport = _new_engine(engine, ATTEMPTS[args.attempt].protocol, Path(args.log))
        _emit(event="info", installed_transport=transport)
        ready = ch.recv(max(5.0, deadline - time.time()))
        if ready.get("event") == "error":
            raise _StageError(ready["stage"], f"target process (D): {ready['error']}")
        _emit(event="info", target_segment=ready["segment"], target_transport=ready.get("transport"))
        stage = "register"
        _emit(event="begin", stage=stage)
        rc = te.register_memory(src.data_ptr(), geo.pool_bytes)
        if rc != 0:
            raise _StageError("register", f"register_memory(src pool, {geo.pool_bytes}) returned {rc}")
    except _StageError as e:
        _emit(event="fail", stage=e.stage, error=e.error)
        _quit(0)
    except BaseException as e:
        _emit(event="fail", stage=stage, error=_exc(e))
        _quit(0)

    def sync() -> None:
        for d in (args.device, args.peer_device):
            torch.cuda.synchronize(d)

    bench = _CaseRunner(args, geo, te, ch, ready, src.data_ptr(), sync)
    failed_before: str | None = None
    for name in args.cases:
        _emit(event="begin", stage="transfer", case=name)
        res = bench.run(name)
        if failed_before:
            # A failed batch can stay queued in the engine ("cleanup has been deferred")
            # and disturb what follows in this process: say so next to the result.
            res["after_failed_case"] = failed_before
        elif not res["ok"] and not str(res.get("error", "")).startswith("not run"):
            failed_before = name
        _emit(event="case", name=name, **res)
    try:
        ch.call(10.0, op="quit")
    except (OSError, EOFError, ValueError):
        pass
    _emit(event="done")
    _quit(0)


class _CaseRunner:
    """Runs one case: reset D, (probe), warm-up, verify, timed iterations, verify."""

    def __init__(self, args: argparse.Namespace, geo: Geometry, te: Any, ch: Channel,
                 ready: dict[str, Any], src_base: int, sync: Callable[[], None]) -> None:
        self.args, self.geo, self.te, self.ch, self.sync = args, geo, te, ch, sync
        self.target, self.dst_base, self.src_base = ready["segment"], int(ready["base"]), src_base
        self.layouts = request_layouts(args.tokens, geo.n_slots)

    def _remaining(self) -> float:
        return float(self.args.deadline - time.time())

    def _call_for(self, name: str, count: int | None = None) -> tuple[Callable[[], int], str, int, int]:
        """(call, api used, copies, bytes) for a case; `count` limits it to the first copies."""
        geo, te = self.geo, self.te
        if name == "single":
            nbytes = self.args.tokens * geo.token_bytes
            return (lambda: te.transfer_sync_write(self.target, self.src_base, self.dst_base, nbytes),
                    "transfer_sync_write", 1, nbytes)
        layout = "contiguous" if name == "contiguous" else "fragmented"
        s, t = self.layouts[layout]
        if name == "fragmented_pages":
            if not hasattr(te, "batch_transfer_sync_write_pages"):
                raise _StageError("transfer", "this engine has no batch_transfer_sync_write_pages")
            k = s.size if count is None else max(1, count // geo.planes)
            sp, tp = np.ascontiguousarray(s[:k]), np.ascontiguousarray(t[:k])
            fields = page_fields(geo, self.src_base, self.dst_base)
            return (lambda: te.batch_transfer_sync_write_pages(self.target, sp, tp, fields),
                    "batch_transfer_sync_write_pages", k * geo.planes, k * geo.token_bytes)
        segs = plan_segments(geo, s, t)
        if count is not None:
            segs = segs.head(count)
        src = segs.src + np.uint64(self.src_base)
        dst = segs.dst + np.uint64(self.dst_base)
        ln = np.ascontiguousarray(segs.length)
        if hasattr(te, "batch_transfer_sync_write_arrays"):
            return (lambda: te.batch_transfer_sync_write_arrays(self.target, src, dst, ln),
                    "batch_transfer_sync_write_arrays", len(segs), segs.total_bytes)
        ls, ld, ll = src.tolist(), dst.tolist(), ln.tolist()
        return (lambda: te.batch_transfer_sync_write(self.target, ls, ld, ll),
                "batch_transfer_sync_write", len(segs), segs.total_bytes)

    def _timed(self, call: Callable[[], int], what: str) -> float:
        """Seconds for one synchronous call, device work included; a non-zero return is
        a transfer failure carrying the engine's own warning/error lines for that call."""
        log = Path(self.args.log)
        before = _log_size(log)
        t0 = time.perf_counter()
        rc = call()
        self.sync()
        secs = time.perf_counter() - t0
        if rc != 0:
            raise _StageError("transfer", f"{what} returned {rc} after {secs:.2f} s"
                                          + _engine_said(log, before, "EFW", 4))
        return secs

    def _verify(self, name: str) -> dict[str, Any]:
        timeout = max(30.0, self._remaining())
        try:
            if name == "single":
                return self.ch.call(timeout, op="verify", flat_bytes=self.args.tokens * self.geo.token_bytes)
            s, t = self.layouts["contiguous" if name == "contiguous" else "fragmented"]
            return self.ch.call(timeout, op="verify", src_slots=s.tolist(), dst_slots=t.tolist())
        except (OSError, EOFError, ValueError) as e:
            raise _StageError("verify", f"D did not answer the verification: {_exc(e)}") from e

    def run(self, name: str) -> dict[str, Any]:
        res: dict[str, Any] = {"ok": False}
        try:
            if self._remaining() < self.args.min_case_s:
                raise _StageError("transfer", f"not run: {self._remaining():.0f} s left of this protocol's "
                                              f"time limit, under --min-case-s {self.args.min_case_s}")
            call, api, copies, nbytes = self._call_for(name)
            res.update(api=api, copies=copies, bytes=nbytes)
            reset = self.ch.call(60.0, op="reset")
            if not reset.get("ok"):
                raise _StageError("verify", f"D could not reset its pool: {reset.get('error')}")
            if copies > PROBE_ROWS * 4:
                # A short prefix first: a backend that needs minutes for the whole
                # request is reported with its measured rate instead of a kill.
                pcall, _, pcopies, _ = self._call_for(name, PROBE_ROWS)
                secs = self._timed(pcall, f"{api} on a {pcopies}-copy probe")
                projected = secs * copies / pcopies
                res["probe"] = {"copies": pcopies, "ms": round(secs * 1e3, 3), "projected_s": round(projected, 2)}
                if projected > self._remaining() - 20:
                    raise _StageError("transfer", f"not run: a {pcopies}-copy probe took {secs * 1e3:.1f} ms, "
                                                  f"projecting {projected:.0f} s for {copies} copies, over the "
                                                  f"{self._remaining():.0f} s left")
            warm = self._timed(call, f"{api} on the warm-up call ({copies} copies, {nbytes} B)")
            res["warmup_ms"] = round(warm * 1e3, 3)
            first = self._verify(name)
            res["verify_after_warmup"] = first
            if not first.get("ok"):
                raise _StageError("verify", f"after the warm-up call: {first}")
            budget = self._remaining() - 20
            iters = max(1, min(self.args.iters, int(budget / max(warm, 1e-6))))
            times = []
            for i in range(iters):
                times.append(self._timed(call, f"{api} on timed iteration {i}"))
            last = self._verify(name)
            res["verify_after_timing"] = last
            if not last.get("ok"):
                raise _StageError("verify", f"after {iters} timed iterations: {last}")
            med = statistics.median(times)
            res.update(ok=True, verified=True, iters=iters, median_ms=round(med * 1e3, 3),
                       min_ms=round(min(times) * 1e3, 3), max_ms=round(max(times) * 1e3, 3),
                       GBps=round(nbytes / med / 1e9, 2), times_ms=[round(x * 1e3, 3) for x in times])
        except _StageError as e:
            res.update(stage=e.stage, error=e.error)
        except BaseException as e:
            res.update(stage="transfer", error=_exc(e))
        return res


def role_import_check(args: argparse.Namespace) -> int:
    """Import mooncake.engine in a throw-away process and say what it is."""
    out: dict[str, Any] = {"ok": False}
    spec = importlib.util.find_spec("mooncake")
    try:
        if spec is not None:
            # torch only when the package exists: it supplies libcudart for engine.so.
            import torch  # noqa: F401
        from mooncake import engine

        out.update(ok=True, flags=_flags(engine), engine_path=getattr(engine, "__file__", None))
    except BaseException as e:
        out["error"] = _exc(e)
    if spec is not None and spec.submodule_search_locations:
        out["package_dir"] = list(spec.submodule_search_locations)[0]
    out["version"] = _dist_version()
    print(json.dumps(out))
    return 0


def _dist_version() -> str | None:
    from importlib import metadata

    for dist in ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine", "mooncake_transfer_engine_cuda13"):
        try:
            return f"{dist}=={metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _geo_from(args: argparse.Namespace) -> Geometry:
    return Geometry(args.layers, args.kv_heads, args.head_dim, args.pool_slots)


# ====================================================================== orchestrator
def _missing_libs(package_dir: str | None) -> list[str]:
    """ldd's 'not found' lines for engine.so (torch-provided libcudart shows up here
    too although it resolves at run time once torch is imported)."""
    if not package_dir or not shutil.which("ldd"):
        return []
    so = Path(package_dir) / "engine.so"
    if not so.exists():
        return [f"{so} does not exist"]
    try:
        out = subprocess.run(["ldd", str(so)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return [f"ldd failed: {e}"]
    return [ln.strip() for ln in out.splitlines() if "not found" in ln]


def _child_env(attempt: str | None, args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SELECTOR_VARS}
    if attempt:
        env.update(ATTEMPTS[attempt].env)
    env.setdefault("MC_TRANSFER_TIMEOUT", str(args.transfer_timeout_s))
    # The installed transport is read from the engine's INFO lines on stderr; glog
    # would otherwise send them to files once initialised.
    env.setdefault("GLOG_logtostderr", "1")
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if args.ld_library_path:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(x for x in (args.ld_library_path, env.get("LD_LIBRARY_PATH")) if x)
    # cudaIpcGetMemHandle has no handle for expandable (cuMemCreate) segments.
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf.replace("expandable_segments:True", "expandable_segments:False")
    return env


def _role_argv(args: argparse.Namespace, role: str, attempt: str, ctl_fd: int, log: Path,
               device: int, peer: int, deadline: float) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--role", role, "--attempt", attempt,
            "--ctl-fd", str(ctl_fd), "--log", str(log), "--device", str(device), "--peer-device", str(peer),
            "--deadline", f"{deadline:.3f}", "--layers", str(args.layers), "--kv-heads", str(args.kv_heads),
            "--head-dim", str(args.head_dim), "--pool-slots", str(args.pool_slots), "--tokens", str(args.tokens),
            "--iters", str(args.iters), "--min-case-s", str(args.min_case_s), "--cases", ",".join(args.cases)]


def _stop(proc: subprocess.Popen[Any] | None, grace: float) -> int | None:
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    return proc.returncode


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with code {rc}"


def run_attempt(args: argparse.Namespace, name: str, timeout_s: float, work: Path) -> dict[str, Any]:
    """One attempt: D and P in fresh processes, P's events folded into one record."""
    rec: dict[str, Any] = {"protocol": ATTEMPTS[name].protocol, "ok": False, "env": ATTEMPTS[name].env,
                           "time_limit_s": round(timeout_s, 1), "cases": {}}
    logs = {who: work / f"{name}-{who}.log" for who in ("initiator", "target")}
    a, b = socket.socketpair()
    procs: dict[str, subprocess.Popen[Any]] = {}
    t0 = time.time()
    deadline = t0 + timeout_s - 5
    env = _child_env(name, args)
    stdout = ""
    timed_out = False
    try:
        with open(logs["target"], "wb") as dlog:
            procs["target"] = subprocess.Popen(
                _role_argv(args, "target", name, b.fileno(), logs["target"], args.dst_device,
                           args.src_device, deadline),
                stdin=subprocess.DEVNULL, stdout=dlog, stderr=subprocess.STDOUT, env=env, pass_fds=(b.fileno(),))
        with open(logs["initiator"], "wb") as plog:
            procs["initiator"] = subprocess.Popen(
                _role_argv(args, "initiator", name, a.fileno(), logs["initiator"], args.src_device,
                           args.dst_device, deadline),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=plog, env=env,
                pass_fds=(a.fileno(),), text=True)
        a.close()
        b.close()
        try:
            stdout, _ = procs["initiator"].communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            procs["initiator"].kill()
            stdout, _ = procs["initiator"].communicate()
    finally:
        for s in (a, b):
            s.close()
        rc_p = _stop(procs.get("initiator"), 5)
        rc_d = _stop(procs.get("target"), 10)
    rec["wall_s"] = round(time.time() - t0, 1)
    last_stage, finished, fail = "import", False, None
    for line in (stdout or "").splitlines():
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = ev.pop("event", None)
        if kind == "begin":
            last_stage = ev["stage"] + (f" (case {ev['case']})" if "case" in ev else "")
        elif kind == "info":
            rec.update(ev)
        elif kind == "case":
            rec["cases"][ev.pop("name")] = ev
        elif kind == "fail":
            fail = ev
        elif kind == "done":
            finished = True
    if fail is not None:
        rec.update(stage=fail["stage"], error=fail["error"])
    elif not finished:
        how = f"timed out after {timeout_s:.0f} s" if timed_out else f"initiator {_describe_exit(rc_p)}"
        rec.update(stage=last_stage.split(" ")[0], error=f"{how} during stage {last_stage}; "
                                                          f"target {_describe_exit(rc_d)}")
    else:
        bad = [(n, c) for n, c in rec["cases"].items() if not c.get("ok")]
        if bad:
            n, c = bad[0]
            rec.update(stage=c.get("stage", "transfer"), error=f"case {n}: {c.get('error')}")
        else:
            rec["ok"] = bool(rec["cases"])
    if not rec["ok"] or args.keep_logs:
        rec["initiator_log"] = log_excerpt(logs["initiator"])
        rec["target_log"] = log_excerpt(logs["target"])
    return rec


def _rdma_devices() -> list[str]:
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def probe(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.time()
    geo = _geo_from(args)
    result: dict[str, Any] = {
        "tool": "bench/mooncake_probe.py",
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "kernel": platform.release(),
        "config": {"layers": geo.layers, "kv_heads": geo.kv_heads, "head_dim": geo.head_dim, "dtype": "bfloat16",
                   "pool_slots": geo.n_slots, "tokens": args.tokens, "row_bytes": geo.row_bytes,
                   "token_bytes": geo.token_bytes, "request_bytes": args.tokens * geo.token_bytes,
                   "src_device": args.src_device, "dst_device": args.dst_device, "iters": args.iters,
                   "warmup": 1, "cases": list(args.cases), "budget_s": args.budget_s,
                   "protocol_timeout_s": args.protocol_timeout_s,
                   "extra_ld_library_path": args.ld_library_path or None},
        "protocols": {},
    }
    env = _child_env(None, args)
    imp: dict[str, Any]
    try:
        chk = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--role", "import-check"],
                             capture_output=True, text=True, timeout=120, env=env)
        lines = [ln for ln in chk.stdout.splitlines() if ln.startswith("{")]
        imp = json.loads(lines[-1]) if lines else {
            "ok": False, "error": f"import check {_describe_exit(chk.returncode)}: {chk.stderr[-2000:]}"}
    except subprocess.TimeoutExpired:
        imp = {"ok": False, "error": "import of mooncake.engine did not finish in 120 s"}
    if not imp.get("ok"):
        imp["ldd_not_found"] = _missing_libs(imp.get("package_dir"))
    result["mooncake"] = imp
    rdma = _rdma_devices()
    with tempfile.TemporaryDirectory(prefix="mooncake-probe-") as tmp:
        todo = list(args.protocols)
        for i, name in enumerate(todo):
            head = {"protocol": ATTEMPTS[name].protocol, "ok": False, "env": ATTEMPTS[name].env}
            left = args.budget_s - (time.time() - t_start) - 5 * (len(todo) - i - 1)
            if not imp.get("ok"):
                result["protocols"][name] = {**head, "stage": "import", "error": imp.get("error")}
            elif ATTEMPTS[name].protocol == "rdma" and not rdma:
                result["protocols"][name] = {**head, "skipped": True, "stage": "initialize",
                                             "error": "not attempted: no RDMA device under /sys/class/infiniband"}
            elif left < 30:
                result["protocols"][name] = {**head, "skipped": True, "stage": "initialize",
                                             "error": f"not attempted: {left:.0f} s left of --budget-s"}
            else:
                result["protocols"][name] = run_attempt(args, name, min(args.protocol_timeout_s, left), Path(tmp))
                _write(args.out, result)
    result["rdma_devices"] = rdma
    result["wall_s"] = round(time.time() - t_start, 1)
    result["summary"] = summary_lines(result)
    return result


def summary_lines(result: dict[str, Any]) -> list[str]:
    imp = result.get("mooncake", {})
    flags = ", ".join(f"{k}={v}" for k, v in (imp.get("flags") or {}).items())
    out = [f"mooncake: {imp.get('version') or 'version unknown'}: "
           + (f"imported ({flags})" if imp.get("ok") else f"import FAILED: {imp.get('error')}")]
    for name, rec in result["protocols"].items():
        if not rec.get("cases"):
            out.append(f"{name:13s} FAILED at {rec.get('stage')}: {rec.get('error')}")
            continue
        for case, c in rec["cases"].items():
            if c.get("ok"):
                out.append(f"{name:13s} {case:17s} {c['median_ms']:10.3f} ms {c['GBps']:8.2f} GB/s  "
                           f"{c['copies']} copies, verified ({c['api']})")
            else:
                out.append(f"{name:13s} {case:17s} FAILED at {c.get('stage')}: {c.get('error')}")
        if not rec.get("ok") and not str(rec.get("error", "")).startswith("case "):
            out.append(f"{name:13s} FAILED at {rec.get('stage')}: {rec.get('error')}")
    return out


def _write(path: str, result: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(p)


def _csv(kind: str, allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{kind}: expected a comma-separated subset of "
                                             f"{','.join(allowed)}, got {text!r}")
        return items
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 bench/mooncake_probe.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="where to write the JSON result (required unless --role)")
    p.add_argument("--protocols", type=_csv("--protocols", PROTOCOLS), default=list(PROTOCOLS),
                   help="attempts to run, in order (tcp_tuned: tcp with the per-peer queue limits raised)")
    p.add_argument("--cases", type=_csv("--cases", CASES), default=list(CASES))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--pool-slots", type=int, default=8192)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--src-device", type=int, default=0)
    p.add_argument("--dst-device", type=int, default=1)
    p.add_argument("--budget-s", type=float, default=330.0, help="wall-clock limit of the whole probe")
    p.add_argument("--protocol-timeout-s", type=float, default=100.0, help="limit of one protocol attempt")
    p.add_argument("--min-case-s", type=float, default=15.0, help="a case starts only with this much time left")
    p.add_argument("--transfer-timeout-s", type=int, default=60,
                   help="MC_TRANSFER_TIMEOUT for the engine (when not already set)")
    p.add_argument("--ld-library-path", default="",
                   help="directory prepended to LD_LIBRARY_PATH of the children (system libraries the "
                        "wheel needs and the host lacks); recorded in the result")
    p.add_argument("--keep-logs", action="store_true", help="log excerpts also for successful attempts")
    # internal: the child roles
    p.add_argument("--role", choices=("initiator", "target", "import-check"), help=argparse.SUPPRESS)
    p.add_argument("--attempt", choices=PROTOCOLS, help=argparse.SUPPRESS)
    p.add_argument("--ctl-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    p.add_argument("--device", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--peer-device", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.role == "import-check":
        return role_import_check(args)
    if args.role == "target":
        return role_target(args)
    if args.role == "initiator":
        return role_initiator(args)
    if not args.out:
        _parser().error("--out is required: the path of the JSON result")
    request_layouts(args.tokens, args.pool_slots)  # a bad shape fails here, naming the field

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    result = probe(args)
    _write(args.out, result)
    print("\n".join(result["summary"]))
    print(f"result: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
