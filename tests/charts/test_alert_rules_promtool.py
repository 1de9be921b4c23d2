"""The shipped alert rules evaluated by Prometheus's own `promtool test rules` over
synthetic series: who fires and with which labels (issue 28: CPU units must not fire
the TCP alert; issue 24: a set without headroom does).

promtool: $PDUNIT_PROMTOOL, else `promtool` on PATH, else the one built into the cache
(`GOBIN=~/.cache/pdunit/promtool/v3 go install
github.com/prometheus/prometheus/cmd/promtool@v0.316.0`); the test is skipped, saying so,
when none is there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdunit.operator.alerts import ALERTS
from tests.charts.test_dashboard import CHART

RULES = CHART / "alerts" / "pdunit.rules.yaml"
CACHED = Path.home() / ".cache" / "pdunit" / "promtool" / "v3" / "promtool"


def promtool() -> str:
    for candidate in (os.environ.get("PDUNIT_PROMTOOL"), shutil.which("promtool"), str(CACHED)):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.skip(f"no promtool (set PDUNIT_PROMTOOL or build it into {CACHED.parent}, see the docstring)")


def expected(name: str, **labels: str) -> dict[str, Any]:
    """An alert as promtool reports it: its labels and its annotations, templates expanded."""
    (alert,) = [a for a in ALERTS if a.name == name]

    def expand(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.([a-z_]+) \}\}", lambda m: labels[m.group(1)], text)

    return {
        "exp_labels": {"severity": alert.severity, **labels},
        "exp_annotations": {"summary": expand(alert.summary), "description": expand(alert.description),
                            "runbook_url": alert.runbook_url},
    }


def run(tmp_path: Path, series: list[dict[str, str]], checks: list[dict[str, Any]]) -> None:
    test = {"rule_files": [str(RULES)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}]}
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    out = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def P(pod: str, mode: str, value: int, ns: str = "tts") -> dict[str, str]:  # noqa: N802
    return {"series": f'pdunit_transfer_mode{{namespace="{ns}",pod="{pod}",decode="decode",'
                      f'pdunit_transfer_mode="{mode}"}}', "values": f"{value}x20"}


def probe(pod: str, mode: str, outcome: str, ns: str = "tts") -> dict[str, str]:
    return {"series": f'pdunit_transfer_probe_total{{namespace="{ns}",pod="{pod}",mode="{mode}",'
                      f'outcome="{outcome}"}}', "values": "1x20"}


def test_tcp_alert_fires_for_a_gpu_unit_that_fell_back_and_never_for_cpu_units(tmp_path: Path) -> None:
    series = [
        # a CPU unit whose spec names tcp: tcp in use, nothing probed
        P("cpu-tcp", "tcp", 1), P("cpu-tcp", "host", 0),
        # a CPU unit on auto: host chosen; the proxy (no sidecar) failed, tcp not needed
        P("cpu-auto", "host", 1), P("cpu-auto", "tcp", 0), probe("cpu-auto", "proxy", "failed"),
        probe("cpu-auto", "host", "ok"),
        # a GPU unit on auto where ipc and the proxy failed: it fell back to tcp
        P("gpu-fell", "tcp", 1), P("gpu-fell", "ipc", 0), probe("gpu-fell", "ipc", "failed"),
        probe("gpu-fell", "proxy", "failed"), probe("gpu-fell", "tcp", "ok"),
        # a GPU unit on auto that got ipc
        P("gpu-ok", "ipc", 1), P("gpu-ok", "tcp", 0), probe("gpu-ok", "fabric", "failed"),
        probe("gpu-ok", "ipc", "ok"),
    ]
    run(tmp_path, series, [{"eval_time": "10m", "alertname": "PdunitTransferOnTcp",
                            "exp_alerts": [expected("PdunitTransferOnTcp", namespace="tts", pod="gpu-fell")]}])


def test_no_headroom_fires_for_a_set_whose_every_d_is_at_zero(tmp_path: Path) -> None:
    def d(pod: str, pdunit_set: str, value: int) -> dict[str, str]:
        return {"series": f'pdunit_rate_floor_headroom_streams{{namespace="tts",pod="{pod}",'
                          f'pdunit_dev_set="{pdunit_set}",container="decode"}}', "values": f"{value}x20"}

    series = [d("full-1", "full", 0), d("full-2", "full", 0),
              d("room-1", "room", 0), d("room-2", "room", 3),
              d("cpu-1", "cpu", -1), d("cpu-2", "cpu", -1)]  # admission off: no limit known
    run(tmp_path, series, [{"eval_time": "10m", "alertname": "PdunitSetNoHeadroom",
                            "exp_alerts": [expected("PdunitSetNoHeadroom", namespace="tts",
                                                    pdunit_dev_set="full")]}])


def test_rate_alert_compares_the_slowest_streams_with_twice_each_units_frame_rate(tmp_path: Path) -> None:
    from pdunit.engine.lb.metrics import RATE_BUCKETS

    def unit(pod: str, frame_rate_hz: float, rates_le: float) -> list[dict[str, str]]:
        """A unit's LB: its frame rate, and 60 streams a minute, each at a rate in the bucket
        ending at `rates_le` (so p1 lies just above the bucket's lower edge)."""
        labels = f'namespace="tts",pod="{pod}",container="lb"'
        series = [{"series": f"pdunit_lb_frame_rate_hz{{{labels}}}", "values": f"{frame_rate_hz}x30"}]
        for le in [*(str(float(b)) for b in RATE_BUCKETS), "+Inf"]:
            growth = "60" if le == "+Inf" or float(le) >= rates_le else "0"
            series.append({"series": f'pdunit_lb_stream_rate_frames_per_second_bucket{{{labels},le="{le}"}}',
                           "values": f"0+{growth}x30"})
        return series

    series = [*unit("csm-slow", 12.5, 21), *unit("csm-ok", 12.5, 30),  # p1 ~12.6 and ~25.05: floor 25
              *unit("pdunit-slow", 21.0, 42), *unit("pdunit-ok", 21.0, 50)]  # p1 ~30.1 and ~42.1: floor 42
    run(tmp_path, series, [{"eval_time": "20m", "alertname": "PdunitStreamRateLow",
                            "exp_alerts": [expected("PdunitStreamRateLow", namespace="tts", pod=pod)
                                           for pod in ("csm-slow", "pdunit-slow")]}])


def test_scaler_alert_names_the_set_it_cannot_read(tmp_path: Path) -> None:
    series = [
        {"series": 'pdunit_scaler_unreachable_units{namespace="tts",unit_set="voices",pod="op-1"}',
         "values": "2x20"},
        {"series": 'pdunit_scaler_unreachable_units{namespace="lab",unit_set="music",pod="op-1"}',
         "values": "0x20"},
    ]
    run(tmp_path, series, [{"eval_time": "10m", "alertname": "PdunitScalerUnitsUnreachable",
                            "exp_alerts": [expected("PdunitScalerUnitsUnreachable", namespace="tts",
                                                    unit_set="voices")]}])
