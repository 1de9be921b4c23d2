"""The chart's files generated from code: the Grafana dashboard (operator/dashboard.py)
and the alert rules (operator/alerts.py), each written so that every query names a
metric the code exports. `make chart-files` (`python -m pdunit.operator.chart_files`)
rewrites both; tests/charts fail when either file is stale.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from pdunit.operator import alerts, dashboard

GENERATED: dict[str, Callable[[], str]] = {
    "charts/pdunit/dashboards/pdunit.json": dashboard.render,
    "charts/pdunit/alerts/pdunit.rules.yaml": alerts.render,
}


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
