"""Results on disk (BENCHMARKS.md section 6), tables, percentiles and plots."""

from __future__ import annotations

import datetime as dt
import json
import os

import numpy as np
import pytest

from pdunit.bench import report
from pdunit.engine.loadgen.summary import Column, machine_info, percentile, percentiles, text_table


def test_percentiles_interpolate_linearly_and_are_none_without_values():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 1) == pytest.approx(1.99)
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert percentiles([3.0]) == {"p50": 3.0, "p95": 3.0, "p99": 3.0}


def test_percentiles_of_infinite_rates_are_infinite_not_nan():
    """A stream whose frames all arrive at one instant has rate inf (engine/playback.py's
    stream_rate); numpy's interpolation made the percentiles of two such rates nan."""
    inf = float("inf")
    assert percentile([5.0, inf, inf], 50) == inf
    assert percentile([5.0, inf, inf], 75) == inf
    assert percentile([5.0, 7.0, inf], 75) == inf  # between 7 and inf
    assert percentile([5.0, 7.0, inf], 25) == pytest.approx(6.0)
    assert percentiles([inf, inf, inf, 1.0]) == {"p50": inf, "p95": inf, "p99": inf}
    rng = np.random.default_rng(3)
    finite = rng.normal(size=101)
    for q in (0, 1, 33.3, 50, 95, 99, 100):  # finite values: numpy's linear percentile
        assert percentile(finite, q) == pytest.approx(float(np.percentile(finite, q)))


def test_machine_info_names_gpus_and_cpus():
    m = machine_info()
    for key in ("gpu_model", "gpu_count", "driver", "cpu_count", "cpu_model", "hostname"):
        assert key in m
    assert m["cpu_count"] >= 1


def test_machine_info_reads_each_gpus_uuid_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"  # a stand-in printing two GPUs as the real one does
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 580.159.04, GPU-1a2b3c4d-0000-1111-2222-333344445555'\n"
                   "echo 'NVIDIA H200, 580.159.04, GPU-9f8e7d6c-0000-1111-2222-333344445555'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    m = machine_info()
    assert (m["gpu_count"], m["driver"]) == (2, "580.159.04")
    assert m["gpu_uuids"] == ["GPU-1a2b3c4d-0000-1111-2222-333344445555", "GPU-9f8e7d6c-0000-1111-2222-333344445555"]
    md = report.Results("x", m, "cmd", {}).markdown([Column("a", "a")])
    assert "2 x NVIDIA H200 (driver 580.159.04) [GPU-1a2b3c4d, GPU-9f8e7d6c]" in md


@pytest.mark.parametrize(
    ("machine", "slug"),
    [
        ({"gpu_count": 2, "gpu_model": "NVIDIA H200"}, "2xH200"),
        ({"gpu_count": 1, "gpu_model": "NVIDIA GeForce RTX 5090"}, "1x5090"),
        ({"gpu_count": 0, "cpu_count": 2}, "cpu2"),
    ],
)
def test_machine_slug_names_the_result_file(machine, slug):
    assert report.machine_slug(machine) == slug
    path = report.default_result_path("capacity", machine, today=dt.date(2026, 3, 1))
    assert path.name == f"capacity-20260301-{slug}.json"


def test_results_write_json_with_the_required_keys_and_a_markdown_table(tmp_path):
    machine = {
        "gpu_count": 0,
        "gpu_model": None,
        "driver": None,
        "cpu_count": 2,
        "cpu_model": "x",
        "hostname": "h",
    }
    res = report.Results(
        "capacity",
        machine,
        "pdunit bench capacity --concurrency 4",
        {"duration": 5},
        rows=[{"concurrency": 4, "stutter_share": 0.25, "p1_rate": None}],
        summary={"capacity": None},
    )
    cols = [
        Column("concurrency", "conc"),
        Column("stutter_share", "stutter", "{:.1%}"),
        Column("p1_rate", "p1", "{:.1f}"),
    ]
    json_path, md_path = res.write(report.resolve_out(str(tmp_path), "capacity", machine), cols)
    doc = json.loads(json_path.read_text())
    assert {"bench", "machine", "command", "config", "rows", "summary"} <= set(doc)
    assert doc["rows"][0]["stutter_share"] == 0.25
    md = md_path.read_text()
    assert "| 4 | 25.0% | - |" in md and "pdunit bench capacity --concurrency 4" in md
    assert report.resolve_out(str(tmp_path / "x.json"), "capacity", machine) == tmp_path / "x.json"


def test_text_table_aligns_columns():
    text = text_table(
        [{"a": 1, "b": 2.5}, {"a": 100, "b": None}],
        [Column("a", "A"), Column("b", "B", "{:.2f}")],
    )
    lines = text.splitlines()
    assert (
        lines[0].split() == ["A", "B"]
        and lines[2].split() == ["1", "2.50"]
        and lines[3].split() == ["100", "-"]
    )
    assert len({len(line) for line in lines}) == 1


def test_plot_panels_writes_a_png(tmp_path):
    out = report.plot_panels(
        tmp_path / "p.png",
        "t",
        "x",
        [report.Panel("y", {"a": ([1, 2, 3], [1.0, None, 3.0])}, guides={"floor": 2.0})],
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_is_shell_quoted():
    assert (
        report.command_line(["--out", "a b"], prog="pdunit bench x") == "pdunit bench x --out 'a b'"
    )
