"""Prometheus metrics of the LB (`pdunit_lb_*`), in one registry per LB instance.

Owns the metric names and their labels. The process uses prometheus_client's default
registry (observability.py); tests pass a fresh `CollectorRegistry` so that several LBs
can live in one test process. Never computes anything itself: callers observe.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Stage gaps run from tens of microseconds (validate) to seconds (a whole stream).
STAGE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
VALIDATE_BUCKETS = (0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)
# Per-stream rates: real time and its rate floor (2x) of each family's frame rate (CSM's
# Mimi 12.5 Hz, the pdunit family's 21 Hz) are bucket edges: a quantile compared with the
# floor is not interpolated across it.
RATE_BUCKETS = (10, 12.5, 21, 25, 30, 42, 50, 60, 80, 100, 150, 200, 400)
_STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
MAX_STAGE_LABELS = 64  # stage names come from P and D: bound the label set anyway


class LBMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pdunit_lb_requests_total",
            "Stream requests by final HTTP status code and outcome",
            ["code", "outcome"],
            registry=registry,
        )
        self.loop_lag_seconds = Histogram(
            "pdunit_lb_loop_lag_seconds",
            "How late the LB's event loop woke from a 10 ms sleep: the delay every request "
            "and frame relayed by the LB pays on top of its own work (saturation)",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.streams_in_flight = Gauge(
            "pdunit_lb_streams_in_flight",
            "Streams registered in the LB (submitted, not ended)",
            registry=registry,
        )
        self.validate_seconds = Histogram(
            "pdunit_lb_validate_seconds",
            "Validate + pack of one request body",
            ["format"],
            buckets=VALIDATE_BUCKETS,
            registry=registry,
        )
        self.stage_seconds = Histogram(
            "pdunit_lb_stage_seconds",
            "Waterfall: time from the previous stage stamp to this one, per completed stream",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=registry,
        )
        self.refusal_seconds = Histogram(
            "pdunit_lb_refusal_seconds",
            "LB receive -> a rate-floor refusal answered (503 rate_floor + Retry-After); each "
            "one's stage gaps are in its 'stream failed' log line (stages_ms)",
            buckets=STAGE_BUCKETS,
            registry=registry,
        )
        self.ttft_seconds = Histogram(
            "pdunit_lb_ttft_seconds",
            "LB receive -> first frame written to the client",
            buckets=STAGE_BUCKETS,
            registry=registry,
        )
        # What the listener hears, per completed stream (the playback model of
        # BENCHMARKS.md section 1, on the LB's frame-out times).
        self.ttfa_seconds = Histogram(
            "pdunit_lb_ttfa_seconds",
            "LB receive -> the first start_frames frames written (first playable audio)",
            buckets=STAGE_BUCKETS,
            registry=registry,
        )
        self.stream_rate = Histogram(
            "pdunit_lb_stream_rate_frames_per_second",
            "Per-stream frame rate from first to last frame",
            buckets=RATE_BUCKETS,
            registry=registry,
        )
        self.stream_worst_window = Histogram(
            "pdunit_lb_stream_worst_window_frames",
            "Per-stream fewest frames written in any 1-second window",
            buckets=(5, *RATE_BUCKETS[:-1]),
            registry=registry,
        )
        self.frame_rate_hz = Gauge(
            "pdunit_lb_frame_rate_hz",
            "Frames a second of real-time audio of the unit's model (D's Hello: the codec's frame rate, "
            "else the model config's, else 21); streams are played at it, their rate floor is 2x it "
            "(0 until D answered)",
            registry=registry,
        )
        self.stutters = Counter(
            "pdunit_lb_stutter_streams_total",
            "Completed streams whose playback stalled at least once",
            registry=registry,
        )
        self.frames = Counter(
            "pdunit_lb_frames_total",
            "Frames written to clients",
            registry=registry,
        )
        self.unknown_frames = Counter(
            "pdunit_lb_unknown_frames_total",
            "Frames from D for request ids the LB no longer holds (cancelled, ended)",
            registry=registry,
        )
        self.cancels = Counter(
            "pdunit_lb_cancels_total",
            "Cancel RPCs sent, by target and result",
            ["target", "result"],
            registry=registry,
        )
        self.subscription_up = Gauge(
            "pdunit_lb_frames_subscription_up",
            "1 while the Decode.Frames subscription is live",
            registry=registry,
        )
        self.subscription_breaks = Counter(
            "pdunit_lb_frames_subscription_breaks_total",
            "Decode.Frames subscriptions that ended or failed",
            registry=registry,
        )
        self.ready = Gauge("pdunit_lb_ready", "1 when /readyz answers 200", registry=registry)
        self.draining = Gauge("pdunit_lb_draining", "1 while the unit drains", registry=registry)
        self.probe_failures = Counter(
            "pdunit_lb_probe_failures_total",
            "Info probes that failed, by target",
            ["target"],
            registry=registry,
        )
        self.probe_late = Counter(
            "pdunit_lb_probe_late_total",
            "Info probes past their timeout whose target's previous reply, still fresh, "
            "stood in (a subset of probe_failures)",
            ["target"],
            registry=registry,
        )
        self._stages: set[str] = set()

    def observe_stages(self, stamps: dict[str, int]) -> None:
        """One observation per stage: the gap to the stage stamped just before it."""
        ordered = sorted(stamps.items(), key=lambda kv: kv[1])
        for (_, before), (name, at) in zip(ordered, ordered[1:], strict=False):
            if not _STAGE_NAME.match(name):
                continue
            if name not in self._stages:
                if len(self._stages) >= MAX_STAGE_LABELS:
                    continue
                self._stages.add(name)
            self.stage_seconds.labels(stage=name).observe(max(0, at - before) / 1e9)
