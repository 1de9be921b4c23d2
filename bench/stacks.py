"""`pdunit bench stacks`: what an engine's `--sample-stacks` file says, per thread, as
text: each thread's share of the samples and its share outside known waits (running
Python or waiting for the GIL: P's forward launches contend with that), the frames it
was found in last (its own time: where it runs, or the call it is blocked in) and the
functions anywhere on its stack (inclusive). Reads the folded file
(`thread;outer;...;inner count`), writes nothing but stdout, or a Markdown copy with
--out.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

from pydantic import BaseModel, Field

from pdunit.engine.settings import parse_config


class StacksConfig(BaseModel):
    """pdunit bench stacks: per-thread summary of a --sample-stacks file."""

    file: str = Field(..., description="a folded stacks file written by an engine's --sample-stacks")
    top: int = Field(8, gt=0, description="frames listed per thread")
    out: str = Field("", description="also write the summary as Markdown here")


def read_folded(path: Path) -> dict[str, Counter[tuple[str, ...]]]:
    """thread -> Counter of its stacks (outermost first)."""
    threads: dict[str, Counter[tuple[str, ...]]] = defaultdict(Counter)
    for n, line in enumerate(path.read_text().splitlines(), 1):
        stack, sep, count = line.rpartition(" ")
        if not sep or not count.isdigit() or not stack:
            raise ValueError(f"{path}:{n}: not a folded stack line ('thread;frame;... count'): {line[:80]!r}")
        thread, *frames = stack.split(";")
        threads[thread][tuple(frames)] += int(count)
    return threads


# Innermost frames of a thread blocked with the GIL released: a condition or queue wait,
# a selector, a gRPC call's wait, an idle pool worker, a thread in C alone (gRPC's
# poller), a join. Any other innermost frame is Python running, or waiting for the GIL
# to run, or a C call made from it: what other threads' kernel launches contend with.
WAITING = frozenset({
    "threading.py:wait", "threading.py:wait_for", "threading.py:_wait_for_tstate_lock", "threading.py:run",
    "selectors.py:select", "_channel.py:_blocking", "thread.py:_worker", "queue.py:get",
})


def summarize(threads: dict[str, Counter[tuple[str, ...]]], top: int) -> str:
    total = {t: sum(c.values()) for t, c in threads.items()}
    out = ["| thread | samples | share of all | outside known waits |", "|---|---:|---:|---:|"]
    everything = sum(total.values()) or 1
    for t in sorted(total, key=lambda t: -total[t]):
        running = sum(n for frames, n in threads[t].items() if frames and frames[-1] not in WAITING)
        out.append(f"| {t} | {total[t]} | {total[t] / everything:.1%} | {running / (total[t] or 1):.1%} |")
    for t in sorted(total, key=lambda t: -total[t]):
        own: Counter[str] = Counter()
        inclusive: Counter[str] = Counter()
        for frames, count in threads[t].items():
            if frames:
                own[frames[-1]] += count
            for f in set(frames):
                inclusive[f] += count
        out += ["", f"### {t} ({total[t]} samples)", "", "| innermost frame | share | | on the stack | share |",
                "|---|---:|---|---|---:|"]
        mine, anywhere = own.most_common(top), inclusive.most_common(top)
        for i in range(max(len(mine), len(anywhere))):
            a = mine[i] if i < len(mine) else ("", 0)
            b = anywhere[i] if i < len(anywhere) else ("", 0)
            cells = [a[0], f"{a[1] / total[t]:.1%}" if a[0] else "", "", b[0], f"{b[1] / total[t]:.1%}" if b[0] else ""]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    cfg = parse_config(StacksConfig, argv, "pdunit bench stacks")
    try:
        text = summarize(read_folded(Path(cfg.file)), cfg.top)
    except (OSError, ValueError) as exc:
        print(f"pdunit bench stacks: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    if cfg.out:
        Path(cfg.out).write_text(f"# Sampled stacks: {cfg.file}\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
