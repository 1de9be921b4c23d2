"""`pdunit bench router`: how long the router takes to pick a unit, with 100 units.

Times the routing decision alone (`RoutingTable.pick`: bounded-load ring walk for
session keys, least-loaded scan for the rest) over a table shaped like a busy cluster:
every unit carries a few dozen streams, a few units drain, are unready or unreachable,
session keys follow a skewed (Zipf) popularity so hot voices push their owners to the
bound. Streams open and close as the run goes, and units report their load now and
then, so the decision always sees a moving table. No network, no HTTP: this bench
measures the decision, never the proxy.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import random
import sys
import time
from typing import Any

from pdunit.engine.loadgen.summary import machine_info, percentile
from pdunit.engine.router.table import DiscoveredUnit, RoutingTable


def _percentile(sorted_ns: list[int], q: float) -> float:
    """q in 0..1 of nanosecond samples, in microseconds (NaN for none)."""
    value = percentile(sorted_ns, 100 * q)
    return float("nan") if value is None else value / 1000.0


def _row(kind: str, n_units: int, samples: list[int]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "units": n_units,
        "requests": kind,
        "n": len(ordered),
        "p50_us": round(_percentile(ordered, 0.50), 2),
        "p90_us": round(_percentile(ordered, 0.90), 2),
        "p99_us": round(_percentile(ordered, 0.99), 2),
        "p999_us": round(_percentile(ordered, 0.999), 2),
        "max_us": round(ordered[-1] / 1000.0, 2) if ordered else float("nan"),
        "mean_us": round(sum(ordered) / len(ordered) / 1000.0, 2) if ordered else float("nan"),
    }


def build_table(
    n_units: int, streams_per_unit: int, load_bound_factor: float, rng: random.Random
) -> RoutingTable:
    """A cluster snapshot: loads spread around the mean, ~3% draining, ~2% unready,
    ~1% unreachable (at least one of each when there are 10 units or more)."""
    quiet = logging.getLogger("pdunit.bench.router.table")
    quiet.setLevel(logging.ERROR)  # the scripted state changes are not news
    table = RoutingTable(load_bound_factor=load_bound_factor, logger=quiet)
    for i in range(n_units):
        name = f"tts-{i:04d}"
        table.upsert(DiscoveredUnit(name, f"http://10.0.{i // 250}.{i % 250}:8000"))
        table.apply_load(
            name,
            ready=True,
            draining=False,
            streams_in_flight=max(0, int(rng.gauss(streams_per_unit, streams_per_unit / 4))),
        )
    names = list(table.units)
    rng.shuffle(names)
    n_drain = max(1, n_units * 3 // 100) if n_units >= 10 else 0
    n_unready = max(1, n_units * 2 // 100) if n_units >= 10 else 0
    n_dead = max(1, n_units // 100) if n_units >= 10 else 0
    for name in names[:n_drain]:
        table.apply_load(name, ready=False, draining=True, streams_in_flight=5)
    for name in names[n_drain : n_drain + n_unready]:
        table.apply_load(name, ready=False, draining=False, streams_in_flight=0)
    for name in names[n_drain + n_unready : n_drain + n_unready + n_dead]:
        table.apply_poll_error(name, "poll failed: connection refused")
    return table


def run(
    n_units: int = 100,
    n_requests: int = 200_000,
    load_bound_factor: float = 1.25,
    keyed_share: float = 0.8,
    n_sessions: int = 20_000,
    zipf_s: float = 1.1,
    streams_per_unit: int = 40,
    seed: int = 0,
    print_table: bool = True,
) -> dict[str, Any]:
    """Time `n_requests` routing decisions over `n_units` units; returns the result doc."""
    rng = random.Random(seed)
    table = build_table(n_units, streams_per_unit, load_bound_factor, rng)
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(n_sessions)]
    sessions = [f"voice-{i}" for i in range(n_sessions)]
    keys: list[str | None] = [
        s if rng.random() < keyed_share else None
        for s in rng.choices(sessions, weights=weights, k=n_requests)
    ]
    # The router's own open streams: about as many as the units carry, so a stream
    # closes for every one that opens once the run is warm.
    target_open = n_units * streams_per_unit // 2
    open_streams: collections.deque[Any] = collections.deque()
    unit_names = list(table.units)
    keyed_ns: list[int] = []
    keyless_ns: list[int] = []
    how: collections.Counter[str] = collections.Counter()
    pick = table.pick
    clock = time.perf_counter_ns
    for i, key in enumerate(keys):
        t0 = clock()
        decision = pick(key)
        elapsed = clock() - t0
        (keyed_ns if key is not None else keyless_ns).append(elapsed)
        if decision is None:
            how["none"] += 1
            continue
        how[decision.how] += 1
        table.acquire(decision.unit)
        open_streams.append(decision.unit)
        if len(open_streams) > target_open:
            table.release(open_streams.popleft())
        if i % 500 == 0:  # a unit's poll answer lands: its load is corrected
            name = rng.choice(unit_names)
            unit = table.units[name]
            if unit.reachable and unit.ready and not unit.draining:
                table.apply_load(
                    name, ready=True, draining=False, streams_in_flight=unit.load
                )
    rows = [
        _row("all", n_units, keyed_ns + keyless_ns),
        _row("session key", n_units, keyed_ns),
        _row("no key", n_units, keyless_ns),
    ]
    decided = sum(how.values())
    summary = {
        "decision_p50_us": rows[0]["p50_us"],
        "decision_p99_us": rows[0]["p99_us"],
        "routable_units": table.routable_count(),
        "share_affinity": round(how["affinity"] / decided, 4),
        "share_walked_past_bound": round(how["walked"] / decided, 4),
        "share_least_loaded": round(how["least_loaded"] / decided, 4),
    }
    result = {
        "bench": "router",
        "machine": machine_info(),
        "command": "pdunit bench router " + " ".join(sys.argv[1:]) if sys.argv else "",
        "config": {
            "n_units": n_units,
            "n_requests": n_requests,
            "load_bound_factor": load_bound_factor,
            "keyed_share": keyed_share,
            "n_sessions": n_sessions,
            "zipf_s": zipf_s,
            "streams_per_unit": streams_per_unit,
            "vnodes": table.ring.vnodes,
            "seed": seed,
        },
        "rows": rows,
        "summary": summary,
    }
    if print_table:
        print(format_table(result))
    return result


def format_table(result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    lines = [
        f"router decision latency: {cfg['n_units']} units ({result['summary']['routable_units']} "
        f"routable), {cfg['n_requests']} decisions, c={cfg['load_bound_factor']}, "
        f"{cfg['vnodes']} vnodes, {int(cfg['keyed_share'] * 100)}% with a session key",
        f"machine: {m['cpu_count']} CPUs, {m['cpu_model']}, GPUs {m.get('gpu_count', 0)}",
        "",
        "| requests    |       n |   p50 us |   p90 us |   p99 us | p99.9 us |   max us |  mean us |",
        "|-------------|--------:|---------:|---------:|---------:|---------:|---------:|---------:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['requests']:<11} | {r['n']:>7} | {r['p50_us']:>8} | {r['p90_us']:>8} | "
            f"{r['p99_us']:>8} | {r['p999_us']:>8} | {r['max_us']:>8} | {r['mean_us']:>8} |"
        )
    s = result["summary"]
    lines.append("")
    lines.append(
        f"decisions: {s['share_affinity']:.1%} on the key's owner, "
        f"{s['share_walked_past_bound']:.1%} walked past a unit at its bound, "
        f"{s['share_least_loaded']:.1%} least-loaded (no key)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdunit bench router", description=__doc__)
    parser.add_argument("--units", type=int, default=100, help="units in the table")
    parser.add_argument("--requests", type=int, default=200_000, help="decisions to time")
    parser.add_argument("--load-bound-factor", type=float, default=1.25)
    parser.add_argument("--keyed-share", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="also write the result document here")
    args = parser.parse_args(argv)
    result = run(
        n_units=args.units,
        n_requests=args.requests,
        load_bound_factor=args.load_bound_factor,
        keyed_share=args.keyed_share,
        seed=args.seed,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
