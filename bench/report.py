"""Shared output of every benchmark (BENCHMARKS.md section 6): machine, tables, files, plots.

Owns: describing the machine (GPU model, count and driver when there are GPUs; CPU
model and count), the exact command, the results JSON (`bench`, `machine`, `command`,
`config`, `rows`, `summary`) and its Markdown table beside it at
`bench/results/<bench>-<YYYYMMDD>-<machine>.json`, plain-text tables for stdout,
percentiles, and line plots (matplotlib, Agg). Benchmarks call these; this module
never measures anything itself.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------ numbers


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """q-th percentile (0..100, linear interpolation); None for no values."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return None
    return float(np.percentile(arr, q))


def percentiles(
    values: Sequence[float] | np.ndarray, qs: Sequence[float] = (50, 95, 99)
) -> dict[str, float | None]:
    """{"p50": ..., "p95": ..., "p99": ...} (None entries for no values)."""
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q:g}": (float(np.percentile(arr, q)) if arr.size else None) for q in qs}


# ------------------------------------------------------------------ machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> tuple[list[str], str | None, list[str]]:
    """GPU names, driver and UUIDs: nvidia-smi when present (no torch import), else
    torch.cuda (no UUIDs). The UUIDs say whether two runs had the same physical GPUs: a
    lent machine may be a different host at every call."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name,driver_version,uuid", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
            rows = [
                [c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()
            ]
            if rows:
                return ([r[0] for r in rows], rows[0][1] if len(rows[0]) > 1 else None,
                        [r[2] for r in rows if len(r) > 2])
        except (OSError, subprocess.SubprocessError):
            pass
    if "torch" in sys.modules or os.environ.get("PDUNIT_BENCH_PROBE_TORCH") == "1":
        try:
            import torch

            if torch.cuda.is_available():
                names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                return names, f"cuda {torch.version.cuda}", []
        except Exception:  # noqa: BLE001 - no usable torch means no GPU info, not a failure
            pass
    return [], None, []


def machine_info() -> dict[str, Any]:
    names, driver, uuids = _gpus()
    return {
        "hostname": platform.node(),
        "gpu_model": names[0] if names else None,
        "gpu_count": len(names),
        "gpus": names,
        "gpu_uuids": uuids,
        "driver": driver,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


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


# ------------------------------------------------------------------ tables


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str = "{}"  # applied to non-None values

    def cell(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        if isinstance(value, float) and math.isnan(value):
            return "nan"
        return self.fmt.format(value)


def text_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    cells = [[c.header for c in columns]] + [[c.cell(r) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    out = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "|".join("---:" for _ in columns) + "|",
    ]
    out += ["| " + " | ".join(c.cell(r) for c in columns) + " |" for r in rows]
    return "\n".join(out)


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
    lines: dict[str, tuple[Sequence[float], Sequence[float | None]]]
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
