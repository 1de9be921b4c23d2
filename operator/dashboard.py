"""The Grafana dashboard shipped in the chart (charts/pdunit/dashboards/pdunit.json),
generated here so that every panel's query names a metric the code really exports
(tests/charts/test_dashboard.py checks both: the file is current, the names exist).

`make chart-files` rewrites it (operator/chart_files.py).
"""

from __future__ import annotations

import json
from typing import Any

# (title, unit, [(PromQL, legend)]) per panel, in reading order.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Streams in flight", "short", [
        ("sum by (pod) (pdunit_lb_streams_in_flight)", "{{pod}} LB"),
        ("sum by (pod) (pdunit_decode_streams)", "{{pod}} D"),
    ]),
    ("Per-stream rate floor (p1, frames/s)", "short", [
        ("histogram_quantile(0.01, sum by (le) (rate(pdunit_lb_stream_rate_frames_per_second_bucket[5m])))", "p1 rate"),
        ("histogram_quantile(0.01, sum by (le) (rate(pdunit_lb_stream_worst_window_frames_bucket[5m])))", "p1 worst 1 s window"),
    ]),
    ("Stutter share", "percentunit", [
        ("sum(rate(pdunit_lb_stutter_streams_total[5m])) / clamp_min(sum(rate(pdunit_lb_stream_rate_frames_per_second_count[5m])), 1e-9)", "streams that stalled"),
    ]),
    ("TTFA / TTFT", "s", [
        ("histogram_quantile(0.95, sum by (le) (rate(pdunit_lb_ttfa_seconds_bucket[5m])))", "TTFA p95"),
        ("histogram_quantile(0.50, sum by (le) (rate(pdunit_lb_ttfa_seconds_bucket[5m])))", "TTFA p50"),
        ("histogram_quantile(0.95, sum by (le) (rate(pdunit_lb_ttft_seconds_bucket[5m])))", "TTFT p95"),
    ]),
    ("KV transfer time", "s", [
        ("histogram_quantile(0.99, sum by (le, mode) (rate(pdunit_transfer_seconds_bucket[5m])))", "p99 {{mode}}"),
        ("histogram_quantile(0.50, sum by (le, mode) (rate(pdunit_transfer_seconds_bucket[5m])))", "p50 {{mode}}"),
    ]),
    ("Transfer mode in use", "short", [
        ("sum by (pod, mode) (pdunit_transfer_mode_info)", "{{pod}} {{mode}}"),
    ]),
    ("Held pages (D)", "short", [
        ("sum by (pod) (pdunit_decode_pool_pages{state=\"held\"})", "{{pod}} held"),
        ("sum by (pod) (pdunit_prefill_held_aborts)", "{{pod}} P held aborts"),
    ]),
    ("KV checks and mismatches", "short", [
        ("sum(rate(pdunit_kv_checks_total[5m]))", "checks/s"),
        ("sum(increase(pdunit_kv_mismatch_total[1h]))", "mismatches (1 h) — must be 0"),
    ]),
    ("Drain state", "short", [
        ("max by (pod) (pdunit_lb_draining)", "{{pod}} unit draining"),
        ("max by (pod) (pdunit_decode_draining)", "{{pod}} D draining (held pages)"),
        ("sum(pdunit_operator_streams_cut_total)", "streams cut by forced drains"),
    ]),
    ("Decode step", "s", [
        ("histogram_quantile(0.50, sum by (le) (rate(pdunit_decode_step_seconds_bucket[5m])))", "step p50"),
        ("histogram_quantile(0.99, sum by (le) (rate(pdunit_decode_step_seconds_bucket[5m])))", "step p99"),
    ]),
    ("Router", "short", [
        ("sum by (outcome) (rate(pdunit_router_requests_total[5m]))", "{{outcome}}"),
        ("sum(rate(pdunit_router_retries_total[5m]))", "retries"),
    ]),
    ("Waterfall p50 by stage", "s", [
        ("histogram_quantile(0.50, sum by (le, stage) (rate(pdunit_lb_stage_seconds_bucket[5m])))", "{{stage}}"),
    ]),
    # what stops every stream of a process at once: its GC pauses and kernel compiles
    # while serving (each should stay near 0)
    ("Engine stalls (seconds per second)", "s", [
        ("sum by (pod, container) (rate(pdunit_gc_pause_seconds_sum[5m]))", "{{pod}} {{container}} GC"),
        ("sum by (pod, container) (rate(pdunit_kernel_compile_seconds_total{phase=\"serving\"}[5m]))",
         "{{pod}} {{container}} kernel compiles"),
    ]),
    ("D: admission wait and batch", "short", [
        ("histogram_quantile(0.99, sum by (le) (rate(pdunit_decode_admit_wait_seconds_bucket[5m])))",
         "admission wait p99 (s; > one step: batch full)"),
        ("histogram_quantile(0.99, sum by (le) (rate(pdunit_decode_step_batch_bucket[5m])))", "streams per step p99"),
    ]),
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
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"

