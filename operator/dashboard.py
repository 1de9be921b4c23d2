"""The Grafana dashboard shipped in the chart (charts/pdunit/dashboards/pdunit.json),
generated here so that every panel's query names a metric the code really exports
(tests/charts/test_dashboard.py checks both: the file is current, the names exist), and
is filtered by the dashboard's namespace and set variables.

`make chart-files` rewrites it (operator/chart_files.py).
"""

from __future__ import annotations

import json
from typing import Any

# Every unit series is filtered by the dashboard's namespace and set variables (the set is
# the unit pod's pdunit.dev/set label, `pdunit_dev_set` through the PodMonitor's
# podTargetLabels); the router's and the operator's by namespace (the scaler's by set too).
U = '{namespace=~"$namespace", pdunit_dev_set=~"$set"}'
NS = '{namespace=~"$namespace"}'
SCALER = '{namespace=~"$namespace", unit_set=~"$set"}'


HELD = U[:-1] + ', state="held"}'
SERVING = U[:-1] + ', phase="serving"}'


# (title, unit, [(PromQL, legend)]) per panel, in reading order.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Streams in flight", "short", [
        (f"sum by (namespace, pod) (pdunit_lb_streams_in_flight{U})", "{{namespace}}/{{pod}} LB"),
        (f"sum by (namespace, pod) (pdunit_decode_streams{U})", "{{namespace}}/{{pod}} D"),
    ]),
    ("Per-stream rate floor (p1, frames/s)", "short", [
        (f"histogram_quantile(0.01, sum by (le) (rate(pdunit_lb_stream_rate_frames_per_second_bucket{U}[5m])))", "p1 rate"),
        (f"histogram_quantile(0.01, sum by (le) (rate(pdunit_lb_stream_worst_window_frames_bucket{U}[5m])))", "p1 worst 1 s window"),
        # the floor follows the model: 2x the frames' real-time rate D's Hello names
        (f"2 * max(pdunit_lb_frame_rate_hz{U})", "floor (2x real time)"),
    ]),
    ("Rate-floor headroom (streams D would still admit)", "short", [
        (f"sum by (namespace, pdunit_dev_set) (pdunit_rate_floor_headroom_streams{U} >= 0)",
         "{{namespace}}/{{pdunit_dev_set}} headroom"),
        (f"sum by (namespace, pdunit_dev_set) (rate(pdunit_rate_floor_refusals_total{U}[5m]))",
         "{{namespace}}/{{pdunit_dev_set}} refusals/s"),
        (f"max by (namespace, unit_set) (pdunit_scaler_desired_units{SCALER})",
         "{{namespace}}/{{unit_set}} units KEDA wants (metric headroom)"),
    ]),
    ("Stutter share", "percentunit", [
        (f"sum(rate(pdunit_lb_stutter_streams_total{U}[5m])) / clamp_min(sum(rate(pdunit_lb_stream_rate_frames_per_second_count{U}[5m])), 1e-9)", "streams that stalled"),
    ]),
    ("TTFA / TTFT", "s", [
        (f"histogram_quantile(0.95, sum by (le) (rate(pdunit_lb_ttfa_seconds_bucket{U}[5m])))", "TTFA p95"),
        (f"histogram_quantile(0.50, sum by (le) (rate(pdunit_lb_ttfa_seconds_bucket{U}[5m])))", "TTFA p50"),
        (f"histogram_quantile(0.95, sum by (le) (rate(pdunit_lb_ttft_seconds_bucket{U}[5m])))", "TTFT p95"),
    ]),
    ("KV transfer time", "s", [
        (f"histogram_quantile(0.99, sum by (le, mode) (rate(pdunit_transfer_seconds_bucket{U}[5m])))", "p99 {{mode}}"),
        (f"histogram_quantile(0.50, sum by (le, mode) (rate(pdunit_transfer_seconds_bucket{U}[5m])))", "p50 {{mode}}"),
    ]),
    ("Transfer mode in use", "short", [
        (f"max by (namespace, pod, pdunit_transfer_mode) (pdunit_transfer_mode{U}) == 1",
         "{{namespace}}/{{pod}} {{pdunit_transfer_mode}}"),
    ]),
    ("Held pages (D)", "short", [
        (f"sum by (namespace, pod) (pdunit_decode_pool_pages{HELD})", "{{namespace}}/{{pod}} held"),
        (f"sum by (namespace, pod) (pdunit_prefill_held_aborts{U})", "{{namespace}}/{{pod}} P held aborts"),
    ]),
    ("KV checks and mismatches", "short", [
        (f"sum(rate(pdunit_kv_checks_total{U}[5m]))", "checks/s"),
        (f"sum(increase(pdunit_kv_mismatch_total{U}[1h]))", "mismatches (1 h) — must be 0"),
    ]),
    ("Drain state", "short", [
        (f"max by (namespace, pod) (pdunit_lb_draining{U})", "{{namespace}}/{{pod}} unit draining"),
        (f"max by (namespace, pod) (pdunit_decode_draining{U})", "{{namespace}}/{{pod}} D draining (held pages)"),
        (f"sum(pdunit_operator_streams_cut_total{NS})", "streams cut by forced drains"),
    ]),
    ("Decode step", "s", [
        (f"histogram_quantile(0.50, sum by (le) (rate(pdunit_decode_step_seconds_bucket{U}[5m])))", "step p50"),
        (f"histogram_quantile(0.99, sum by (le) (rate(pdunit_decode_step_seconds_bucket{U}[5m])))", "step p99"),
    ]),
    ("Router", "short", [
        (f"sum by (outcome) (rate(pdunit_router_requests_total{NS}[5m]))", "{{outcome}}"),
        (f"sum(rate(pdunit_router_retries_total{NS}[5m]))", "retries"),
    ]),
    ("Waterfall p50 by stage", "s", [
        (f"histogram_quantile(0.50, sum by (le, stage) (rate(pdunit_lb_stage_seconds_bucket{U}[5m])))", "{{stage}}"),
    ]),
    # what stops every stream of a process at once: its GC pauses and kernel compiles
    # while serving (each should stay near 0)
    ("Engine stalls (seconds per second)", "s", [
        (f"sum by (namespace, pod, container) (rate(pdunit_gc_pause_seconds_sum{U}[5m]))",
         "{{namespace}}/{{pod}} {{container}} GC"),
        (f"sum by (namespace, pod, container) (rate(pdunit_kernel_compile_seconds_total{SERVING}[5m]))",
         "{{namespace}}/{{pod}} {{container}} kernel compiles"),
    ]),
    ("D: admission wait and batch", "short", [
        (f"histogram_quantile(0.99, sum by (le) (rate(pdunit_decode_admit_wait_seconds_bucket{U}[5m])))",
         "admission wait p99 (s; > one step: batch full)"),
        (f"histogram_quantile(0.99, sum by (le) (rate(pdunit_decode_step_batch_bucket{U}[5m])))", "streams per step p99"),
    ]),
]

# The dashboard's variables: the Prometheus data source, then the namespaces that have
# units, then the sets in them (both multi-valued; "All" matches every value, and the
# empty set label of standalone PDUnits too).
VARIABLES: list[dict[str, Any]] = [
    {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
    {"name": "namespace", "type": "query", "label": "Namespace",
     "datasource": {"type": "prometheus", "uid": "${datasource}"},
     "query": {"query": "label_values(pdunit_lb_ready, namespace)", "refId": "namespace"},
     "definition": "label_values(pdunit_lb_ready, namespace)",
     "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*", "sort": 1},
    {"name": "set", "type": "query", "label": "PDUnitSet",
     "datasource": {"type": "prometheus", "uid": "${datasource}"},
     "query": {"query": 'label_values(pdunit_lb_ready{namespace=~"$namespace"}, pdunit_dev_set)',
               "refId": "set"},
     "definition": 'label_values(pdunit_lb_ready{namespace=~"$namespace"}, pdunit_dev_set)',
     "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*", "sort": 1},
]


def dashboard() -> dict[str, Any]:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(targets)],
        })
    return {
        "title": "pdunit",
        "uid": "pdunit-overview",
        "schemaVersion": 39,
        "tags": ["pdunit", "tts"],
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": VARIABLES},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"

