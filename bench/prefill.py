"""`pdunit bench prefill`: P's forward throughput against the GPU's compute peak.

Owns one measurement: a model of the given shape with random weights, a KV storage like
P's, and `run_prefill` (engine/prefill/runner.py, P's own call) over `--points
PROMPTSxROWS` batches, every row computed, after `--warmup` untimed forwards: ms, tokens/s,
TFLOP/s and MFU per point, optionally per GEMM precision (`--gemm`), through P's prefill
graphs (`--graphs`), with device (`--profile`) or host (`--host-profile`) profiles (the
columns: docs/performance.md, "What each benchmark measures"). The first frames run as
P's do (`--depth-kernels`, `--frame-graphs`: P's start_first_frames). `--device cpu` with
`--model tiny` is a smoke test. Never re-implements the forward: it calls P's.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field, field_validator

from pdunit.bench import report
from pdunit.engine.loadgen.summary import Column, machine_info, text_table
from pdunit.engine.model.config import ModelConfig
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.transformer import GEMM_PRECISIONS
from pdunit.engine.prefill.runner import random_chunks, run_prefill, start_first_frames
from pdunit.engine.settings import FirstFrameFields, parse_config

BENCH = "prefill"
# Dense bf16 tensor-core peaks (TFLOP/s) by a token of the GPU's name; MFU is reported
# against these unless --peak-tflops says otherwise.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0}

COLUMNS = [
    Column("gemm", "gemm", "{}"),
    Column("graphs", "graphs", "{}"),
    Column("replayed", "replayed", "{}"),
    Column("first_frames", "first frames", "{}"),
    Column("prompts", "prompts"),
    Column("rows", "rows"),
    Column("tokens", "tokens"),
    Column("ms", "ms", "{:.2f}"),
    Column("ms_p90", "ms p90", "{:.2f}"),
    Column("tokens_per_s", "tokens/s", "{:.0f}"),
    Column("us_per_token", "us/token", "{:.2f}"),
    Column("tflops", "TFLOP/s", "{:.1f}"),
    Column("mfu", "MFU (bf16 peak)", "{:.1%}"),
    Column("speedup", "vs bf16", "{:.2f}x"),
]
HOST_COLUMNS = [
    Column("function", "function", "{}"), Column("self_ms", "self ms per forward", "{:.3f}"),
    Column("cum_ms", "incl. callees", "{:.3f}"), Column("calls", "calls", "{}"),
]
KERNEL_COLUMNS = [
    Column("kernel", "kernel", "{}"), Column("ms", "device ms per forward", "{:.3f}"),
    Column("share", "share", "{:.1%}"), Column("calls", "calls", "{}"),
]


class PrefillBenchConfig(FirstFrameFields):
    model: str = Field("qwen3-4b-shape", description="model config name (random weights)")
    device: str = Field("cuda", description="cuda (the measurement) or cpu (smoke test)")
    dtype: str | None = Field(None, description="compute dtype (default: the model's; bfloat16 for the 4B shape)")
    gemm: list[str] = Field(["bf16"], description="GEMM precisions to measure, each at every point (bf16, fp8)")
    points: str = Field("1x1500,4x1500,5x1600,8x1000,16x512",
                        description="PROMPTSxROWS batches, comma list (P batches up to 8192 rows by default)")
    iters: int = Field(10, gt=0, description="timed forwards per point")
    warmup: int = Field(3, ge=0, description="untimed forwards per point")
    seed: int = Field(0, ge=0)
    peak_tflops: float = Field(0.0, ge=0, description="the GPU's peak for MFU (0: from the GPU name when known)")
    profile: bool = Field(False, description="top CUDA kernels per forward (torch.profiler)")
    host_profile: bool = Field(False, description="top host functions per forward (cProfile)")
    graphs: bool = Field(False, description="also measure every point through the prefill CUDA graphs (CUDA only)")
    graph_rows: list[int] = Field(default_factory=list, description="--graphs: the graphs' row buckets, as the "
                                  "engines' --prefill-graph-rows (default: theirs, 128 to 2048): a point larger "
                                  "than the largest runs eagerly on the graph row too")
    out: str = Field("", description="results JSON path or folder ('' = print only)")

    @field_validator("gemm")
    @classmethod
    def _gemms(cls, v: list[str]) -> list[str]:
        bad = [g for g in v if g not in GEMM_PRECISIONS]
        if bad or not v or len(set(v)) != len(v):
            raise ValueError(f"{v}: give each of {', '.join(GEMM_PRECISIONS)} at most once")
        return v


def parse_points(text: str) -> list[tuple[int, int]]:
    points = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, sep, b = part.lower().partition("x")
        try:
            prompts, rows = int(a), int(b)
        except ValueError:
            raise ValueError(f"--points: {part!r} is not PROMPTSxROWS") from None
        if not sep or prompts < 1 or rows < 2:
            raise ValueError(f"--points: {part!r} needs >= 1 prompt of >= 2 rows")
        points.append((prompts, rows))
    if not points:
        raise ValueError("--points is empty")
    return points


def forward_flops(c: ModelConfig, prompts: int, rows: int) -> float:
    """FLOPs of one prefill forward over `prompts` prompts of `rows` rows."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    linear = c.hidden * (q + 2 * kv) + q * c.hidden + 3 * c.hidden * c.ffn_hidden
    tokens = prompts * rows
    attention = 2 * c.n_heads * c.head_dim * rows * rows  # QK^T and PV, causal half, x2 FLOP/MAC
    return c.n_layers * (2.0 * linear * tokens + prompts * attention)


