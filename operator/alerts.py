"""The Prometheus alerting rules shipped in the chart (charts/pdunit/alerts/pdunit.rules.yaml,
a PrometheusRule when `prometheusRule.enabled`), generated here as the dashboard is, so
that every rule names metrics the code exports and a unit pod serves
(tests/charts/test_alerts.py, tests/operator/test_pod_metrics.py).
`make chart-files` rewrites it (operator/chart_files.py).

Every alert keeps the labels that say where to look (namespace, and pod, set or unit
set) and links its runbook: a section of docs/runbooks.md named after the alert.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

# Where docs/runbooks.md is published; the chart's prometheusRule.runbookBaseUrl
# replaces it (a fork's or a mirror's copy of the same file).
# Thresholds are the product's own: a stream's rate floor of 2x real time (BENCHMARKS.md's
# capacity rule; real time is the frame rate the unit's LB exports, which follows the
# model: CSM's Mimi 12.5 Hz -> 25 frames/s, the pdunit family's 21 Hz -> 42), TTFA p95 500 ms, any stutter, any KV checksum mismatch, any
# stream cut. A runbook section says what the alert means, how to check, what to do
# (tests/charts/test_alerts.py holds each to that). The unit pods' `pdunit.dev/set` label
# reaches the series as `pdunit_dev_set` (the PodMonitor's podTargetLabels).
RUNBOOK_BASE = "https://github.com/pdunit/pdunit/blob/main/docs/runbooks.md"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    @property
    def runbook_url(self) -> str:
        # GitHub's anchor of a "## <AlertName>" heading: the name in lower case
        return f"{RUNBOOK_BASE}#{self.name.lower()}"


_BY_POD = "namespace, pod"
_BY_SET = "namespace, pdunit_dev_set"
# A unit's rate floor, per pod: 2x the frames' real-time rate (D's Hello, via the LB).
_FLOOR_BY_POD = f"2 * max by ({_BY_POD}) (pdunit_lb_frame_rate_hz)"

ALERTS: list[Alert] = [
    Alert(
        "PdunitTransferOnTcp",
        # tcp in use where a GPU mode's verified probe failed: transfer auto fell back on
        # a GPU unit. CPU units never probe the GPU modes (D offers none), and a spec that
        # names tcp probes nothing: neither fires.
        f'max by ({_BY_POD}) (pdunit_transfer_mode{{pdunit_transfer_mode="tcp"}}) == 1 '
        f"and on ({_BY_POD}) "
        f'max by ({_BY_POD}) (pdunit_transfer_probe_total{{mode=~"fabric|posix-fd|ipc",outcome="failed"}}) > 0',
        "1m", "warning",
        "Unit {{ $labels.namespace }}/{{ $labels.pod }} fell back to KV over TCP",
        "Transfer auto on a GPU unit found no faster mode that passed its verified probe, so P "
        "writes KV to D over loopback TCP, tens of times slower than the proxy or a direct "
        "mode (the PDUnit's TcpFallback condition; P's 'transfer probe' log lines name each "
        "error).",
    ),
    Alert(
        "PdunitKVChecksumMismatch",
        f"sum by ({_BY_POD}) (increase(pdunit_kv_mismatch_total[10m])) > 0",
        "0m", "critical",
        "KV checksum mismatch in unit {{ $labels.namespace }}/{{ $labels.pod }}",
        "D read KV rows whose checksum differs from what P wrote: the transfer corrupted them. "
        "The affected streams were failed, never served; a repeat points at the transport or "
        "the GPUs.",
    ),
    Alert(
        "PdunitStreamsStutter",
        f"sum by ({_BY_POD}) (increase(pdunit_lb_stutter_streams_total[10m])) > 0",
        "0m", "warning",
        "Streams of unit {{ $labels.namespace }}/{{ $labels.pod }} stalled",
        "A listener's playback buffer ran empty in the last 10 minutes: the unit is past its "
        "capacity (add units or lower keda.targetInFlightPerUnit) or a stage froze.",
    ),
    Alert(
        "PdunitStreamRateLow",
        "histogram_quantile(0.01, sum by (le, namespace, pod) "
        f"(rate(pdunit_lb_stream_rate_frames_per_second_bucket[10m]))) < on ({_BY_POD}) {_FLOOR_BY_POD}",
        "10m", "warning",
        "Slowest streams of unit {{ $labels.namespace }}/{{ $labels.pod }} under the rate floor",
        "The 1st percentile of per-stream rates is below the unit's rate floor, 2x real time "
        "(2 x pdunit_lb_frame_rate_hz, the model's frame rate: 25 frames/s for CSM's 12.5-Hz codec): "
        "the margin that absorbs a burst is gone. D's step time and batch (dashboard) say whether "
        "decode is the limit.",
    ),
    Alert(
        "PdunitTTFAHigh",
        "histogram_quantile(0.95, sum by (le, namespace, pod) (rate(pdunit_lb_ttfa_seconds_bucket[10m]))) > 0.5",
        "10m", "warning",
        "TTFA p95 of unit {{ $labels.namespace }}/{{ $labels.pod }} above 500 ms",
        "Time to first audio p95 is above 500 ms: P's queue under bursts (the waterfall stages "
        "on the dashboard show which).",
    ),
    Alert(
        "PdunitPrefillHeldAborts",
        f"max by ({_BY_POD}) (pdunit_prefill_held_aborts) > 0",
        "5m", "warning",
        "P of unit {{ $labels.namespace }}/{{ $labels.pod }} holds unanswered aborts",
        "P could not confirm an abort to D for 5 minutes, so D keeps those pages held; the "
        "quiesce guard restarts P when they pass its limit.",
    ),
    Alert(
        "PdunitDecodeDraining",
        f"max by ({_BY_POD}) (pdunit_decode_draining) == 1",
        "10m", "warning",
        "D of unit {{ $labels.namespace }}/{{ $labels.pod }} refuses new streams",
        "D's held pages are above its drain fraction, so it takes no new streams until they are "
        "released; held pages on the dashboard show whether they come back.",
    ),
    Alert(
        "PdunitStreamsCutByDrain",
        "sum by (namespace) (increase(pdunit_operator_streams_cut_total[30m])) > 0",
        "0m", "warning",
        "A drain in {{ $labels.namespace }} cut streams",
        "A unit's drain passed drainTimeoutSeconds with streams still running and the operator "
        "cut them (the PDUnit's DrainForced event names how many).",
    ),
    Alert(
        "PdunitSetNoHeadroom",
        # every D of the set at 0 (a D without admission reports -1, so it never fires)
        f"max by ({_BY_SET}) (pdunit_rate_floor_headroom_streams) == 0",
        "5m", "warning",
        "Set {{ $labels.namespace }}/{{ $labels.pdunit_dev_set }} has no rate-floor headroom",
        "No D of the set would admit one more stream like its recent ones without breaking "
        "its rate floor (pdunit_rate_floor_frames_per_second, 2x real time unless --rate-floor "
        "says otherwise): new streams get 503 rate_floor until streams end or units are added "
        "(KEDA with metric headroom, or a larger replicas).",
    ),
    Alert(
        "PdunitScalerUnitsUnreachable",
        # the scaler's own namespace/unit_set labels (the PodMonitor honours them)
        "max by (namespace, unit_set) (pdunit_scaler_unreachable_units) > 0",
        "5m", "warning",
        "The KEDA scaler cannot read the load of units of {{ $labels.namespace }}/{{ $labels.unit_set }}",
        "Units that do not answer /v1/load are left out of the count KEDA scales on: the "
        "count is low and KEDA may scale down under load.",
    ),
]


def rules() -> dict:
    return {"groups": [{"name": "pdunit", "rules": [
        {
            "alert": a.name,
            "expr": a.expr,
            **({"for": a.for_} if a.for_ != "0m" else {}),
            "labels": {"severity": a.severity},
            "annotations": {"summary": a.summary, "description": a.description,
                            "runbook_url": a.runbook_url},
        }
        for a in ALERTS
    ]}]}


def render() -> str:
    header = "# Generated by `make chart-files`; edit operator/alerts.py.\n"
    return header + yaml.safe_dump(rules(), sort_keys=False, width=100)

