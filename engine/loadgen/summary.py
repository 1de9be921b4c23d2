"""What a load's report is made of: percentiles, the machine it ran on, text and Markdown tables.

Owns the numbers and tables the load driver (driver.py) prints and every benchmark
writes (bench/report.py puts them into result files). Never measures, reads a unit or
writes a file: it only describes what a caller measured.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# ------------------------------------------------------------------ numbers


def _at(ordered: np.ndarray, q: float) -> float:
    """The q-th percentile of sorted values, interpolated linearly between neighbours; an
    infinite neighbour is the answer (numpy's interpolation makes inf - inf = nan of it: a
    stream whose frames all came at one instant has an infinite rate)."""
    pos = q / 100 * (ordered.size - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, ordered.size - 1)
    a, b, t = float(ordered[lo]), float(ordered[hi]), pos - lo
    if t == 0 or a == b:
        return a
    if math.isinf(a) or math.isinf(b):
        return a if math.isinf(a) else b
    return a + (b - a) * t


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """q-th percentile (0..100, linear interpolation); None for no values."""
    return percentiles(values, (q,))[f"p{q:g}"]


def percentiles(
    values: Sequence[float] | np.ndarray, qs: Sequence[float] = (50, 95, 99)
) -> dict[str, float | None]:
    """{"p50": ..., "p95": ..., "p99": ...} (None entries for no values)."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    if ordered.size and np.isnan(ordered[-1]):  # a nan value (sorted last) makes every percentile nan, as numpy's
        return {f"p{q:g}": math.nan for q in qs}
    return {f"p{q:g}": (_at(ordered, q) if ordered.size else None) for q in qs}


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
