"""What the monitoring pieces promise together (issue 28): series grouped by PDUnitSet,
a dashboard filtered by namespace and set, alerts that keep their labels and link a
runbook, and KEDA on headroom (issue 24)."""

from __future__ import annotations

import re

import pytest

from pdunit.operator import models as m
from pdunit.operator import scaler
from pdunit.operator.alerts import ALERTS, RUNBOOK_BASE
from pdunit.operator.chart_files import metric_names
from pdunit.operator.dashboard import PANELS, VARIABLES
from pdunit.operator.pod import desired_pod
from pdunit.operator.proto import externalscaler_pb2 as pb
from tests.charts.test_dashboard import ROOT
from tests.charts.test_helm_chart import NAMESPACE, PROMETHEUS, one, render

RUNBOOKS = ROOT / "docs" / "runbooks.md"


def _sections() -> dict[str, str]:
    """docs/runbooks.md's `## <name>` sections, by name."""
    parts = re.split(r"^## (\S+)\n", RUNBOOKS.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_unit_series_carry_the_pods_set_and_unit_labels() -> None:
    docs = render(["--set", "podMonitor.enabled=true", *PROMETHEUS])
    units = one(docs, "PodMonitor", "rel-pdunit-units")
    assert units["spec"]["podTargetLabels"] == [m.LABEL_SET, m.LABEL_UNIT]
    unit = {"metadata": {"name": "voices-abc12", "namespace": NAMESPACE, "uid": "x",
                         "labels": {m.LABEL_SET: "voices"}},
            "spec": {"image": "i", "model": "random:tiny:0", "transfer": "proxy"}}
    labels = desired_pod(unit)["metadata"]["labels"]
    assert labels[m.LABEL_SET] == "voices" and labels[m.LABEL_UNIT] == "voices-abc12"
    # the scaler's own namespace label (the set's) survives the scrape of the operator
    control = one(docs, "PodMonitor", "rel-pdunit-control")
    (operator,) = [e for e in control["spec"]["podMetricsEndpoints"] if e["port"] == "metrics"]
    assert operator["honorLabels"] is True


def test_dashboard_filters_every_query_by_namespace_and_unit_queries_by_set() -> None:
    names = [v["name"] for v in VARIABLES]
    assert names == ["datasource", "namespace", "set"]
    by_name = {v["name"]: v for v in VARIABLES}
    assert "pdunit_dev_set" in by_name["set"]["query"]["query"]
    assert '$namespace' in by_name["set"]["query"]["query"]  # sets of the chosen namespaces
    for title, _, targets in PANELS:
        for expr, _ in targets:
            for name in metric_names(expr):
                series = rf"\b{name}(_bucket|_count|_sum)?\{{[^}}]*"
                assert re.search(series + r'namespace=~"\$namespace"', expr), (title, name)
                if not name.startswith(("pdunit_router_", "pdunit_operator_", "pdunit_scaler_")):
                    assert re.search(series + r'pdunit_dev_set=~"\$set"', expr), (title, name)
    # no panel sums units of several namespaces into one line
    assert all("by (pod)" not in expr for _, _, targets in PANELS for expr, _ in targets)


def test_the_dashboard_shows_headroom() -> None:
    exprs = [expr for _, _, targets in PANELS for expr, _ in targets]
    assert any("pdunit_rate_floor_headroom_streams" in e for e in exprs)
    assert any("pdunit_scaler_desired_units" in e for e in exprs)


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a.name)
def test_every_alert_links_a_runbook_that_says_what_how_to_check_and_what_to_do(alert) -> None:
    assert alert.runbook_url == f"{RUNBOOK_BASE}#{alert.name.lower()}"
    section = _sections().get(alert.name)
    assert section, f"docs/runbooks.md has no '## {alert.name}' section"
    for part in ("**What it means.**", "**How to check.**", "**What to do.**"):
        assert part in section, (alert.name, part)


def test_every_runbook_section_is_an_alert() -> None:
    assert set(_sections()) == {a.name for a in ALERTS}


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a.name)
def test_alerts_keep_the_labels_their_text_names(alert) -> None:
    """Every label the summary or description shows survives each aggregation, and each
    alert says where: its namespace at least."""
    named = set(re.findall(r"\$labels\.([a-z_]+)", alert.summary + alert.description))
    assert "namespace" in named, alert.summary
    groupings = [set(g.replace(" ", "").split(",")) for g in re.findall(r"\bby \(([^)]*)\)", alert.expr)]
    assert groupings, f"{alert.name} aggregates away every label"
    for grouping in groupings:
        assert named <= grouping, (alert.name, named - grouping)


def test_rules_point_at_the_configured_runbooks() -> None:
    base = "https://wiki.example.com/pdunit/runbooks"
    doc = one(render(["--set", "prometheusRule.enabled=true", "--set", f"prometheusRule.runbookBaseUrl={base}"]),
              "PrometheusRule")
    urls = [rule["annotations"]["runbook_url"] for g in doc["spec"]["groups"] for rule in g["rules"]]
    assert urls == [f"{base}#{a.name.lower()}" for a in ALERTS]
    default = one(render(["--set", "prometheusRule.enabled=true"]), "PrometheusRule")
    assert [rule["annotations"]["runbook_url"] for g in default["spec"]["groups"] for rule in g["rules"]] == [
        a.runbook_url for a in ALERTS]


def test_scaled_object_scales_on_headroom_when_asked() -> None:
    docs = render(["--set", "keda.enabled=true", "--set", "keda.metric=headroom",
                   "--set", "keda.targetHeadroomPerUnit=6"])
    (trigger,) = one(docs, "ScaledObject")["spec"]["triggers"]
    metadata = trigger["metadata"]
    assert metadata["metric"] == "headroom" and metadata["targetHeadroomPerUnit"] == "6"
    assert "targetInFlightPerUnit" not in metadata
    assert trigger["metricType"] == "AverageValue"
    parsed = scaler.Trigger.from_ref(pb.ScaledObjectRef(name="so", namespace=NAMESPACE, scalerMetadata=metadata))
    assert (parsed.metric, parsed.target_headroom_per_unit, parsed.target) == ("headroom", 6.0, 1.0)
    default = one(render(["--set", "keda.enabled=true"]), "ScaledObject")["spec"]["triggers"][0]["metadata"]
    assert default["metric"] == "inFlight" and "targetHeadroomPerUnit" not in default
