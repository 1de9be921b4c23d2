"""The Prometheus alerting rules shipped in the chart (charts/pdunit/alerts/pdunit.rules.yaml,
a PrometheusRule when `prometheusRule.enabled`), generated here as the dashboard is, so
that every rule names metrics the code exports and a unit pod serves
(tests/charts/test_alerts.py, tests/operator/test_pod_metrics.py).

`python -m pdunit.operator.alerts charts/pdunit/alerts/pdunit.rules.yaml` rewrites it.

Thresholds are the product's own: 42 frames/s per stream (BENCHMARKS.md's capacity rule
at 2x real time), TTFA p95 500 ms, any stutter, any KV checksum mismatch, any stream cut.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import yaml


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str


_BY_POD = "namespace, pod"

ALERTS: list[Alert] = [
    Alert(
        "PdunitTransferOnTcp",
        'max by (namespace, pod) (pdunit_transfer_mode_info{mode="tcp"}) == 1',
        "1m", "warning",
        "Unit {{ $labels.pod }} moves KV over TCP",
        "P writes KV to D over loopback TCP, tens of times slower than the proxy or a direct "
        "mode. On a GPU unit with transfer auto every faster mode failed its verified probe "
        "(the PDUnit's TcpFallback condition; P's 'transfer probe' log lines name each error). "
        "Expected only for CPU units or a spec that asks for tcp.",
    ),
    Alert(
        "PdunitKVChecksumMismatch",
        f"sum by ({_BY_POD}) (increase(pdunit_kv_mismatch_total[10m])) > 0",
        "0m", "critical",
        "KV checksum mismatch in unit {{ $labels.pod }}",
        "D read KV rows whose checksum differs from what P wrote: the transfer corrupted them. "
        "The affected streams were failed, never served; a repeat points at the transport or "
        "the GPUs.",
    ),
    Alert(
        "PdunitStreamsStutter",
        f"sum by ({_BY_POD}) (increase(pdunit_lb_stutter_streams_total[10m])) > 0",
        "0m", "warning",
        "Streams of unit {{ $labels.pod }} stalled",
        "A listener's playback buffer ran empty in the last 10 minutes: the unit is past its "
        "capacity (add units or lower keda.targetInFlightPerUnit) or a stage froze.",
    ),
    Alert(
        "PdunitStreamRateLow",
        "histogram_quantile(0.01, sum by (le, namespace, pod) "
        "(rate(pdunit_lb_stream_rate_frames_per_second_bucket[10m]))) < 42",
        "10m", "warning",
        "Slowest streams of unit {{ $labels.pod }} under 42 frames/s",
        "The 1st percentile of per-stream rates is below 42 frames/s (2x real time): the margin "
        "that absorbs a burst is gone. D's step time and batch (dashboard) say whether decode "
        "is the limit.",
    ),
    Alert(
        "PdunitTTFAHigh",
        "histogram_quantile(0.95, sum by (le, namespace, pod) (rate(pdunit_lb_ttfa_seconds_bucket[10m]))) > 0.5",
        "10m", "warning",
        "TTFA p95 of unit {{ $labels.pod }} above 500 ms",
        "Time to first audio p95 is above 500 ms: P's queue under bursts (the waterfall stages "
        "on the dashboard show which).",
    ),
    Alert(
        "PdunitPrefillHeldAborts",
        f"max by ({_BY_POD}) (pdunit_prefill_held_aborts) > 0",
        "5m", "warning",
        "P of unit {{ $labels.pod }} holds unanswered aborts",
        "P could not confirm an abort to D for 5 minutes, so D keeps those pages held; the "
        "quiesce guard restarts P when they pass its limit.",
    ),
    Alert(
        "PdunitDecodeDraining",
        f"max by ({_BY_POD}) (pdunit_decode_draining) == 1",
        "10m", "warning",
        "D of unit {{ $labels.pod }} refuses new streams",
        "D's held pages are above its drain fraction, so it takes no new streams until they are "
        "released; held pages on the dashboard show whether they come back.",
    ),
    Alert(
        "PdunitStreamsCutByDrain",
        "sum by (namespace) (increase(pdunit_operator_streams_cut_total[30m])) > 0",
        "0m", "warning",
        "A drain cut streams",
        "A unit's drain passed drainTimeoutSeconds with streams still running and the operator "
        "cut them (the PDUnit's DrainForced event names how many).",
    ),
    Alert(
        "PdunitScalerUnitsUnreachable",
        "max(pdunit_scaler_unreachable_units) > 0",
        "5m", "warning",
        "The KEDA scaler cannot read some units' load",
        "Units that do not answer /v1/load are left out of the decode in-flight count KEDA "
        "scales on: the count is low and KEDA may scale down under load.",
    ),
]


def rules() -> dict:
    return {"groups": [{"name": "pdunit", "rules": [
        {
            "alert": a.name,
            "expr": a.expr,
            **({"for": a.for_} if a.for_ != "0m" else {}),
            "labels": {"severity": a.severity},
            "annotations": {"summary": a.summary, "description": a.description},
        }
        for a in ALERTS
    ]}]}


def render() -> str:
    header = "# Generated by `python -m pdunit.operator.alerts`; edit operator/alerts.py.\n"
    return header + yaml.safe_dump(rules(), sort_keys=False, width=100)


def main(argv: list[str]) -> int:
    path = argv[0] if argv else "charts/pdunit/alerts/pdunit.rules.yaml"
    with open(path, "w") as f:
        f.write(render())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