def peak_for(machine: dict[str, Any], given: float) -> float | None:
    if given:
        return given
    name = str(machine.get("gpu_model") or "")
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def measure(model: Any, storage: torch.Tensor, prompts: int, rows: int, cfg: PrefillBenchConfig,
            rng: np.random.Generator, graphs: Any = None) -> tuple[list[float], Any, list[dict[str, Any]] | None]:
    chunks = random_chunks(model, [rows] * prompts, rng)
    for _ in range(cfg.warmup):
        run_prefill(model, storage, chunks, graphs)
    times = []
    for _ in range(cfg.iters):
        t0 = time.perf_counter()
        run_prefill(model, storage, chunks, graphs)  # ends with the first frames on the host
        times.append(time.perf_counter() - t0)
    prof = None
    if cfg.profile and storage.is_cuda:
        # a pass of its own after the timed one: the profiler's overhead stays out of `ms`
        from torch.profiler import ProfilerActivity, profile, record_function

        # CPU too: the host calls that hold the GPU idle (a blocking copy, a sync) show there
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(cfg.iters):
                with record_function(FORWARD_MARK):
                    run_prefill(model, storage, chunks, graphs)
    host = host_profile(model, storage, chunks, cfg.iters, graphs=graphs) if cfg.host_profile else None
    return times, prof, host


def host_profile(model: Any, storage: torch.Tensor, chunks: list[Any], iters: int, n: int = 15,
                 graphs: Any = None) -> list[dict[str, Any]]:
    """The `n` functions with the most self host time per forward, by cProfile, in a
    pass of its own (cProfile slows Python itself: compare shares, not totals)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        run_prefill(model, storage, chunks, graphs)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    ranked = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [{"function": f"{Path(f).name}:{line}({name})", "self_ms": round(tt / iters * 1e3, 3),
             "cum_ms": round(ct / iters * 1e3, 3), "calls": round(nc / iters, 1)}
            for (f, line, name), (_cc, nc, tt, ct, _callers) in ranked]


def trace_events(prof: Any) -> list[dict[str, Any]]:
    """The profile's chrome-trace events (kineto's own export, read back)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            return list(json.load(f).get("traceEvents", []))


FORWARD_MARK = "pdunit_prefill_forward"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # device operations in a chrome trace


