"""`pdunit bench capacity`: streaming capacity of a unit (BENCHMARKS.md section 1).

Runs the load driver (engine/loadgen/driver.py) over every level and decides the
capacity: the highest level that passes with every lower level passing too (a lower
bound when it is the highest measured). Owns that verdict, the steady-state length a
level needs, the results files (report.py) and the PNG plot. Never starts a unit; it
only measures one.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

from pydantic import Field

from pdunit.bench import report
from pdunit.engine.loadgen.driver import COLUMNS, LoadConfig, pass_criteria, run_load_async
from pdunit.engine.loadgen.summary import text_table
from pdunit.engine.settings import ConfigError, parse_config

BENCH = "capacity"


class CapacityConfig(LoadConfig):
    """pdunit bench capacity: streaming capacity of one unit behind an LB URL."""

    out: str = Field(
        "", description="results: a .json path or a folder (default name); empty = no files"
    )
    plot: str = Field("", description="write a PNG: stutter share and p1 rate per level")


# A level must hold this many lifetimes of its longest stream (max frames at the rate
# floor) to reach the unit's steady state: until then the streams in flight, and with
# them D's batch and every step's time, are still growing. Measured on 2026-11-30: 12-s
# levels (under one lifetime) put both PD and the monolith 20-40% above 60-s levels.
STEADY_LIFETIMES = 3.0


def steady_duration_s(cfg: CapacityConfig, floor: float | None = None) -> float:
    """The shortest --duration whose levels reach the steady state (STEADY_LIFETIMES);
    `floor`: the rate floor the rows were judged at (--api speech: the codec's), else --min-rate;
    with no floor (--min-rate 0) a stream's lifetime is taken at real time (--fps)."""
    return STEADY_LIFETIMES * cfg.frames[1] / (floor or cfg.min_rate or cfg.fps)


def short_levels_warning(name: str, duration: float, needed: float) -> str:
    return (f"WARNING: {name}: levels of {duration:g} s hold fewer than {STEADY_LIFETIMES:g} lifetimes of the "
            f"longest stream ({needed / STEADY_LIFETIMES:.0f} s at the rate floor): the unit does not reach its "
            f"steady state within a level and the capacities are optimistic; give --duration {needed:.0f} or more")


def rows_level_key(rows: list[dict[str, Any]]) -> str:
    """Which field names a row's level: "concurrency" (closed loop) or "rate" (Poisson)."""
    return "concurrency" if rows and rows[0]["concurrency"] is not None else "rate"


def summarize_run(rows: list[dict[str, Any]], cfg: CapacityConfig) -> dict[str, Any]:
    """Capacity = the highest level that passes (in every run of it) with every lower
    level passing too. When that is the highest level measured, the capacity is only a
    lower bound (`capacity_lower_bound_only`): the sweep never found where it fails.
    `capacity_bounds_per_gpu`: the interval the true capacity lies in, [the capacity (0
    when no level passed), the level that failed above it (None: none did)), per GPU."""
    key = rows_level_key(rows)
    capacity = failed_at = None
    levels = sorted({r[key] for r in rows})
    for level in levels:  # a level with several runs passes only if all do
        if not all(r["passed"] for r in rows if r[key] == level):
            failed_at = level
            break
        capacity = level
    summary: dict[str, Any] = {
        "criteria": {
            "stutter": 0,
            "errors": 0,  # a rate-floor refusal (503 rate_floor) is none
            "min_rate": cfg.min_rate,
            "ttfa_p95_ms": cfg.ttfa_p95_ms,
            "api": cfg.api,  # speech: TTFA at the first audio byte, audio stalls fail a level too
        },
        "levels": key,
    }
    per_gpu = (capacity / cfg.gpus) if (capacity is not None and cfg.gpus) else None
    if key == "concurrency":
        summary["capacity"] = capacity
    else:
        summary["capacity_rate"] = capacity
        # the level's runs (bench compare --repeat): the fewest listeners any of them had
        runs = [r["realtime_streams"] for r in rows if r["rate"] == capacity and r["realtime_streams"] is not None]
        streams = min(runs) if runs else None
        summary["realtime_streams_per_gpu"] = {
            cfg.mode_label: round(streams / cfg.gpus, 1) if streams is not None and cfg.gpus else None}
    # concurrent streams per GPU (closed loop), or arrivals/s per GPU (Poisson)
    summary["capacity_per_gpu"] = {cfg.mode_label: per_gpu}
    summary["capacity_lower_bound_only"] = {cfg.mode_label: capacity is not None and capacity == levels[-1]}
    # levels too short for the steady state (a --requests level has no set length)
    steady_s = steady_duration_s(cfg, next((r["rate_floor"] for r in rows if r.get("rate_floor")), None))
    summary["steady_state_s"] = round(steady_s, 1)
    summary["levels_too_short"] = {cfg.mode_label: not cfg.requests and cfg.duration < steady_s}
    if cfg.gpus:
        summary["capacity_bounds_per_gpu"] = {cfg.mode_label: [
            (capacity or 0) / cfg.gpus, None if failed_at is None else failed_at / cfg.gpus]}
    return summary


def _as_config(config: CapacityConfig | dict[str, Any]) -> CapacityConfig:
    return config if isinstance(config, CapacityConfig) else CapacityConfig.model_validate(config)


async def run_capacity_async(
    config: CapacityConfig | dict[str, Any], command: str | None = None, keep_streams: bool = False,
    window: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    cfg = _as_config(config)
    load = await run_load_async(cfg, keep_streams, window)
    # the rate and floor the rows were judged at (the unit's unless given: driver.resolve_rates)
    cfg = cfg.model_copy(update={k: load["config"][k] for k in ("fps", "min_rate")})
    rows = load["rows"]
    results_doc = report.Results(
        bench=BENCH,
        machine=load["machine"],
        command=command or report.command_line(),
        config=load["config"],
        rows=rows,
        summary=summarize_run(rows, cfg),
    )
    doc = results_doc.document()
    if keep_streams:
        doc["streams"] = load["streams"]
    if cfg.out:
        path = report.resolve_out(cfg.out, BENCH, load["machine"])
        json_path, md_path = results_doc.write(
            path, COLUMNS, title=f"Streaming capacity ({cfg.mode_label})"
        )
        doc["files"] = [str(json_path), str(md_path)]
    if cfg.plot:
        doc.setdefault("files", []).append(str(plot_capacity(rows, cfg.plot, cfg)))
    return doc


def run_capacity(
    config: CapacityConfig | dict[str, Any], command: str | None = None, keep_streams: bool = False,
    window: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every level against the LB and return the results document (report.Results);
    `window`: see driver.run_level."""
    return asyncio.run(run_capacity_async(config, command, keep_streams, window))


def plot_capacity(rows: list[dict[str, Any]], path: str, cfg: CapacityConfig) -> Any:
    key = rows_level_key(rows)
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_mode.setdefault(row["mode"], []).append(row)
    stutter = {
        m: (
            [r[key] for r in rs],
            [None if r["stutter_share"] is None else 100 * r["stutter_share"] for r in rs],
        )
        for m, rs in by_mode.items()
    }
    p1 = {m: ([r[key] for r in rs], [r["p1_rate"] for r in rs]) for m, rs in by_mode.items()}
    return report.plot_panels(
        path,
        "Streaming capacity",
        "concurrent streams" if key == "concurrency" else "arrivals/s",
        [
            report.Panel("stutter share (%)", stutter, ylim=(0, None)),
            report.Panel(
                "p1 stream rate (frames/s)",
                p1,
                guides={f"{cfg.min_rate:g} frames/s": cfg.min_rate},
                ylim=(0, None),
            ),
        ],
    )


def print_report(doc: dict[str, Any]) -> None:
    m = doc["machine"]
    gpu = (
        f"{m['gpu_count']} x {m['gpu_model']} (driver {m['driver']})"
        if m["gpu_count"]
        else "no GPU"
    )
    print(f"machine: {gpu}; {m['cpu_count']} CPUs ({m['cpu_model']})")
    print(f"command: {doc['command']}")
    cfg = {k: v for k, v in doc["config"].items() if k not in ("progress",)}
    print(f"config: {json.dumps(cfg, sort_keys=True)}")
    print()
    print(text_table(doc["rows"], COLUMNS))
    print(f"pass: {pass_criteria(doc['config'])}")
    print()
    for row in doc["rows"]:
        if row["error_kinds"]:
            level = row["concurrency"] if row["concurrency"] is not None else f"rate {row['rate']}"
            print(f"errors at {level}: {row['error_kinds']}")
    print(f"summary: {json.dumps(doc['summary'], sort_keys=True)}")
    for name, short in doc["summary"].get("levels_too_short", {}).items():
        if short:
            print(short_levels_warning(name, doc["config"]["duration"], doc["summary"]["steady_state_s"]),
                  file=sys.stderr)
    for path in doc.get("files", []):
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_config(CapacityConfig, args, prog="pdunit bench capacity")
    except ConfigError:
        return 2
    try:
        doc = run_capacity(cfg, command=report.command_line(args, prog="pdunit bench capacity"))
    except (RuntimeError, ValueError) as exc:
        print(f"pdunit bench capacity: {exc}", file=sys.stderr)
        return 1
    print_report(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
