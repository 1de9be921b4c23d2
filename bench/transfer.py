"""`pdunit bench transfer` (BENCHMARKS.md sections 2 and 6) and the pod-isolation harness.

Owns one side-by-side run of every KV path (contiguous peer copy, per-row copies, the
proxy single and staged, direct ipc / posix-fd kernels, tcp) for one request laid out
contiguously and fully fragmented, in isolation phases `none`, `pod-shared` and
`pod-separate` (docs/performance.md, "What each benchmark measures"). `run_transfer`
starts the proxy, D (the destination pools, verification) and P (the source pool, timing
every backend); D verifies each result bit for bit. Results:
`bench/results/transfer-<date>-<machine>.json/.md`. Must never report a row whose
verification failed as a success.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
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
BACKENDS = ("peer_copy", "per_row", "ipc", "posix-fd", "proxy_single", "proxy_grpc", "proxy_staged", "tcp")
# proxy_single and proxy_staged send jobs over the proxy's copy lane (what ProxySender
# does); proxy_grpc is the single kernel through the Copy RPC, to show what gRPC costs.
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

    from pdunit.engine.security import read_secret_file
    from pdunit.engine.transfer.auto import AutoReceiver
    from pdunit.engine.transfer.base import Descriptor
    from pdunit.engine.transfer.fabric import FabricReceiver
    from pdunit.engine.transfer.ipc import IpcReceiver
    from pdunit.engine.transfer.options import unit_secret_option
    from pdunit.engine.transfer.posix_fd import PosixFdReceiver
    from pdunit.engine.transfer.proxy import ProxyReceiver
    from pdunit.engine.transfer.tcp import TcpReceiver

    torch.set_num_threads(1)
    dev = f"cuda:{args.device}"
    torch.cuda.set_device(args.device)
    geo = _geometry(args)
    secret = read_secret_file(args.unit_secret_file)
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
    grantors: dict[str, Any] = {}  # the receivers that check write capabilities, by mode
    if ipc is not None:
        grantors["proxy"] = attempt("proxy", lambda: ProxyReceiver(geo, dev, args.proxy_socket, storage=ipc.storage))
        grantors["tcp"] = attempt("tcp", lambda: TcpReceiver(geo, dev, "127.0.0.1", 0, storage=ipc.storage,
                                                              secret=secret))
    attempt("auto", lambda: AutoReceiver(_geometry(args, n_slots=256), dev,
                                         {"proxy_socket": args.proxy_socket,
                                          "unit_secret": unit_secret_option(secret)}))
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
                reply = _d_grant(cmd, grantors) if cmd["op"] == "grant" else _d_command(cmd, pools, geo)
                f.write(json.dumps(reply) + "\n")
                f.flush()
    finally:
        for p in reversed(parts):
            try:
                p.close()
            except Exception as e:
                print(f"close failed: {e}", file=sys.stderr)
        ctl.close()
    return 0


def _d_grant(cmd: dict[str, Any], grantors: dict[str, Any]) -> dict[str, Any]:
    """RESERVE's grant, as D's worker makes it: one write capability per request id for
    the destination slots (tcp and the proxy refuse writes without it)."""
    rx = grantors.get(cmd["mode"])
    if rx is None:
        return {"ok": False, "error": f"no {cmd['mode']} receiver to grant writes"}
    dst = np.asarray(cmd["dst_slots"], dtype=np.int64)
    return {"ok": True, "capabilities": [rx.grant(rid, dst, cmd["deadline"]).hex() for rid in cmd["rids"]]}


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

    from pdunit.engine.transfer.attach import attach
    from pdunit.engine.transfer.auto import probe_auto
    from pdunit.engine.transfer.base import TransferError
    from pdunit.kernels import cuda_rows, cudadrv

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
    from pdunit.engine.security import read_secret_file
    from pdunit.engine.transfer.options import unit_secret_option

    opts = {"proxy_socket": args.proxy_socket, "probe_all": "1",
            "unit_secret": unit_secret_option(read_secret_file(args.unit_secret_file))}
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

    def reserved(mode: str, t: np.ndarray, n: int) -> list[tuple[int, bytes]]:
        """n fresh request ids, each with the write capability D granted for slots t (as
        RESERVE gives them), drawn before the timed writes."""
        rids = [next_rid() for _ in range(n)]
        reply = ctl(op="grant", mode=mode, rids=rids, dst_slots=t.tolist(), deadline=deadline() + 540_000)
        if not reply.get("ok"):
            raise RuntimeError(f"D granted no {mode} writes: {reply.get('error')}")
        return list(zip(rids, [bytes.fromhex(c) for c in reply["capabilities"]], strict=True))

    senders: dict[str, Any] = {}

    def sender_for(mode: str, method: str = "") -> Any:
        key = mode + method
        if key not in senders:
            descs = [x for x in undescs(d[mode]) if x.mode == mode]
            if method == "grpc":
                from pdunit.engine.proto import proxy_pb2 as pb
                from pdunit.engine.transfer.proxy import ProxySender

                senders[key] = ProxySender(descs[0], geo, dev, args.proxy_socket, pb.SINGLE_KERNEL,
                                           copy_lane=False)
            else:
                o = dict(opts, proxy_method=method) if method else dict(opts)
                o["tcp_connections"] = str(args.tcp_connections)
                senders[key] = attach(descs[0], geo, dev, o)
            if mode == "proxy" and "proxy_copy" not in result:
                info = senders[key].client.info()
                result["proxy_copy"] = {"kernel": info.copy_kernel, "device": info.copy_device}
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
            elif backend in ("proxy_single", "proxy_grpc", "proxy_staged"):
                px = sender_for("proxy", {"proxy_single": "single", "proxy_grpc": "grpc",
                                          "proxy_staged": "staged"}[backend])
                ctl(op="reset", pool=pool)
                stages: list[dict[str, float]] = []
                grants = reserved("proxy", t, args.warmup + iters)

                def proxy_job() -> float:
                    rid, cap = grants.pop()
                    t0 = time.perf_counter()
                    px.write(rid, src_pool, s, t, deadline(), capability=cap)
                    e2e.append(time.perf_counter() - t0)
                    stages.append(dict(px.last_stages))
                    row["method"] = px.last_reply.method
                    return float(px.last_reply.device_seconds)
                times = _time(proxy_job, args.warmup, iters)
                del e2e[:args.warmup], stages[:args.warmup]  # warm-up calls are not results
                row["stages_ms"] = {k: round(float(np.median([x.get(k, 0.0) for x in stages])) * 1e3, 4)
                                    for k in dict.fromkeys(k for x in stages for k in x)}
            else:
                tx = sender_for(backend)
                if backend == "tcp":
                    iters = args.tcp_iters
                warm = 1 if backend == "tcp" else args.warmup
                # direct-write modes check no capability (P writes D's mapped memory itself)
                grants = (reserved("tcp", t, warm + iters) if backend == "tcp"
                          else [(next_rid(), b"") for _ in range(warm + iters)])
                ctl(op="reset", pool=pool)

                def fn() -> None:
                    rid, cap = grants.pop()
                    tx.write(rid, src_pool, s, t, deadline(), capability=cap)
                times = _time(fn, warm, iters)
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



# ====================================================================== kernel tuning
# (rows, threads, unroll) of the first sweep. A 2 KiB row is 128 16-byte vectors, so a
# block holds rows * 128 / threads loads per thread; unroll is how many of them are in
# flight before the stores. (8, 128, 8) is the default (cuda_rows.DEFAULT_CONFIG).
TUNE_BASE = ((8, 128, 8), (8, 128, 4), (8, 128, 2), (8, 128, 1), (4, 128, 4), (2, 128, 2),
             (16, 128, 8), (16, 128, 16), (32, 128, 16), (4, 64, 8), (8, 64, 16), (16, 64, 16),
             (8, 256, 4), (16, 256, 8), (32, 256, 16), (16, 512, 4), (32, 512, 8))


class _Tuner:
    """Times the raw row-copy kernel for one fragmented request, src pool on GPU 0 and
    dst pool on GPU 1 (peer access), for launch configurations and placements (pull:
    kernel on dst's GPU; push: on src's GPU; split: both), verifying every one."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from pdunit.kernels import cuda_rows, cudadrv

        self.torch, self.cudadrv, self.cuda_rows = torch, cudadrv, cuda_rows
        self.args = args
        geo = _geometry(args)
        self.geo = geo
        self.src = torch.empty(geo.shape(), dtype=geo.dtype, device="cuda:0")
        fill_pattern(self.src, SEED_P)
        self.dst = torch.empty(geo.shape(), dtype=geo.dtype, device="cuda:1")
        fill_pattern(self.dst, SEED_D)
        self.pristine = self.dst.clone()
        s, t = _layouts(args.tokens, geo.n_slots, 7)["fragmented"]
        self.n = int(s.size)
        self.slots = {dev: (torch.from_numpy(s).to(f"cuda:{dev}"), torch.from_numpy(t).to(f"cuda:{dev}"))
                      for dev in (0, 1)}
        self.expected = self.src.index_select(2, self.slots[0][0]).to("cuda:1")
        cuda_rows.enable_peer(0, 1)
        cuda_rows.enable_peer(1, 0)
        self.planes = geo.n_layers * 2
        self.row_bytes = geo.row_bytes
        self.stride = geo.n_slots * geo.row_bytes
        self.nbytes = geo.bytes_for(self.n)
        self.copiers: dict[tuple[int, int, int, int], dict[int, Any]] = {}
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    def load(self, configs: list[Any]) -> None:
        """Compile (once, both GPUs share the cubin) and load kernels not loaded yet."""
        new = tuple({c.kernel_key: c for c in configs if c.kernel_key not in self.copiers}.values())
        if new:
            pair = {dev: self.cuda_rows.RowCopier(dev, new, widths=(16,)) for dev in (0, 1)}
            for c in new:
                self.copiers[c.kernel_key] = pair

    def _parts(self, device: str, split: float | None) -> list[tuple[int, int, int]]:
        if device == "dst":
            return [(1, 0, self.n)]
        if device == "src":
            return [(0, 0, self.n)]
        k = int(round(self.n * (split or 0.5)))
        return [(1, 0, k), (0, k, self.n - k)]

    def _fn(self, cfg: Any, device: str, split: float | None) -> Any:
        pair = self.copiers[cfg.kernel_key]
        parts = [(pair[dev], pair[dev].stream(), self.slots[dev], a, cnt)
                 for dev, a, cnt in self._parts(device, split) if cnt > 0]
        src_ptr, dst_ptr = self.src.data_ptr(), self.dst.data_ptr()

        def go() -> None:
            for c, stream, (sp, dp), a, cnt in parts:
                c.launch_raw(src_ptr, dst_ptr, sp.data_ptr() + 8 * a, dp.data_ptr() + 8 * a, cnt,
                             self.planes, self.stride, self.stride, self.row_bytes, stream, cfg)
            for c, stream, *_ in parts:
                c.sync(stream)
        return go

    def verify(self) -> dict[str, Any]:
        """Every destination row equals its source row, no other slot changed; then
        restore the destination pool for the next measurement."""
        torch = self.torch
        torch.cuda.synchronize(1)
        d_idx = self.slots[1][1]
        rows_ok = torch.equal(self.dst.index_select(2, d_idx).view(torch.int16), self.expected.view(torch.int16))
        changed = (self.dst.view(torch.int16) != self.pristine.view(torch.int16)).flatten(3).any(3).any(0).any(0)
        changed[d_idx] = False
        outside = int(changed.sum())
        self.dst.copy_(self.pristine)
        torch.cuda.synchronize(1)
        return {"rows_exact": bool(rows_ok), "changed_slots_outside_dst": outside,
                "exact": bool(rows_ok) and outside == 0}

    def measure(self, cfg: Any, device: str, split: float | None, iters: int, stage: str) -> dict[str, Any]:
        row: dict[str, Any] = {"stage": stage, "config": str(cfg), "device": device, "split": split}
        try:
            times = _time(self._fn(cfg, device, split), 2, iters)
            check = self.verify()
            med = float(np.median(times))
            row.update(ms=round(med * 1e3, 4), ms_min=round(min(times) * 1e3, 4),
                       gbps=round(self.nbytes / med / 1e9, 2), iters=len(times), verified=check["exact"],
                       check=check)
        except Exception as e:  # recorded: a configuration that fails is a result too
            row.update(error=f"{type(e).__name__}: {e}", verified=False)
            self.dst.copy_(self.pristine)
        return row

    def peer_copy_ms(self, iters: int) -> float:
        """The copy engines' contiguous copy of the same bytes: the link's ceiling."""
        d = self.cudadrv.drv()
        c = next(iter(self.copiers.values()))[0]
        stream = c.stream()

        def go() -> None:
            with self.cudadrv.on_device(0):
                self.cudadrv.check(d.cuMemcpyDtoDAsync(self.dst.data_ptr(), self.src.data_ptr(), self.nbytes,
                                                       stream), "cuMemcpyDtoDAsync")
            c.sync(stream)
        ms = float(np.median(_time(go, 2, iters))) * 1e3
        self.dst.copy_(self.pristine)
        return ms