def device_idle(events: list[dict[str, Any]], n: int = 6, min_gap_us: float = 20.0) -> dict[str, Any]:
    """Where the GPU sat idle inside the profiled forwards (each one inside a
    FORWARD_MARK annotation), the median over forwards (the first profiled forward pays
    the profiler's own start-up): `lead_ms` from the call to its
    first device operation (host preparation), `inner_ms` between device operations
    (kernels, copies, memsets), `tail_ms` from the last one to the call's return
    (sampling the first frames and reading them back); the largest inner gaps with the
    operations around them; and the host runtime calls that took longest (a blocking
    copy or a sync holds the GPU idle)."""
    marks = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == FORWARD_MARK]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e),
                    key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e]
    if not marks or not device:
        return {"forwards": 0}
    leads: list[float] = []
    inners: list[float] = []
    tails: list[float] = []
    gaps: list[tuple[float, str, str]] = []
    calls: dict[str, list[float]] = {}
    for m in marks:
        w0, w1 = m["ts"], m["ts"] + m["dur"]
        ops = [e for e in device if w0 <= e["ts"] <= w1]
        if not ops:
            continue
        leads.append(ops[0]["ts"] - w0)
        inner = 0.0
        end, before = ops[0]["ts"] + ops[0]["dur"], ops[0]["name"]
        for e in ops[1:]:
            gap = e["ts"] - end
            if gap > 0:
                inner += gap
                if gap >= min_gap_us:
                    gaps.append((gap, before, e["name"]))
            if e["ts"] + e["dur"] > end:
                end, before = e["ts"] + e["dur"], e["name"]
        inners.append(inner)
        tails.append(max(0.0, w1 - end))
        for e in runtime:
            if w0 <= e["ts"] <= w1:
                calls.setdefault(e["name"], []).append(e["dur"])
    if not leads:
        return {"forwards": 0}
    k = len(marks)
    gaps.sort(reverse=True)
    slow = sorted(calls.items(), key=lambda kv: sum(kv[1]), reverse=True)[:n]
    return {
        "forwards": k,
        "wall_ms": round(statistics.median(m["dur"] for m in marks) / 1e3, 3),
        "lead_ms": round(statistics.median(leads) / 1e3, 3), "inner_ms": round(statistics.median(inners) / 1e3, 3),
        "tail_ms": round(statistics.median(tails) / 1e3, 3),
        "gaps": [{"ms": round(g / 1e3, 3), "after": a[:60], "before": b[:60]} for g, a, b in gaps[:n]],
        "runtime": [{"call": name, "ms": round(sum(d) / 1e3 / k, 3), "calls": round(len(d) / k, 1),
                     "max_ms": round(max(d) / 1e3, 3)} for name, d in slow],
    }


