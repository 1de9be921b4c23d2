"""The engine's commands: one subcommand per process, dispatched lazily.

Each subcommand lives in its own module exposing `main(argv: list[str]) -> int`; this file
only maps names to modules, so `pdunit lb` never imports torch or kopf. The `pdunit`
command is pkg/cli.py, which adds `bench`: the engine never imports bench.
`python -m pdunit.engine.cli NAME` runs one of these (what `pdunit local` and tests start).
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
}
HELP_HINT = "`pdunit <command> --help` lists each command's options (flags or PDUNIT_* env)."


def command_lines(commands: dict[str, tuple[str, str]]) -> list[str]:
    """The usage's head: its first line and one line per command."""
    return ["usage: pdunit <command> [options]", "", "commands:",
            *(f"  {name:<10} {text}" for name, (_, text) in commands.items())]


def usage() -> str:
    return "\n".join([*command_lines(SUBCOMMANDS), "", HELP_HINT])


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
