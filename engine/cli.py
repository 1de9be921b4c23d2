"""The `pdunit` command: one subcommand per process, dispatched lazily.

Each subcommand lives in its own module exposing `main(argv: list[str]) -> int`; this
file only maps names to modules, so `pdunit lb` never imports torch or kopf.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "lb": ("pdunit.engine.lb.main", "in-pod load balancer: HTTP streaming API of one unit"),
    "prefill": ("pdunit.engine.prefill.main", "prefill engine (P): prompts -> KV + first frame"),
    "decode": ("pdunit.engine.decode.main", "decode engine (D): paged KV pool, continuous batching"),
    "monolith": ("pdunit.engine.monolith.main", "prefill and decode in one process (baseline)"),
    "proxy": ("pdunit.sidecars.nvlink_proxy.main", "nvlink-proxy sidecar: KV copy service"),
    "guard": ("pdunit.sidecars.quiesce_guard.main", "quiesce-guard sidecar: held-capacity watchdog"),
    "router": ("pdunit.engine.router.main", "cluster router: picks a unit by session affinity"),
    "operator": ("pdunit.operator.main", "kopf operator for PDUnit/PDUnitSet + KEDA scaler"),
    "local": ("pdunit.engine.local", "run a whole unit as local processes"),
    "bench": ("pdunit.bench.main", "benchmarks, one per name below: `pdunit bench <name>`"),
}


def usage() -> str:
    """Every command, then every benchmark (bench/main.py BENCHES: the list is read from
    there, so it never falls behind)."""
    from pdunit.bench.main import listing  # names and texts only: imports no benchmark

    lines = ["usage: pdunit <command> [options]", "", "commands:"]
    for name, (_, text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<10} {text}")
    lines += ["", "benchmarks (pdunit bench <name>):", *listing(), ""]
    lines.append("`pdunit <command> --help` lists each command's options (flags or PDUNIT_* env).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    from pdunit.engine.observability import die_with_parent

    die_with_parent()
    if name not in SUBCOMMANDS:
        print(f"pdunit: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
