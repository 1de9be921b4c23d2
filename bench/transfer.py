"""`pdunit bench transfer` (BENCHMARKS.md sections 2 and 6) and the pod-isolation harness.

One run, side by side: contiguous peer copy (the link's ceiling), per-row copies (what
upstream engines do), the proxy (single kernel and staged), direct ipc / posix-fd
kernels, and tcp, for a request of `tokens` tokens laid out contiguously and fully
fragmented (page size 1), in one or more isolation phases:

- `none`        P, D, proxy as plain processes that all see both GPUs
- `pod-shared`  P and D each in a mount namespace holding only its own GPU's device
                node (and /proc/driver/nvidia masked to it), the proxy seeing all GPUs,
                all three in ONE PID namespace (a pod with shareProcessNamespace: true)
- `pod-separate` the same, but each process in a PID namespace of its own

Processes: the orchestrator (this module's `run_transfer`) starts the proxy, D (owns
the destination pools, serves verification over a control socket) and P (owns the
source pool, probes `auto`, times every backend). Every backend's result is verified
by D bit for bit: each destination row equals the source row, and no row outside the
destination slots changed. Results: `bench/results/transfer-<date>-<machine>.json/.md`.

Must never report a row whose verification failed as a success.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ISOLATE = REPO / "tests" / "gpu" / "harness" / "pod_isolate.sh"
PHASES = ("none", "pod-shared", "pod-separate")
BACKENDS = ("peer_copy", "per_row", "ipc", "posix-fd", "proxy_single", "proxy_staged", "tcp")
SEED_P, SEED_D = 11, 29


# ====================================================================== patterns
def fill_pattern(pool: Any, seed: int) -> None:
    """Deterministic content from (seed, element index), computed on the pool's device,
    so D can recompute P's rows without seeing P's memory. Compared as int16 words."""
    import torch

    flat = pool.view(torch.int16).view(pool.shape[0] * 2, -1)
    plane = flat.shape[1]
    idx = torch.arange(plane, dtype=torch.int64, device=pool.device)
    for p in range(flat.shape[0]):
        v = (idx + p * plane) * 0x9E3779B1 + seed * 0x85EBCA77
        v = v ^ (v >> 15)
        flat[p].copy_((v & 0xFFFF).to(torch.int32).to(torch.int16))


# ====================================================================== D role
def _descs(ds: list[Any]) -> list[dict[str, Any]]:
    return [{"mode": d.mode, "params": d.params, "handle": base64.b64encode(d.handle).decode()} for d in ds]


def undescs(raw: list[dict[str, Any]]) -> list[Any]:
    from pdunit.engine.transfer.base import Descriptor

    return [Descriptor(d["mode"], dict(d["params"]), base64.b64decode(d["handle"])) for d in raw]


def role_d(args: argparse.Namespace) -> int:
    import torch

    from pdunit.engine.transfer.auto import AutoReceiver
    from pdunit.engine.transfer.base import Descriptor
    from pdunit.engine.transfer.fabric import FabricReceiver
    from pdunit.engine.transfer.ipc import IpcReceiver
    from pdunit.engine.transfer.posix_fd import PosixFdReceiver
    from pdunit.engine.transfer.proxy import ProxyReceiver
    from pdunit.engine.transfer.tcp import TcpReceiver

    torch.set_num_threads(1)
    dev = f"cuda:{args.device}"
    torch.cuda.set_device(args.device)
    geo = _geometry(args)
    out: dict[str, Any] = {"errors": {}, "pid": os.getpid()}
    pools: dict[str, Any] = {}
    parts: list[Any] = []

    def attempt(name: str, build: Any) -> Any:
        try:
            obj = build()
            parts.append(obj)
            out[name] = _descs(obj.descriptors())
            return obj
        except Exception as e:  # recorded verbatim: the harness reports exact errors
            out["errors"][name] = f"{type(e).__name__}: {e}"
            out[name] = _descs([Descriptor(name, {"unavailable": out["errors"][name]})])
            return None

    ipc = attempt("ipc", lambda: IpcReceiver(geo, dev))
    if ipc is not None:
        pools["A"] = ipc.storage
    fd = attempt("posix-fd", lambda: PosixFdReceiver(geo, dev))
    if fd is not None:
        pools["B"] = fd.storage
    attempt("fabric", lambda: FabricReceiver(_geometry(args, n_slots=64), dev))
    if ipc is not None:
        attempt("proxy", lambda: ProxyReceiver(geo, dev, args.proxy_socket, storage=ipc.storage))
        attempt("tcp", lambda: TcpReceiver(geo, dev, "127.0.0.1", 0, storage=ipc.storage))
    attempt("auto", lambda: AutoReceiver(_geometry(args, n_slots=256), dev, {"proxy_socket": args.proxy_socket}))
    for pool in pools.values():
        fill_pattern(pool, SEED_D)
    torch.cuda.synchronize()
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(args.control):
        os.unlink(args.control)
    ctl.bind(args.control)
    ctl.listen(4)
    tmp = args.descriptors + ".tmp"
    Path(tmp).write_text(json.dumps(out))
    os.replace(tmp, args.descriptors)
    try:
        conn, _ = ctl.accept()
        with conn, conn.makefile("rw") as f:
            for line in f:
                cmd = json.loads(line)
                if cmd["op"] == "quit":
                    f.write(json.dumps({"ok": True}) + "\n")
                    f.flush()
                    break
                f.write(json.dumps(_d_command(cmd, pools, geo)) + "\n")
                f.flush()
    finally:
        for p in reversed(parts):
            try:
                p.close()
            except Exception as e:
                print(f"close failed: {e}", file=sys.stderr)
        ctl.close()
    return 0


def _d_command(cmd: dict[str, Any], pools: dict[str, Any], geo: Any) -> dict[str, Any]:
    import torch

    pool = pools.get(cmd["pool"])
    if pool is None:
        return {"ok": False, "error": f"pool {cmd['pool']} not allocated"}
    if cmd["op"] == "reset":
        fill_pattern(pool, SEED_D)
        torch.cuda.synchronize()
        return {"ok": True}
    if cmd["op"] != "verify":
        return {"ok": False, "error": f"unknown op {cmd['op']}"}
    expected = torch.empty_like(pool)
    fill_pattern(expected, SEED_D)
    source = torch.empty_like(pool)
    fill_pattern(source, SEED_P)  # P's pool has the same shape, seed SEED_P
    if "flat_bytes" in cmd:  # a raw contiguous copy of the first flat_bytes bytes
        n = cmd["flat_bytes"] // 2
        expected.view(-1).view(torch.int16)[:n].copy_(source.view(-1).view(torch.int16)[:n])
        dst = np.zeros(0, dtype=np.int64)
    else:
        src = torch.tensor(cmd["src_slots"], dtype=torch.int64, device=pool.device)
        dst_t = torch.tensor(cmd["dst_slots"], dtype=torch.int64, device=pool.device)
        expected.index_copy_(2, dst_t, source.index_select(2, src))
        dst = np.asarray(cmd["dst_slots"], dtype=np.int64)
    del source
    # per (plane, slot) row: does it match?
    bad = (pool.view(torch.int16) != expected.view(torch.int16)).flatten(3).any(dim=3)  # [L, 2, S]
    bad_slots = bad.any(dim=0).any(dim=0).cpu().numpy()
    in_dst = np.zeros(pool.shape[2], dtype=bool)
    in_dst[dst] = True
    result = {
        "ok": True,
        "rows_checked": int(bad.numel()),
        "mismatched_dst_slots": int((bad_slots & in_dst).sum()),
        "changed_slots_outside_dst": int((bad_slots & ~in_dst).sum()),
    }
    result["exact"] = result["mismatched_dst_slots"] == 0 and result["changed_slots_outside_dst"] == 0
    return result


# ====================================================================== P role
class _Control:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.f = self.sock.makefile("rw")

    def __call__(self, **cmd: Any) -> dict[str, Any]:
        self.f.write(json.dumps(cmd) + "\n")
        self.f.flush()
        return json.loads(self.f.readline())


def _layouts(tokens: int, n_slots: int, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = n_slots // 4
    return {
        "contiguous": (np.arange(tokens, dtype=np.int64) + base, np.arange(tokens, dtype=np.int64) + 2 * base),
        "fragmented": (rng.permutation(n_slots)[:tokens].astype(np.int64),
                       rng.permutation(n_slots)[:tokens].astype(np.int64)),
    }


def _time(fn: Any, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        extra = fn()
        out.append(extra if isinstance(extra, float) else time.perf_counter() - t0)
    return out


def role_p(args: argparse.Namespace) -> int:
    import torch

    from pdunit.engine.transfer import cudadrv
    from pdunit.engine.transfer.auto import probe_auto
    from pdunit.engine.transfer.base import TransferError
    from pdunit.engine.transfer.factory import attach
    from pdunit.kernels import cuda_rows

    torch.set_num_threads(1)
    dev = f"cuda:{args.device}"
    torch.cuda.set_device(args.device)
    geo = _geometry(args)
    while not os.path.exists(args.descriptors):
        time.sleep(0.1)
    d = json.loads(Path(args.descriptors).read_text())
    ctl = _Control(args.control)
    result: dict[str, Any] = {"phase": args.phase, "d_errors": d["errors"], "rows": [], "failed": []}
    src_pool = torch.empty(geo.shape(), dtype=geo.dtype, device=dev)
    fill_pattern(src_pool, SEED_P)
    torch.cuda.synchronize()
    opts = {"proxy_socket": args.proxy_socket, "probe_all": "1"}
    try:
        sender, report = probe_auto(undescs(d["auto"]), _geometry(args, n_slots=256), dev, opts)
        result["auto"] = report.as_dict()
        sender.close()
    except TransferError as e:
        result["auto"] = {"chosen": None, "error": str(e)}
    if not args.measure:
        ctl(op="quit")
        Path(args.result).write_text(json.dumps(result))
        return 0
    row_bytes = geo.row_bytes
    planes = geo.n_layers * 2
    nbytes = geo.bytes_for(args.tokens)
    rid = [1000]

    def next_rid() -> int:
        rid[0] += 1
        return rid[0]

    def deadline() -> int:
        return int(time.time() * 1000) + 60_000

    senders: dict[str, Any] = {}

    def sender_for(mode: str, method: str = "") -> Any:
        key = mode + method
        if key not in senders:
            descs = [x for x in undescs(d[mode]) if x.mode == mode]
            o = dict(opts, proxy_method=method) if method else dict(opts)
            o["tcp_connections"] = str(args.tcp_connections)
            senders[key] = attach(descs[0], geo, dev, o)
        return senders[key]

    stream = torch.cuda.current_stream().cuda_stream

    def measure_one(backend: str, layout: str, s: np.ndarray, t: np.ndarray) -> None:
        pool = "B" if backend == "posix-fd" else "A"
        if backend == "peer_copy" and layout != "contiguous":
            return
        row: dict[str, Any] = {"backend": backend, "layout": layout, "tokens": args.tokens,
                               "bytes": nbytes, "phase": args.phase}
        try:
            iters = args.iters
            e2e: list[float] = []
            if backend in ("peer_copy", "per_row"):
                ipc = sender_for("ipc")
                if backend == "peer_copy":
                    def fn() -> None:
                        with cudadrv.on_device(args.device):
                            cudadrv.check(cudadrv.drv().cuMemcpyDtoDAsync(
                                ipc.dst_ptr, src_pool.data_ptr(), nbytes, stream), "cuMemcpyDtoDAsync")
                        torch.cuda.synchronize()
                else:
                    iters = args.per_row_iters

                    def fn() -> None:
                        cuda_rows.per_row_copy(src_pool.data_ptr(), ipc.dst_ptr, s, t, planes,
                                               geo.n_slots * row_bytes, geo.n_slots * row_bytes,
                                               row_bytes, args.device, stream)
                        torch.cuda.synchronize()
                ctl(op="reset", pool=pool)
                times = _time(fn, 1, iters)
            elif backend in ("proxy_single", "proxy_staged"):
                px = sender_for("proxy", "single" if backend == "proxy_single" else "staged")
                ctl(op="reset", pool=pool)

                def fn() -> float:
                    t0 = time.perf_counter()
                    px.write(next_rid(), src_pool, s, t, deadline())
                    e2e.append(time.perf_counter() - t0)
                    row["method"] = px.last_reply.method
                    return float(px.last_reply.device_seconds)
                times = _time(fn, args.warmup, iters)
            else:
                tx = sender_for(backend)
                if backend == "tcp":
                    iters = args.tcp_iters
                ctl(op="reset", pool=pool)

                def fn() -> None:
                    tx.write(next_rid(), src_pool, s, t, deadline())
                times = _time(fn, 1 if backend == "tcp" else args.warmup, iters)
                e2e = list(times)
            if backend == "peer_copy":
                check = ctl(op="verify", pool=pool, flat_bytes=nbytes)
            else:
                check = ctl(op="verify", pool=pool, src_slots=s.tolist(), dst_slots=t.tolist())
            med = float(np.median(times))
            row.update({"ms": round(med * 1e3, 4), "gbps": round(nbytes / med / 1e9, 2),
                        "ms_min": round(min(times) * 1e3, 4), "iters": len(times),
                        "verified": bool(check.get("exact")), "check": check})
            if e2e:
                row["e2e_ms"] = round(float(np.median(e2e)) * 1e3, 4)
            (result["rows"] if row["verified"] else result["failed"]).append(row)
            if not row["verified"]:
                row["error"] = f"verification failed: {check}"
        except Exception as e:  # exact error, recorded; the row is not a result
            row["error"] = f"{type(e).__name__}: {e}"
            result["failed"].append(row)
        print(json.dumps(row), flush=True)

    for layout, (s, t) in _layouts(args.tokens, geo.n_slots, 7).items():
        for backend in args.backends:
            measure_one(backend, layout, s, t)
    for sd in senders.values():
        try:
            sd.close()
        except Exception as e:
            print(f"close failed: {e}", file=sys.stderr)
    ctl(op="quit")
    Path(args.result).write_text(json.dumps(result))
    return 0


def _geometry(args: argparse.Namespace, n_slots: int | None = None) -> Any:
    import torch

    from pdunit.engine.transfer.base import PoolGeometry

    return PoolGeometry(args.layers, args.kv_heads, args.head_dim, getattr(torch, args.dtype),
                        n_slots or args.pool_tokens, 1)


# ====================================================================== orchestrator
def gpus() -> list[dict[str, str]]:
    """GPUs from /proc/driver/nvidia: minor number, bus id, UUID (never by ordinal)."""
    out = []
    root = Path("/proc/driver/nvidia/gpus")
    for g in sorted(root.iterdir()) if root.exists() else []:
        info = dict(
            (k.strip(), v.strip()) for k, v in
            (line.split(":", 1) for line in (g / "information").read_text().splitlines() if ":" in line))
        out.append({"bus": g.name, "minor": info.get("Device Minor", ""), "uuid": info.get("GPU UUID", ""),
                    "model": info.get("Model", "")})
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "host": platform.node(), "kernel": platform.release()}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
        rows = [r.split(", ") for r in q.strip().splitlines()]
        info.update(gpu_model=rows[0][0], gpu_count=len(rows), driver=rows[0][1], gpu_memory=rows[0][2])
        info["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                          timeout=30).stdout
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        info["gpu_error"] = str(e)
    return info


def _wrap(phase: str, who: str, minor: str) -> list[str]:
    if phase == "none":
        return []
    pidns = "--pidns" if phase == "pod-separate" else ""
    keep = "all" if who == "proxy" else minor
    return [x for x in ("bash", str(ISOLATE), pidns, keep, "--") if x]


def _run_phase(cfg: argparse.Namespace, phase: str, work: Path, gpus: list[dict[str, str]]) -> dict[str, Any]:
    # A previous run's descriptor file or control socket would send P to a dead D.
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    sock = str(work / "proxy.sock")
    common = ["--layers", str(cfg.layers), "--kv-heads", str(cfg.kv_heads), "--head-dim", str(cfg.head_dim),
              "--dtype", cfg.dtype, "--pool-tokens", str(cfg.pool_tokens), "--tokens", str(cfg.tokens),
              "--proxy-socket", sock, "--control", str(work / "d.ctl"),
              "--descriptors", str(work / "d.json")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    isolated = phase != "none"
    p_dev, d_dev = ("0", "0") if isolated else ("0", "1")
    py = [sys.executable, "-m", "pdunit.bench.transfer"]
    logs = {n: open(work / f"{n}.log", "wb") for n in ("proxy", "d", "p")}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["proxy"] = subprocess.Popen(
            _wrap(phase, "proxy", "") + [sys.executable, "-m", "pdunit.engine.cli", "proxy", "--socket", sock,
                                         "--cuda", "on", "--workers", "2"],
            stdout=logs["proxy"], stderr=subprocess.STDOUT, env=env)
        t_end = time.monotonic() + 120
        while not os.path.exists(sock + ".auth"):
            if procs["proxy"].poll() is not None or time.monotonic() > t_end:
                raise RuntimeError(f"proxy did not start in phase {phase}: "
                                   f"{(work / 'proxy.log').read_text()[-3000:]}")
            time.sleep(0.1)
        procs["d"] = subprocess.Popen(
            _wrap(phase, "d", gpus[1]["minor"]) + py + ["_role", "d", "--device", d_dev] + common,
            stdout=logs["d"], stderr=subprocess.STDOUT, env=env)
        p_args = ["_role", "p", "--device", p_dev, "--phase", phase, "--result", str(work / "p.json"),
                  "--iters", str(cfg.iters), "--warmup", str(cfg.warmup),
                  "--per-row-iters", str(cfg.per_row_iters), "--tcp-iters", str(cfg.tcp_iters),
                  "--tcp-connections", str(cfg.tcp_connections),
                  "--backends", ",".join(cfg.backends if phase != "pod-separate" else [])] + common
        if phase == "pod-separate" or not cfg.backends:
            p_args.append("--no-measure")
        procs["p"] = subprocess.Popen(
            _wrap(phase, "p", gpus[0]["minor"]) + py + p_args, stdout=logs["p"], stderr=subprocess.STDOUT, env=env)
        rc = procs["p"].wait(timeout=cfg.phase_timeout_s)
        if rc != 0 or not (work / "p.json").exists():
            raise RuntimeError(f"P exited {rc} in phase {phase}: {(work / 'p.log').read_text()[-4000:]}")
        res = json.loads((work / "p.json").read_text())
        procs["d"].wait(timeout=60)
        return res
    except Exception as e:
        return {"phase": phase, "error": str(e), "rows": [], "failed": []}
    finally:
        for name in ("p", "d", "proxy"):
            proc = procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for f in logs.values():
            f.close()


def run_transfer(cfg: argparse.Namespace) -> dict[str, Any]:
    found = gpus()
    if len(found) < 2:
        raise SystemExit(f"pdunit bench transfer needs 2 GPUs visible in /proc/driver/nvidia/gpus, found {len(found)}")
    if any(p != "none" for p in cfg.phases) and os.geteuid() != 0:
        raise SystemExit("isolation phases need root (mount and PID namespaces): run as root or --phases none")
    work = Path(cfg.work)
    phases = {p: _run_phase(cfg, p, work / p, found) for p in cfg.phases}
    rows = [r for res in phases.values() for r in res.get("rows", [])]
    peer = [r for r in rows if r["backend"] == "peer_copy" and r["layout"] == "contiguous"]
    peer_gbps = peer[0]["gbps"] if peer else None
    for r in rows:
        r["fraction_of_peer"] = round(r["gbps"] / peer_gbps, 3) if peer_gbps else None

    def pick(backend: str, layout: str, phase: str) -> dict[str, Any] | None:
        return next((r for r in rows if (r["backend"], r["layout"], r["phase"]) == (backend, layout, phase)), None)

    iso = "pod-shared" if "pod-shared" in cfg.phases else "none"
    frag_proxy = pick("proxy_single", "fragmented", iso)
    cont_proxy = pick("proxy_single", "contiguous", iso)
    per_row = pick("per_row", "fragmented", "none")
    summary: dict[str, Any] = {
        "peer_copy_gbps": peer_gbps,
        "speedup_vs_per_block": round(per_row["ms"] / frag_proxy["ms"], 1) if per_row and frag_proxy else None,
        "proxy_fragmented_isolated_fraction_of_peer": frag_proxy["fraction_of_peer"] if frag_proxy else None,
        "proxy_fragmented_over_contiguous": round(frag_proxy["gbps"] / cont_proxy["gbps"], 3)
        if frag_proxy and cont_proxy else None,
        "auto": {p: res.get("auto") for p, res in phases.items()},
        "phase_errors": {p: res["error"] for p, res in phases.items() if "error" in res},
        "failed": [{k: r.get(k) for k in ("phase", "backend", "layout", "error")}
                   for res in phases.values() for r in res.get("failed", [])],
        "d_errors": {p: res.get("d_errors") for p, res in phases.items()},
        "targets": {"fraction_of_peer_min": 0.9, "speedup_vs_per_block_min": 300,
                    "fragmented_within_of_contiguous": 0.05},
    }
    m = machine()
    return {"bench": "transfer", "machine": m, "command": cfg.command,
            "config": {k: v for k, v in vars(cfg).items() if k not in ("command",)},
            "rows": rows, "summary": summary, "date": dt.date.today().isoformat()}


def to_markdown(res: dict[str, Any]) -> str:
    m, s = res["machine"], res["summary"]
    lines = [f"# transfer — {res['date']}", "",
             f"Machine: {m.get('gpu_count')}x {m.get('gpu_model')}, driver {m.get('driver')}, "
             f"{m.get('cpu_count')} CPUs", "", f"Command: `{res['command']}`", "",
             f"Request: {res['config']['tokens']} tokens x {res['config']['layers']} layers x K,V x "
             f"{res['config']['kv_heads']} heads x {res['config']['head_dim']} ({res['config']['dtype']}); "
             f"pool {res['config']['pool_tokens']} slots, page size 1", "",
             "| phase | backend | layout | ms (median) | GB/s | fraction of peer | e2e ms | verified |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['phase']} | {r['backend']}{' (' + r['method'] + ')' if r.get('method') else ''} "
                     f"| {r['layout']} | {r['ms']} | {r['gbps']} | {r.get('fraction_of_peer')} "
                     f"| {r.get('e2e_ms', '')} | {r['verified']} |")
    lines += ["", "Summary:", "", "```json", json.dumps({k: v for k, v in s.items() if k != "auto"}, indent=1),
              "```", "", "`auto` per phase (every mode probed with a verified test transfer):", ""]
    for phase, rep in s["auto"].items():
        lines.append(f"- **{phase}**: chose `{(rep or {}).get('chosen')}`")
        for r in (rep or {}).get("results", []):
            lines.append(f"  - {r['mode']}: {'ok' if r['ok'] else 'FAILED'} — {r['detail']}")
        if rep and rep.get("error"):
            lines.append(f"  - error: {rep['error']}")
    lines += ["", "Not measured (the exact error of each attempt):", ""]
    for f in s["failed"]:
        lines.append(f"- {f['phase']} / {f['backend']} / {f['layout']}: {f['error']}")
    for phase, errs in (s.get("d_errors") or {}).items():
        for mode, err in (errs or {}).items():
            lines.append(f"- {phase} / D could not set up {mode}: {err}")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdunit bench transfer", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--pool-tokens", type=int, default=8192, help="slots per pool (>= 2 x tokens)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per request")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--per-row-iters", type=int, default=2)
    p.add_argument("--tcp-iters", type=int, default=2)
    p.add_argument("--tcp-connections", type=int, default=4)
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {BACKENDS}")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {PHASES}")
    p.add_argument("--work", default="/tmp/pdunit-bench-transfer", help="sockets and per-process logs")
    p.add_argument("--out", default=str(REPO / "bench" / "results"), help="results folder")
    p.add_argument("--machine-tag", default="h200x2")
    p.add_argument("--phase-timeout-s", type=float, default=400)
    return p


def _role_parser() -> argparse.ArgumentParser:
    p = _parser()
    p.add_argument("role", choices=["d", "p"])
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--phase", default="none")
    p.add_argument("--proxy-socket", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--descriptors", required=True)
    p.add_argument("--result", default="")
    p.add_argument("--no-measure", dest="measure", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_role":
        args = _role_parser().parse_args(argv[1:])
        args.backends = [b for b in args.backends.split(",") if b]
        return role_d(args) if args.role == "d" else role_p(args)
    cfg = _parser().parse_args(argv)
    cfg.backends = [b for b in cfg.backends.split(",") if b]
    cfg.phases = [p for p in cfg.phases.split(",") if p]
    bad = [b for b in cfg.backends if b not in BACKENDS] + [p for p in cfg.phases if p not in PHASES]
    if bad:
        print(f"pdunit bench transfer: unknown backend/phase {bad}; backends {BACKENDS}, phases {PHASES}",
              file=sys.stderr)
        return 2
    cfg.command = "pdunit bench transfer " + " ".join(shlex.quote(a) for a in argv)
    res = run_transfer(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"transfer-{dt.date.today().strftime('%Y%m%d')}-{cfg.machine_tag}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    (out / f"{stem}.md").write_text(to_markdown(res))
    print(to_markdown(res))
    return 0 if not res["summary"]["phase_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
