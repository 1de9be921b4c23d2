"""The Grafana dashboard: current with its generator, queries name real metrics, and the
chart ships it as a ConfigMap when asked."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import promql_parser
import yaml

from pdunit.operator.chart_files import metric_names
from pdunit.operator.dashboard import PANELS, render
from tests.charts.test_helm_chart import helm as pinned_helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdunit"
SOURCES = ["engine", "operator", "sidecars", "kernels"]


def exported_metric_names() -> set[str]:
    names: set[str] = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r'"(pdunit_[a-z0-9_]+)"', path.read_text()))
    return names


def test_dashboard_file_is_current():
    assert (CHART / "dashboards" / "pdunit.json").read_text() == render(), (
        "run: make chart-files")


def test_every_panel_queries_metrics_the_code_exports():
    exported = exported_metric_names()
    used = set()
    for _, _, targets in PANELS:
        for expr, _ in targets:
            used |= metric_names(expr)
    missing = {m for m in used if m not in exported}
    assert not missing, f"dashboard queries metrics nothing exports: {sorted(missing)}"


def test_every_panel_query_is_valid_promql():
    for title, _, targets in PANELS:
        for expr, _ in targets:
            try:
                promql_parser.parse(expr)
            except ValueError as exc:
                raise AssertionError(f"panel {title!r}: {expr}: {exc}") from exc


def test_chart_renders_the_dashboard_configmap_when_enabled():
    helm = pinned_helm()
    out = subprocess.run([helm, "template", "t", str(CHART), "--set", "grafanaDashboard.enabled=true"],
                         check=True, capture_output=True, text=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d and d.get("kind") == "ConfigMap"]
    (cm,) = [d for d in docs if d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert '"uid": "pdunit-overview"' in cm["data"]["pdunit.json"]
    default = subprocess.run([helm, "template", "t", str(CHART)], check=True, capture_output=True, text=True).stdout
    assert "-dashboard" not in default
