"""`pdunit bench edges`, LB part: validate + pack of one prompt at the HTTP edge.

Times `engine/lb/validate.parse_request` on a 2000 x 11 prompt (BENCHMARKS.md section 4)
as JSON and as binary int32 / int64 bodies: median, p99 and mean over many
iterations, against the targets of issue 2 (binary <= 0.1 ms, JSON <= 2 ms median on
2 cores). The bodies are built once before timing; only the parse is timed. Other
edges (P admission, router decision, KEDA GetMetrics) add their own rows through
`run_edges`'s result shape: one row per edge. Never asserts timings in tests: targets
are checked here, by the benchmark, and reported.
"""

from __future__ import annotations

import functools
import gc
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from pdunit.bench import report
from pdunit.engine.lb.validate import Limits, parse_request
from pdunit.engine.loadgen.summary import Column, machine_info, text_table
from pdunit.engine.packing import pack
from pdunit.engine.settings import ConfigError, parse_config

BENCH = "edges"
TARGET_US = {"json": 2000.0, "binary-int32": 100.0, "binary-int64": 100.0}


class EdgesConfig(BaseModel):
    """pdunit bench edges: CPU-side latencies at the unit's edges."""

    rows: int = Field(2000, ge=1, description="prompt rows")
    cols: int = Field(11, ge=1, description="ids per row")
    vocab: int = Field(1024, ge=2, description="id range of every column")
    iterations: int = Field(2000, ge=10, description="timed iterations per case")
    seed: int = Field(0, description="prompt seed")
    others: bool = Field(True, description="also time the router decision and KEDA GetMetrics")
    units: int = Field(100, ge=1, description="units behind the router and the scaler")
    out: str = Field(
        "", description="results: a .json path or a folder (default name); empty = no files"
    )


def _time(fn: Callable[[], Any], iterations: int) -> np.ndarray:
    for _ in range(min(50, iterations)):
        fn()
    gc.collect()
    out = np.empty(iterations, dtype=np.float64)
    clock = time.perf_counter_ns
    for i in range(iterations):
        t = clock()
        fn()
        out[i] = clock() - t
    return out / 1000.0  # microseconds


def run_edges(config: EdgesConfig | dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = config if isinstance(config, EdgesConfig) else EdgesConfig.model_validate(config or {})
    limits = Limits(
        n_codebooks=cfg.cols,
        vocab_sizes=(cfg.vocab,) * cfg.cols,
        max_rows=max(4096, cfg.rows),
        max_body_bytes=64 << 20,
    )
    ids = np.random.default_rng(cfg.seed).integers(0, cfg.vocab, (cfg.rows, cfg.cols))
    # json.dumps' default separators: what a Python client sends.
    json_body = json.dumps({"prompt": ids.tolist(), "max_frames": 210}).encode()
    cases: dict[str, tuple[str, dict[str, str], bytes]] = {
        "json": ("application/json", {}, json_body),
        "binary-int32": (
            "application/octet-stream",
            {"x-pdunit-dtype": "int32", "x-pdunit-row-width": str(cfg.cols)},
            pack(ids, "i4"),
        ),
        "binary-int64": (
            "application/octet-stream",
            {"x-pdunit-dtype": "int64", "x-pdunit-row-width": str(cfg.cols)},
            pack(ids, "i8"),
        ),
    }
    rows: list[dict[str, Any]] = []
    for name, (ctype, headers, body) in cases.items():
        packed = parse_request(ctype, headers, body, limits)
        if packed.prompt.tolist() != ids.tolist():
            raise AssertionError(f"{name}: the packed prompt differs from the input")
        us = _time(functools.partial(parse_request, ctype, headers, body, limits), cfg.iterations)
        median = float(np.median(us))
        rows.append(
            {
                "edge": "lb_validate_pack",
                "format": name,
                "rows": cfg.rows,
                "cols": cfg.cols,
                "body_bytes": len(body),
                "iterations": cfg.iterations,
                "median_us": round(median, 2),
                "p99_us": round(float(np.percentile(us, 99)), 2),
                "mean_us": round(float(us.mean()), 2),
                "min_us": round(float(us.min()), 2),
                "target_median_us": TARGET_US[name],
                "within_target": median <= TARGET_US[name],
            }
        )
    summary = {f"lb_validate_pack_{r['format']}_median_us": r["median_us"] for r in rows}
    summary["all_within_target"] = all(r["within_target"] for r in rows)
    if cfg.others:
        rows += other_edges(cfg.units)
        for r in rows[len(cases):]:
            summary[f"{r['edge']}_{r['format'].replace(' ', '_')}_p99_us"] = r["p99_us"]
    return {"bench": BENCH, "config": cfg.model_dump(), "rows": rows, "summary": summary}


def other_edges(n_units: int) -> list[dict[str, Any]]:
    """The router's decision and KEDA's GetMetrics with `n_units` units (no targets: reported)."""
    from pdunit.bench.router_bench import run as run_router
    from pdunit.bench.scaler_bench import bench_scaler

    router = run_router(n_units=n_units, n_requests=50_000, print_table=False)["rows"][0]
    out = [{
        "edge": "router_decision", "format": f"{n_units} units", "iterations": router["n"],
        "median_us": router["p50_us"], "p99_us": router["p99_us"], "mean_us": router["mean_us"],
        "target_median_us": None, "within_target": None,
    }]
    for row in bench_scaler(n_units, requests=100)["rows"]:
        out.append({
            "edge": "keda_get_metrics", "format": f"{n_units} units {row['case']}", "iterations": row["requests"],
            "median_us": round(row["p50_ms"] * 1000, 1), "p99_us": round(row["p99_ms"] * 1000, 1),
            "target_median_us": None, "within_target": None,
        })
    return out


COLUMNS = [
    Column("edge", "edge"),
    Column("format", "format"),
    Column("rows", "rows"),
    Column("body_bytes", "bytes"),
    Column("median_us", "median us", "{:.1f}"),
    Column("p99_us", "p99 us", "{:.1f}"),
    Column("mean_us", "mean us", "{:.1f}"),
    Column("target_median_us", "target us", "{:.0f}"),
    Column("within_target", "ok"),
]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_config(EdgesConfig, args, prog="pdunit bench edges")
    except ConfigError:
        return 2
    result = run_edges(cfg)
    machine = machine_info()
    command = report.command_line(args, prog="pdunit bench edges")
    print(
        f"machine: {machine['cpu_count']} CPUs ({machine['cpu_model']}); GPUs: {machine['gpu_count']}"
    )
    print(f"command: {command}")
    print(text_table(result["rows"], COLUMNS))
    if cfg.out:
        res = report.Results(
            BENCH, machine, command, result["config"], result["rows"], result["summary"]
        )
        for path in res.write(
            report.resolve_out(cfg.out, BENCH, machine), COLUMNS, title="Edges (CPU)"
        ):
            print(f"wrote {path}")
    return 0 if result["summary"]["all_within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
