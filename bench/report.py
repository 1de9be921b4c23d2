"""Shared output of every benchmark (BENCHMARKS.md section 6): result files, plots, scrapes.

Owns the results JSON (`bench`, `machine`, `command`, `config`, `rows`, `summary`) and
its Markdown table beside it at `bench/results/<bench>-<YYYYMMDD>-<machine>.json`, the
exact command, line plots (matplotlib, Agg) and a unit's metrics scrape. The numbers,
tables and machine description come from engine/loadgen/summary.py. Never measures
anything itself: a benchmark measures, this module only records.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdunit.engine.loadgen.summary import Column, markdown_table

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------ machine


def machine_slug(machine: Mapping[str, Any]) -> str:
    """Short file-name tag: `2xH200`, or `cpu2` without GPUs."""
    if machine.get("gpu_count"):
        model = str(machine.get("gpu_model") or "gpu")
        token = next(
            (t for t in model.replace("NVIDIA", "").split() if any(ch.isdigit() for ch in t)), model
        )
        return f"{machine['gpu_count']}x{''.join(ch for ch in token if ch.isalnum())}"
    return f"cpu{machine.get('cpu_count') or 0}"


def command_line(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    """The exact command, shell-quoted: `prog + argv` when given, else this process's argv."""
    if argv is None:
        return " ".join(shlex.quote(a) for a in sys.argv)
    parts = ([prog] if prog else []) + [shlex.quote(a) for a in argv]
    return " ".join(parts)


# ------------------------------------------------------------------ files


def default_result_path(
    bench: str,
    machine: Mapping[str, Any],
    directory: Path | None = None,
    today: dt.date | None = None,
) -> Path:
    day = (today or dt.date.today()).strftime("%Y%m%d")
    return (directory or RESULTS_DIR) / f"{bench}-{day}-{machine_slug(machine)}.json"


def resolve_out(out: str, bench: str, machine: Mapping[str, Any]) -> Path:
    """`x.json` is taken as is; anything else is a folder that gets the default name."""
    path = Path(out)
    if path.suffix == ".json":
        return path
    return default_result_path(bench, machine, directory=path)


@dataclass
class Results:
    bench: str
    machine: dict[str, Any]
    command: str
    config: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Results:
        """A document (`document()`'s shape, as a bench returns it) back into Results."""
        return cls(doc["bench"], doc["machine"], doc["command"], doc["config"], doc["rows"], doc["summary"])

    def document(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "machine": self.machine,
            "command": self.command,
            "config": self.config,
            "rows": self.rows,
            "summary": self.summary,
        }

    def markdown(self, columns: Sequence[Column], title: str | None = None) -> str:
        m = self.machine
        gpu = (
            f"{m['gpu_count']} x {m['gpu_model']} (driver {m['driver']})"
            if m.get("gpu_count")
            else "no GPU"
        )
        if m.get("gpu_uuids"):  # enough of each to tell two calls' GPUs apart
            gpu += " [" + ", ".join(u[:12] for u in m["gpu_uuids"]) + "]"
        lines = [
            f"# {title or self.bench}",
            "",
            f"- machine: {gpu}; {m.get('cpu_count')} CPUs ({m.get('cpu_model')}); {m.get('hostname')}",
            f"- command: `{self.command}`",
            f"- config: `{json.dumps(self.config, sort_keys=True)}`",
            "",
            markdown_table(self.rows, columns),
            "",
            "Summary:",
            "",
            "```json",
            json.dumps(self.summary, indent=2, sort_keys=True),
            "```",
            "",
        ]
        return "\n".join(lines)

    def write(
        self, path: Path, columns: Sequence[Column], title: str | None = None
    ) -> tuple[Path, Path]:
        """Write `path` (JSON) and the same name with `.md`; returns both paths."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(self.document(), indent=2, sort_keys=False, default=_json_default) + "\n"
        )
        md = path.with_suffix(".md")
        md.write_text(self.markdown(columns, title))
        return path, md


def write_results(doc: Mapping[str, Any], out: str, columns: Sequence[Column], title: str) -> tuple[Path, Path]:
    """A bench's results document to `out` (a .json path or a folder: resolve_out), as
    JSON and Markdown; returns both paths."""
    path = resolve_out(out, doc["bench"], doc["machine"])
    return Results.from_document(doc).write(path, columns, title)


def print_and_write(doc: Mapping[str, Any], out: str, columns: Sequence[Column], title: str) -> None:
    """The end of a bench's main: its summary printed, then its results written to `out`
    ('' = print only) with the paths printed."""
    print("summary:", doc["summary"])
    if out:
        json_path, md_path = write_results(doc, out, columns, title)
        print(f"wrote {json_path} and {md_path}")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ------------------------------------------------------------------ plots


@dataclass
class Panel:
    """One subplot: lines keyed by label -> (xs, ys); optional horizontal guide lines."""

    ylabel: str
    lines: Mapping[str, tuple[Sequence[float], Sequence[float | None]]]
    guides: dict[str, float] = field(default_factory=dict)
    ylim: tuple[float | None, float | None] | None = None


def plot_panels(path: str | Path, title: str, xlabel: str, panels: Sequence[Panel]) -> Path:
    """Stacked line plots sharing the x axis, written as PNG (Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(panels), 1, figsize=(7, 2.8 * len(panels)), sharex=True, squeeze=False
    )
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        for label, (xs, ys) in panel.lines.items():
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for label, y in panel.guides.items():
            ax.axhline(y, linestyle="--", color="grey", linewidth=1)
            ax.annotate(
                label,
                xy=(0.01, y),
                xycoords=("axes fraction", "data"),
                fontsize=8,
                color="grey",
                va="bottom",
            )
        if panel.ylim:
            ax.set_ylim(*panel.ylim)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        if panel.lines:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel(xlabel)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def scrape_metrics(port: int) -> dict[str, float]:
    """A local process's Prometheus text -> {'name{labels}': value} (histograms come as
    their _sum/_count/_bucket series)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out
