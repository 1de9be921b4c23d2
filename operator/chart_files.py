"""The chart's files generated from code: the Grafana dashboard (operator/dashboard.py)
and the alert rules (operator/alerts.py), each written so that every query names a
metric the code exports. `make chart-files` (`python -m pdunit.operator.chart_files`)
rewrites both; tests/charts fail when either file is stale.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from pdunit.operator import alerts, dashboard

GENERATED: dict[str, Callable[[], str]] = {
    "charts/pdunit/dashboards/pdunit.json": dashboard.render,
    "charts/pdunit/alerts/pdunit.rules.yaml": alerts.render,
}


def queries() -> list[str]:
    """Every PromQL expression the chart ships: the dashboard's panels, then the alerts."""
    return [expr for _, _, targets in dashboard.PANELS for expr, _ in targets] + [a.expr for a in alerts.ALERTS]


_LABELS = re.compile(r"\{[^}]*\}|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def metric_names(expr: str) -> set[str]:
    """The pdunit metrics `expr` reads, as the code names them (a histogram's _bucket,
    _count and _sum series are its one name; a counter's _total suffix is kept). Label
    names (matchers, grouping: `pdunit_dev_set`, a state set's own label) are not metrics."""
    names = re.findall(r"pdunit_[a-z0-9_]+", _LABELS.sub(" ", expr))
    return {re.sub(r"_(bucket|count|sum)$", "", m) for m in names}


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(".")
    for rel, render in GENERATED.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render())
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
