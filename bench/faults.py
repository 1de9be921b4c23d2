"""`pdunit bench faults`: fault injection under live traffic, judged (PROTOCOL.md section 7).

Owns the run (fault_unit's unit and traffic, fault_scenarios' faults until `--transfers`
and `--faults` are reached), its verdict (`evaluate`: errors within their bound, held
pages back to 0, KV mismatches == corruptions, the frames canary; `judge_stalls`: no
kind of fault slowed the streams it did not touch, against the run's own baseline) and
the report and result files. tests/faults/ runs it with bounded counts, one prompt bank
per module and one unit per transport for several runs (`run_on`); standalone:
`python -m pdunit.bench.faults --transfers 20000 --faults 500`. Never reports a run with
a violation as passing: every breach is listed, with its numbers.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pdunit.bench.fault_scenarios import FaultRecord, Scenario, StallRelay, schedule
from pdunit.bench.fault_unit import KINDS, FaultsConfig, Outcome, Prompt, Traffic, Unit, build_bank
from pdunit.engine.proto import pdunit_pb2 as pb

log = logging.getLogger("pdunit.bench.faults")


# The fields that shape the unit (and the scenario's waits): a run on a started unit
# must use the unit's values.
UNIT_FIELDS = ("transfer", "device", "isolate", "model", "pool_tokens", "transfer_deadline_ms",
               "request_deadline_ms", "chunk_tokens", "chunk_delay_ms")


def fault_kinds(cfg: FaultsConfig) -> list[str]:
    """cfg.kinds as a list, checked against the transport and the device."""
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
    return kinds


def run(cfg: FaultsConfig, run_dir: str | None = None, bank: list[Prompt] | None = None) -> dict[str, Any]:
    """One run on a unit of its own, started and stopped here. `bank`: prompts whose
    reference is already computed (tests share one per module; default: cfg's bank)."""
    kinds = fault_kinds(cfg)
    t_bank = time.monotonic()
    if bank is None:
        bank = build_bank(cfg)
    bank_s = time.monotonic() - t_bank
    unit_holder: dict[str, Unit] = {}
    relay = stall_relay(lambda: unit_holder["unit"]) if cfg.transfer == "tcp" else None
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


def stall_relay(unit_of: Callable[[], Unit]) -> StallRelay:
    """The stall relay in front of the tcp listener of D of the unit `unit_of()` returns
    (started before that unit: its P is given the relay's port)."""
    def target() -> tuple[str, int]:
        hello = unit_of().d_hello()
        d = next(t for t in hello.transports if t.mode == "tcp")
        return d.params["host"], int(d.params["port"])

    return StallRelay(target)


def run_on(unit: Unit, cfg: FaultsConfig, bank: list[Prompt], relay: StallRelay | None = None) -> dict[str, Any]:
    """One run on a unit already started and idle (tests run several on one unit); left
    idle again. cfg's unit fields must be the unit's; --transfer tcp needs `relay`, the
    stall relay the unit was started behind (`stall_relay`)."""
    kinds = fault_kinds(cfg)
    differ = [f"{k} {getattr(cfg, k)!r} (the unit's: {getattr(unit.cfg, k)!r})"
              for k in UNIT_FIELDS if getattr(cfg, k) != getattr(unit.cfg, k)]
    if differ:
        raise ValueError(f"run_on: the run's config differs from its unit's in {', '.join(differ)}")
    if cfg.transfer == "tcp" and relay is None:
        raise ValueError("run_on: --transfer tcp needs the stall relay its unit was started behind (stall_relay)")
    t_start = time.monotonic()
    report = _drive(cfg, unit, bank, kinds, relay)
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    report["reference_s"] = 0.0
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
        # Every fault starts under live traffic: the first once each client could have
        # completed a stream, each next once a stream sent after the last one completed
        # (the unit serves new requests again); a loaded machine waits longer, not less.
        unit.wait(lambda: traffic.completed() >= cfg.clients, cfg.recover_timeout_s, "traffic warm")
        while time.monotonic() - t0 < cfg.max_seconds:
            if traffic.completed() >= cfg.transfers and len(scenario.faults) >= cfg.faults:
                break
            kind = next(plan)
            rec = getattr(scenario, kind)()
            rec.t_end = time.monotonic()
            if cfg.transfer == "tcp":
                # the late chunks are the fault's last injection: its window closes after them
                scenario.replay_late_chunks(rec)
                rec.t_end = time.monotonic()
            scenario.faults.append(rec)
            log.info("fault done", extra={"kind": kind, **rec.detail})
            unit.wait(lambda t_end=rec.t_end: traffic.completed(since=t_end), cfg.recover_timeout_s,
                      f"a stream sent after {kind} completed")
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
        "fault_requests_refused": scenario.fault_refusals,
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