def top_kernels(events: list[dict[str, Any]], iters: int, n: int = 12) -> list[dict[str, Any]]:
    """Device operations by total time per forward, from the trace (device events only:
    the CPU ops the profiler also records carry the time of the kernels they launch)."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in events:
        if e.get("cat") in DEVICE_CATS and "dur" in e:
            total[e["name"]] = total.get(e["name"], 0.0) + e["dur"]
            count[e["name"]] = count.get(e["name"], 0) + 1
    whole = sum(total.values()) or 1.0
    ranked = sorted(total.items(), key=lambda kv: kv[1], reverse=True)[:n]
    return [{"kernel": name[:90], "ms": round(us / 1e3 / iters, 4), "share": round(us / whole, 4),
             "calls": round(count[name] / iters, 1)} for name, us in ranked]


def run_prefill_bench(cfg: PrefillBenchConfig, command: str) -> dict[str, Any]:
    points = parse_points(cfg.points)
    if cfg.graphs and not cfg.device.startswith("cuda"):
        raise SystemExit(f"pdunit bench prefill: --graphs needs a CUDA device, not --device {cfg.device}")
    model = load_model(f"random:{cfg.model}:{cfg.seed}", device=cfg.device, dtype=cfg.dtype)
    storage = model.new_kv_storage(max(p * r for p, r in points), device=cfg.device)
    try:  # P's first frames: its depth kernels, its frame graphs up to the largest point's prompts
        first = start_first_frames(model, cfg, max(p for p, _ in points), logging.getLogger("pdunit.bench"))
    except ValueError as exc:
        raise SystemExit(f"pdunit bench prefill: {exc}") from None
    print(f"depth kernels: {first.depth_kernels}; frame graphs: "
          f"{first.frame_graphs.sizes if first.frame_graphs is not None else 'off'}", flush=True)
    machine = machine_info()
    peak = peak_for(machine, cfg.peak_tflops) if storage.is_cuda else None
    rows_out: list[dict[str, Any]] = []
    for gemm in cfg.gemm:
        model.set_prefill_gemm(gemm)
        # the same prompts in every precision: each precision restarts the seed
        rows_out += _measure_points(model, storage, points, cfg, peak, gemm, None)
        if cfg.graphs:
            from pdunit.engine.model.prefill_graphs import DEFAULT_ROW_BUCKETS
            from pdunit.engine.prefill.runner import capture_prefill_graphs

            # captured after the eager points: those compiled every kernel already
            runner = capture_prefill_graphs(model, storage, True, max(p for p, _ in points),
                                            cfg.graph_rows or DEFAULT_ROW_BUCKETS)
            rows_out += _measure_points(model, storage, points, cfg, peak, gemm, runner)
    by_point = {(r["prompts"], r["rows"]): r["ms"] for r in rows_out if r["gemm"] == "bf16" and not r["graphs"]}
    for r in rows_out:
        bf16 = by_point.get((r["prompts"], r["rows"]))
        r["speedup"] = round(bf16 / r["ms"], 3) if bf16 else None
    summary = {"peak_tflops": peak, "model": cfg.model, "dtype": str(model.dtype).replace("torch.", ""),
               "depth_kernels": first.depth_kernels,  # what --depth-kernels resolved to
               "frame_graph_buckets": first.frame_graphs.sizes if first.frame_graphs is not None else None,
               "best_us_per_token": {g: min(r["us_per_token"] for r in rows_out if r["gemm"] == g)
                                     for g in cfg.gemm}}
    return report.Results(BENCH, machine, command, cfg.model_dump(), rows_out, summary).document()


def _measure_points(model: Any, storage: torch.Tensor, points: list[tuple[int, int]], cfg: PrefillBenchConfig,
                    peak: float | None, gemm: str, graphs: Any) -> list[dict[str, Any]]:
    rng = np.random.default_rng(cfg.seed)
    rows_out = []
    for prompts, rows in points:
        replays = graphs.stats["replays"] if graphs is not None else 0
        frame_replays = _frame_replays(model)
        times, prof, host = measure(model, storage, prompts, rows, cfg, rng, graphs)
        ms = statistics.median(times) * 1e3
        tokens = prompts * rows
        tflops = forward_flops(model.config, prompts, rows) / (ms * 1e-3) / 1e12
        row: dict[str, Any] = {
            "gemm": gemm, "graphs": graphs is not None,
            "replayed": graphs is not None and graphs.stats["replays"] > replays,
            # the first frames: frame graph replays (P's), or eager (off, or more prompts than a bucket)
            "first_frames": "graph" if _frame_replays(model) > frame_replays else "eager",
            "prompts": prompts, "rows": rows, "tokens": tokens, "ms": round(ms, 3),
            "ms_p90": round(float(np.percentile(times, 90)) * 1e3, 3),
            "tokens_per_s": round(tokens / (ms * 1e-3), 1), "us_per_token": round(ms * 1e3 / tokens, 3),
            "tflops": round(tflops, 2), "mfu": round(tflops / peak, 4) if peak else None,
        }
        if prof is not None:
            events = trace_events(prof)
            row["kernels"] = top_kernels(events, cfg.iters)
            row["idle"] = device_idle(events)
        if host is not None:
            row["host"] = host
        rows_out.append(row)
        print(f"{gemm}{' graphs' if graphs is not None else ''} {prompts}x{rows}: {row['ms']:.2f} ms, {row['us_per_token']:.2f} us/token", flush=True)
    return rows_out


def _frame_replays(model: Any) -> int:
    return model.frame_graphs.stats["replays"] if model.frame_graphs is not None else 0


def main(argv: list[str]) -> int:
    cfg = parse_config(PrefillBenchConfig, argv, "pdunit bench prefill")
    doc = run_prefill_bench(cfg, report.command_line(argv, prog="pdunit bench prefill"))
    print(text_table(doc["rows"], COLUMNS))
    for row in doc["rows"]:
        if row.get("host"):
            print(f"\nhost functions, {row['gemm']}, {row['prompts']} x {row['rows']} rows:")
            print(text_table(row["host"], HOST_COLUMNS))
        if row.get("kernels"):
            print(f"\ntop kernels, {row['gemm']}, {row['prompts']} x {row['rows']} rows:")
            print(text_table(row["kernels"], KERNEL_COLUMNS))
            idle = row["idle"]
            if idle["forwards"]:
                print(f"GPU idle per forward of {idle['wall_ms']} ms: {idle['lead_ms']} ms before its first "
                      f"operation, {idle['inner_ms']} ms between operations, {idle['tail_ms']} ms after the last")
                print(f"largest gaps: {idle['gaps']}\nhost runtime calls per forward: {idle['runtime']}")
    report.print_and_write(doc, cfg.out, COLUMNS, "Prefill forward throughput vs the compute peak")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
