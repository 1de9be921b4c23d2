"""The alerting rules: current with their generator, valid PromQL naming metrics the code
exports, and shipped as a PrometheusRule when asked."""

from __future__ import annotations

import re

import promql_parser
import pytest

from pdunit.operator.alerts import ALERTS, render, rules
from pdunit.operator.chart_files import metric_names
from tests.charts.test_dashboard import CHART, exported_metric_names
from tests.charts.test_helm_chart import by_kind, one
from tests.charts.test_helm_chart import render as render_chart


def test_rules_file_is_current():
    assert (CHART / "alerts" / "pdunit.rules.yaml").read_text() == render(), (
        "run: make chart-files")


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a.name)
def test_every_rule_is_promql_over_metrics_the_code_exports(alert):
    promql_parser.parse(alert.expr)  # raises on a syntax error, naming it
    used = metric_names(alert.expr)
    assert used and used <= exported_metric_names(), used - exported_metric_names()
    assert alert.severity in ("warning", "critical")
    assert re.fullmatch(r"\d+[smh]", alert.for_)


def test_a_broken_expression_is_caught():
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (le (rate(pdunit_lb_ttfa_seconds_bucket[5m]))")


def test_chart_ships_the_rules_as_a_prometheus_rule_when_enabled():
    assert not by_kind(render_chart([]), "PrometheusRule")
    doc = one(render_chart(["--set", "prometheusRule.enabled=true", "--set", "prometheusRule.labels.release=kps"]),
              "PrometheusRule")
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["metadata"]["labels"]["release"] == "kps"
    assert doc["spec"] == rules()
    assert len({a.name for a in ALERTS}) == len(ALERTS)
