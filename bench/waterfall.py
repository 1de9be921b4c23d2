"""`pdunit bench waterfall`: where a request's time goes (BENCHMARKS.md section 5).

Runs streams against a unit (or starts a local one), takes the stage timestamps every
process stamped on the request (LB, P, D: one host, one wall clock) from each stream's
final record, orders the stages by their median offset, and prints p50/p99 of every
gap. The check: the stamped stages (LB receive -> LB last frame out) must account for
the client-measured time within `--tolerance` (5%): time nobody stamped is time nobody
can explain.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from pdunit.bench import report
from pdunit.bench.capacity import CapacityConfig, run_capacity
from pdunit.engine.loadgen.summary import Column, machine_info, percentile, text_table
from pdunit.engine.settings import parse_config

BENCH = "waterfall"
FIRST, LAST = "lb_received", "lb_last_frame_out"


class WaterfallConfig(BaseModel):
    """Per-stage latency of a load run and the check that stages add up to client time."""

    url: str = Field("", description="LB URL; empty = start a local CPU unit (tiny model)")
    mode: str = Field("pd", description="local unit: pd | monolith")
    requests: int = Field(40, gt=0, description="streams")
    concurrency: int = Field(4, gt=0, description="streams at once")
    prompt_rows: str = Field("200-400", description="prompt rows (a or a-b)")
    frames: str = Field("60", description="frames per stream (a or a-b)")
    tolerance: float = Field(0.05, gt=0, description="allowed |1 - stamped/client| at p95")
    out: str = Field("", description="results JSON path or folder (empty = do not write)")
    plot: str = Field("", description="write the waterfall as a PNG here")


def timeline(stream: dict[str, Any]) -> dict[str, int] | None:
    """Stage -> unix ns for one completed stream, with the client's own two ends."""
    final = stream.get("final") or {}
    stages = final.get("stages")
    if stream.get("error") or not stages or stream.get("last_frame_s") is None:
        return None
    t = {name: int(ns) for name, ns in stages.items()}
    t["client_send"] = int(stream["send_unix_ns"])
    t["client_last_frame"] = int(stream["send_unix_ns"] + stream["last_frame_s"] * 1e9)
    return t


def analyze(streams: list[dict[str, Any]], tolerance: float = 0.05) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lines = [t for t in (timeline(s) for s in streams) if t is not None]
    if not lines:
        raise ValueError("no completed stream carried stage stamps")
    names = sorted({n for t in lines for n in t},
                   key=lambda n: float(np.median([t[n] - t["client_send"] for t in lines if n in t])))
    rows: list[dict[str, Any]] = []
    for prev, name in zip(names, names[1:], strict=False):
        gaps = [(t[name] - t[prev]) / 1e6 for t in lines if name in t and prev in t]
        if gaps:
            rows.append({"stage": name, "after": prev, "n": len(gaps),
                         "p50_ms": percentile(gaps, 50), "p99_ms": percentile(gaps, 99)})
    client = np.array([(t["client_last_frame"] - t["client_send"]) / 1e6 for t in lines])
    stamped = np.array([(t[LAST] - t[FIRST]) / 1e6 if FIRST in t and LAST in t else np.nan for t in lines])
    ratio = stamped / client
    off = np.abs(1 - ratio[~np.isnan(ratio)])
    unexplained = percentile(off, 95)
    summary = {
        "streams": len(lines),
        "client_ms_p50": percentile(client, 50), "client_ms_p99": percentile(client, 99),
        "stamped_ms_p50": percentile(stamped[~np.isnan(stamped)], 50),
        "stamped_over_client_p50": percentile(ratio[~np.isnan(ratio)], 50),
        "unexplained_p95": unexplained,
        "tolerance": tolerance,
        "adds_up": bool(len(off) == len(lines) and unexplained is not None and unexplained <= tolerance),
    }
    return rows, summary


COLUMNS = [
    Column("stage", "stage", "{}"), Column("after", "after", "{}"),
    Column("n", "n", "{}"), Column("p50_ms", "p50 ms", "{:.3f}"),
    Column("p99_ms", "p99 ms", "{:.3f}"),
]


def run_waterfall(cfg: WaterfallConfig, command: str | None = None) -> dict[str, Any]:
    from pdunit.engine.loadgen.workload import parse_range

    unit = None
    url = cfg.url
    if not url:
        from pdunit.engine.local import LocalConfig, LocalUnit

        unit = LocalUnit(LocalConfig(mode=cfg.mode, lb_port=0, guard=False, log_level="warning",
                                     pool_tokens=32768, cache_tokens=32768)).__enter__()
        url = unit.url
    try:
        doc = run_capacity(CapacityConfig(
            url=url, concurrency=[cfg.concurrency], requests=cfg.requests,
            prompt_rows=parse_range(cfg.prompt_rows, "prompt_rows"), frames=parse_range(cfg.frames, "frames"),
            mode_label=f"waterfall-{cfg.mode}", gpus=0, progress=False,
        ), keep_streams=True)
    finally:
        if unit is not None:
            unit.__exit__(None, None, None)
    rows, summary = analyze(doc["streams"], cfg.tolerance)
    results = report.Results(BENCH, machine_info(), command or report.command_line(),
                             cfg.model_dump(), rows, summary)
    out = results.document()
    if cfg.out:
        path = report.resolve_out(cfg.out, BENCH, results.machine)
        out["files"] = [str(p) for p in results.write(path, COLUMNS, "Request waterfall")]
    if cfg.plot:
        out.setdefault("files", []).append(plot_waterfall(rows, cfg.plot))
    return out


def plot_waterfall(rows: list[dict[str, Any]], path: str) -> str:
    """Each stage as a bar from where the previous one ended (p50 gaps, stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    start = 0.0
    for i, row in enumerate(rows):
        ax.barh(i, row["p50_ms"], left=start, color="tab:blue")
        ax.plot([start + row["p50_ms"], start + row["p99_ms"]], [i, i], color="tab:red", linewidth=1)
        start += row["p50_ms"]
    ax.set_yticks(range(len(rows)), [r["stage"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the client sent the request (bars: p50 gaps; red: to p99)")
    ax.set_title("Request waterfall")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_waterfall(doc: dict[str, Any]) -> None:
    print(text_table(doc["rows"], COLUMNS))
    s = doc["summary"]
    print(f"\nclient time p50 {s['client_ms_p50']:.1f} ms, stamped {s['stamped_ms_p50']:.1f} ms "
          f"(ratio p50 {s['stamped_over_client_p50']:.3f}); unexplained p95 {100 * s['unexplained_p95']:.1f}% "
          f"-> {'adds up' if s['adds_up'] else 'DOES NOT add up'} within {100 * s['tolerance']:.0f}%")


def main(argv: list[str]) -> int:
    cfg = parse_config(WaterfallConfig, argv, "pdunit bench waterfall")
    doc = run_waterfall(cfg, report.command_line(argv, prog="pdunit bench waterfall"))
    print_waterfall(doc)
    return 0 if doc["summary"]["adds_up"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