def proxy_args_for(plan: dict[str, Any]) -> list[str]:
    """`pdunit proxy` flags that run the kernel configuration and placement of `plan`."""
    from pdunit.kernels.cuda_rows import CopyConfig

    cfg = CopyConfig.parse(plan["config"])
    out = ["--copy-rows", str(cfg.rows), "--copy-threads", str(cfg.threads), "--copy-unroll", str(cfg.unroll),
           "--copy-hint", cfg.hint, "--copy-blocks-per-sm", str(cfg.blocks_per_sm), "--copy-device", plan["device"]]
    if plan["device"] == "split":
        out += ["--copy-split", str(plan["split"])]
    return out


def role_tune(args: argparse.Namespace) -> int:
    """`--tune-kernel`: sweep, verify, pick; writes the table and the proxy flags."""
    import torch

    from pdunit.kernels.cuda_rows import DEFAULT_CONFIG, CopyConfig

    torch.set_num_threads(1)
    t0 = time.monotonic()
    budget = args.tune_budget_s
    tuner = _Tuner(args)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []

    def out_of_time(what: str) -> bool:
        if time.monotonic() - t0 > budget:
            skipped.append(what)
            return True
        return False

    def run(cfg: Any, device: str, split: float | None, stage: str, iters: int) -> dict[str, Any]:
        row = tuner.measure(cfg, device, split, iters, stage)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "check"}), flush=True)
        return row

    def best(candidates: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
        ok = sorted((r for r in candidates if r.get("verified")), key=lambda r: r["ms"])
        return ok[:k]

    base = [CopyConfig(rows=r, threads=t, unroll=u) for r, t, u in TUNE_BASE]
    tuner.load(base)
    peer_ms = tuner.peer_copy_ms(20)
    # A: rows x threads x unroll, pull and push
    for cfg in base:
        for device in ("dst", "src"):
            if not out_of_time(f"A {cfg} {device}"):
                run(cfg, device, None, "A", args.tune_iters)
    # B: cache operators, then persistent grids, for the best of A
    top = best(rows, 4)
    hinted = [(dataclasses.replace(CopyConfig.parse(r["config"]), hint=h), r["device"])
              for r in top for h in ("cs", "cg")]
    tuner.load([c for c, _ in hinted])
    for cfg, device in hinted:
        if not out_of_time(f"B {cfg} {device}"):
            run(cfg, device, None, "B", args.tune_iters)
    for r in best(rows, 3):
        cfg = CopyConfig.parse(r["config"])
        for bps in sorted({max(1, 2048 // cfg.threads), max(1, 1024 // cfg.threads)}):
            pcfg = dataclasses.replace(cfg, blocks_per_sm=bps)
            if not out_of_time(f"B {pcfg} {r['device']}"):
                run(pcfg, r["device"], None, "B", args.tune_iters)
    # C: both GPUs at once (one configuration, as in the proxy), shares from the
    # measured pull and push times of that configuration
    pulls = {r["config"]: r for r in reversed(best([x for x in rows if x["device"] == "dst"], len(rows)))}
    pushes = {r["config"]: r for r in reversed(best([x for x in rows if x["device"] == "src"], len(rows)))}
    both = sorted((c for c in pulls if c in pushes), key=lambda c: min(pulls[c]["ms"], pushes[c]["ms"]))
    for config in both[:2]:
        cfg = CopyConfig.parse(config)
        pull, push = pulls[config], pushes[config]
        f = push["ms"] / (pull["ms"] + push["ms"])  # equal finish times if both scale linearly
        for split in sorted({round(min(0.95, max(0.05, f + df)), 2) for df in (-0.1, 0.0, 0.1)}):
            if not out_of_time(f"C {cfg} split {split}"):
                run(cfg, "split", split, "C", args.tune_iters)
    # Final: the best plans and the default, interleaved, more iterations
    plans = best(rows, 5)
    default_key = (str(DEFAULT_CONFIG), "dst", None)
    keys = [(r["config"], r["device"], r["split"]) for r in plans]
    if default_key not in keys:
        keys.append(default_key)
    final: dict[tuple[Any, ...], list[dict[str, Any]]] = {k: [] for k in keys}
    peers = [peer_ms]
    for _ in range(3):
        peers.append(tuner.peer_copy_ms(args.tune_iters))  # the ceiling drifts too: re-measure it
        for k in keys:
            if not out_of_time(f"final {k}"):
                final[k].append(tuner.measure(CopyConfig.parse(k[0]), k[1], k[2], args.tune_iters, "final"))
    peer_ms = float(np.median(peers))
    final_rows = []
    for (config, device, split), runs in final.items():
        ok = [r for r in runs if r.get("verified")]
        if not runs:
            continue
        ms = float(np.median([r["ms"] for r in ok])) if ok else None
        final_rows.append({"config": config, "device": device, "split": split, "ms": ms and round(ms, 4),
                           "gbps": round(tuner.nbytes / ms / 1e6, 2) if ms else None,
                           "fraction_of_peer": round(peer_ms / ms, 3) if ms else None,
                           "verified": len(ok) == len(runs), "runs": len(runs)})
    for r in rows:
        if r.get("ms"):
            r["fraction_of_peer"] = round(peer_ms / r["ms"], 3)
    chosen = min((r for r in final_rows if r["verified"] and r["ms"]), key=lambda r: r["ms"], default=None)
    result = {
        "peer_copy_ms": round(peer_ms, 4), "peer_copy_gbps": round(tuner.nbytes / peer_ms / 1e6, 2),
        "bytes": tuner.nbytes, "tokens": tuner.n, "rows": rows, "final": final_rows, "chosen": chosen,
        "default": next((r for r in final_rows if (r["config"], r["device"], r["split"]) == default_key), None),
        "proxy_args": proxy_args_for(chosen) if chosen else [],
        "skipped_for_time": skipped, "seconds": round(time.monotonic() - t0, 1),
    }
    Path(args.result).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows",)}), flush=True)
    return 0 if chosen else 1


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


def _common_args(cfg: argparse.Namespace, work: Path) -> list[str]:
    return ["--layers", str(cfg.layers), "--kv-heads", str(cfg.kv_heads), "--head-dim", str(cfg.head_dim),
            "--dtype", cfg.dtype, "--pool-tokens", str(cfg.pool_tokens), "--tokens", str(cfg.tokens),
            "--proxy-socket", str(work / "proxy.sock"), "--control", str(work / "d.ctl"),
            "--descriptors", str(work / "d.json"), "--unit-secret-file", str(work / "unit.secret")]


def _run_tune(cfg: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The kernel sweep, as a plain process that sees both GPUs (phase `none`)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "pdunit.bench.transfer", "_role", "tune", "--result", str(work / "tune.json"),
           "--tune-iters", str(cfg.tune_iters), "--tune-budget-s", str(cfg.tune_budget_s)] + _common_args(cfg, work)
    t0 = time.monotonic()
    rc: int | str
    with open(work / "tune.log", "wb") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=cfg.tune_budget_s + 60).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if not (work / "tune.json").exists():
        return {"error": f"kernel sweep exited {rc} without a result: {(work / 'tune.log').read_text()[-3000:]}",
                "proxy_args": []}
    res = json.loads((work / "tune.json").read_text())
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def _run_phase(cfg: argparse.Namespace, phase: str, work: Path, gpus: list[dict[str, str]],
               proxy_args: list[str]) -> dict[str, Any]:
    # A previous run's descriptor file or control socket would send P to a dead D.
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    from pdunit.engine.security import write_secret_file

    write_secret_file(str(work / "unit.secret"))  # P <-> D's tcp listener, as a pod's unit Secret
    sock = str(work / "proxy.sock")
    common = _common_args(cfg, work)
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
                                         "--cuda", "on", "--workers", "2", *proxy_args],
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
    tune: dict[str, Any] | None = None
    proxy_args: list[str] = []
    # getattr: callers that build the config themselves (tests/gpu) predate these options
    if getattr(cfg, "tune_kernel", False):
        tune = _run_tune(cfg, work / "tune")
        proxy_args = list(tune.get("proxy_args") or [])
    proxy_args += shlex.split(getattr(cfg, "proxy_args", ""))  # explicit flags win (the last one counts)
    phases = {p: _run_phase(cfg, p, work / p, found, proxy_args) for p in cfg.phases}
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
    frag_grpc = pick("proxy_grpc", "fragmented", iso)
    summary: dict[str, Any] = {
        "peer_copy_gbps": peer_gbps,
        "proxy_args": proxy_args,
        "proxy_copy": {p: res.get("proxy_copy") for p, res in phases.items() if res.get("proxy_copy")},
        "proxy_fragmented_isolated_e2e_ms": frag_proxy.get("e2e_ms") if frag_proxy else None,
        "proxy_fragmented_isolated_overhead_ms": round(frag_proxy["e2e_ms"] - frag_proxy["ms"], 4)
        if frag_proxy and frag_proxy.get("e2e_ms") else None,
        "proxy_grpc_fragmented_isolated_e2e_ms": frag_grpc.get("e2e_ms") if frag_grpc else None,
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
    if tune is not None:
        summary["tune"] = {k: tune.get(k) for k in ("chosen", "default", "peer_copy_ms", "proxy_args",
                                                    "skipped_for_time", "seconds", "wall_s", "error")}
    return {"bench": "transfer", "machine": m, "command": cfg.command,
            "config": {k: v for k, v in vars(cfg).items() if k not in ("command",)},
            "rows": rows, "summary": summary, "tune": tune, "date": dt.date.today().isoformat()}


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
    staged_rows = [r for r in res["rows"] if r.get("stages_ms")]
    if staged_rows:
        names = [n for n in ("prepare", "recv", "validate", "admit", "map", "upload", "launch", "sync",
                             "checksum", "reply", "return", "total")
                 if any(n in r["stages_ms"] for r in staged_rows)]
        lines += ["", "Where a proxy job's time goes (median ms per stage; `prepare` and `return` on P's "
                  "side, the rest inside the proxy, `recv` = P's send stamp -> handler start):", "",
                  "| phase | backend | layout | " + " | ".join(names) + " |",
                  "|---|---|---|" + "---:|" * len(names)]
        for r in staged_rows:
            lines.append(f"| {r['phase']} | {r['backend']} | {r['layout']} | "
                         + " | ".join(str(r["stages_ms"].get(n, "")) for n in names) + " |")
    tune = res.get("tune")
    if tune:
        lines += ["", f"Kernel sweep (`--tune-kernel`, phase none, raw kernel, {tune.get('tokens')} fragmented "
                  f"tokens, src GPU 0 -> dst GPU 1; pull = kernel on dst, push = on src, split = both; "
                  f"peer copy {tune.get('peer_copy_ms')} ms; {tune.get('seconds')} s):", ""]
        if tune.get("error"):
            lines.append(f"- sweep failed: {tune['error']}")
        lines += ["| round | config | device | split | ms (median) | GB/s | fraction of peer | verified |",
                  "|---|---|---|---|---:|---:|---:|---|"]
        for r in sorted(tune.get("final", []), key=lambda r: r["ms"] or 1e9):
            lines.append(f"| final | {r['config']} | {r['device']} | {r['split'] or ''} | {r['ms']} | {r['gbps']} "
                         f"| {r['fraction_of_peer']} | {r['verified']} |")
        for r in sorted(tune.get("rows", []), key=lambda r: r.get("ms") or 1e9):
            lines.append(f"| {r['stage']} | {r['config']} | {r['device']} | {r['split'] or ''} | {r.get('ms', '')} "
                         f"| {r.get('gbps', '')} | {r.get('fraction_of_peer', '')} | "
                         f"{r.get('verified')}{' ' + r['error'] if r.get('error') else ''} |")
        lines += ["", f"Chosen: `{tune.get('chosen')}`; proxy flags `{' '.join(tune.get('proxy_args') or [])}`"]
        if tune.get("skipped_for_time"):
            lines.append(f"Skipped for time: {tune['skipped_for_time']}")
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
    p.add_argument("--tune-kernel", action="store_true",
                   help="before the phases: sweep the copy kernel's launch configurations and placements "
                        "(raw kernel, phase none), verify each, and run every phase's proxy with the best")
    p.add_argument("--tune-iters", type=int, default=10, help="timed launches per sweep point")
    p.add_argument("--tune-budget-s", type=float, default=40.0, help="the sweep stops starting points after this")
    p.add_argument("--proxy-args", default="", help="extra `pdunit proxy` flags, e.g. '--copy-device src'")
    return p


def _role_parser() -> argparse.ArgumentParser:
    p = _parser()
    p.add_argument("role", choices=["d", "p", "tune"])
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--phase", default="none")
    p.add_argument("--proxy-socket", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--descriptors", required=True)
    p.add_argument("--unit-secret-file", default="", help="the P<->D secret (tcp's handshake)")
    p.add_argument("--result", default="")
    p.add_argument("--no-measure", dest="measure", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_role":
        args = _role_parser().parse_args(argv[1:])
        args.backends = [b for b in args.backends.split(",") if b]
        return {"d": role_d, "p": role_p, "tune": role_tune}[args.role](args)
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
