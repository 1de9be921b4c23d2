"""`pdunit bench <name>`: every benchmark behind one command (BENCHMARKS.md).

Each benchmark is a module with `main(argv) -> int` that prints the machine, the exact
command, the config and a table, and can write results JSON/MD and a PNG plot.
"""

from __future__ import annotations

import importlib
import sys

BENCHES: dict[str, tuple[str, str]] = {
    "capacity": ("pdunit.bench.capacity", "streaming capacity of a unit or monolith (section 1)"),
    "compare": ("pdunit.bench.compare", "PD vs monolith variants side by side in one run (section 1)"),
    "transfer": ("pdunit.bench.transfer", "KV transfer backends, contiguous vs fragmented (section 2)"),
    "step": ("pdunit.bench.step", "decode step time vs the memory roofline (section 3)"),
    "mixed": ("pdunit.bench.mixed", "the monolith's mixed step (decode rows + prompt chunks), eager vs graph replay"),
    "codec": ("pdunit.bench.codec", "the codec's (Mimi stream decode) cost per call vs batch, eager vs CUDA graphs"),
    "prefill": ("pdunit.bench.prefill", "P's forward throughput vs the compute peak"),
    "attention": ("pdunit.bench.attention", "the prefill attention kernel's launch shapes vs torch SDPA"),
    "edges": ("pdunit.bench.edges", "LB validate+pack, router decision, scaler latency (section 4)"),
    "waterfall": ("pdunit.bench.waterfall", "per-stage p50/p99 of a load run (section 5)"),
    "router": ("pdunit.bench.router_bench", "routing decision latency with many units"),
    "faults": ("pdunit.bench.faults", "fault injection under live traffic: the page contract (PROTOCOL.md 7)"),
    "plan": ("pdunit.bench.plan", "capacity per variant predicted from measured step and prefill costs"),
    "pipeline": ("pdunit.bench.pipeline", "P's real pipeline against bench plan's model of it, on a CPU"),
    "stacks": ("pdunit.bench.stacks", "per-thread summary of an engine's --sample-stacks file"),
}


def listing() -> list[str]:
    """One line per benchmark, name and what it measures (`pdunit bench --help` and
    `pdunit --help` both print these)."""
    return [f"  {name:<10} {text}" for name, (_, text) in BENCHES.items()]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        text = "\n".join(["usage: pdunit bench <name> [options]", "", *listing(), "",
                          "`pdunit bench <name> --help` lists a benchmark's options."])
        print(text, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"pdunit bench: unknown benchmark {name!r}; known: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(BENCHES[name][0])
    except ModuleNotFoundError as exc:
        print(f"pdunit bench {name}: not available in this build ({exc})", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)
