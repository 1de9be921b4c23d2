"""The `pdunit` command: `bench` runs pdunit.bench, every other command the engine's CLI.

Owns the full command list and its usage (the engine's commands, then every benchmark).
It sits at the top of the package, the one module that may import every layer (bench
imports engine, never the reverse). Must never hold a command itself: each lives in its
own module with `main(argv) -> int`, imported only when it runs.
"""

from __future__ import annotations

import sys

from pdunit.engine import cli as engine_cli

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    **engine_cli.SUBCOMMANDS,
    "bench": ("pdunit.bench.main", "benchmarks, one per name below: `pdunit bench <name>`"),
}


def usage() -> str:
    """Every command, then every benchmark (bench/main.py BENCHES: the list is read from
    there, so it never falls behind)."""
    from pdunit.bench.main import listing  # names and texts only: imports no benchmark

    return "\n".join([*engine_cli.command_lines(SUBCOMMANDS), "", "benchmarks (pdunit bench <name>):",
                      *listing(), "", engine_cli.HELP_HINT])


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] not in SUBCOMMANDS:
        print(f"pdunit: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if args[0] != "bench":
        return engine_cli.main(args)
    from pdunit.bench.main import main as bench_main
    from pdunit.engine.observability import die_with_parent

    die_with_parent()
    return int(bench_main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
