"""Prometheus metrics of the engine processes (P, D, monolith), defined once, exported
per role.

Every engine module is importable in every engine process (P imports D's step loop, the
monolith D's batcher), so metrics are created unregistered and each process exports only
its own role's: `register_role("prefill" | "decode" | "monolith")`, called by each
process's main before it serves /metrics. A P therefore never shows D's series as zeros.

Names: `pdunit_` prefix, units in the name. The LB, router, proxy and operator define
their own next to their code; these are the ones the workers share.
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Enum, Gauge, Histogram

from pdunit.engine.transfer.base import TRANSFER_MODES

ROLES = ("prefill", "decode", "monolith")
_BY_ROLE: dict[str, list[Counter | Gauge | Histogram | Enum]] = {role: [] for role in ROLES}
# (role, registry) pairs registered so far: a module imported later (a transport chosen
# at run time) exports its metrics into them as it declares them.
_REGISTERED: list[tuple[str, CollectorRegistry]] = []
M = TypeVar("M", Counter, Gauge, Histogram, Enum)


def _register(registry: CollectorRegistry, metric: Counter | Gauge | Histogram | Enum) -> None:
    try:
        registry.register(metric)
    except ValueError:
        pass  # already there (a metric of two roles, or a second call)


def role_metric(metric: M, *roles: str) -> M:
    """`metric` (created with `registry=None`) exported by processes of `roles`."""
    for role in roles:
        _BY_ROLE[role].append(metric)
    for role, registry in _REGISTERED:
        if role in roles:
            _register(registry, metric)
    return metric


def register_role(role: str, registry: CollectorRegistry = REGISTRY) -> None:
    """Exports `role`'s metrics from `registry`, those of modules imported later too
    (idempotent)."""
    if role not in _BY_ROLE:
        raise ValueError(f"unknown role {role!r}: expected one of {ROLES}")
    if (role, registry) not in _REGISTERED:
        _REGISTERED.append((role, registry))
    for metric in _BY_ROLE[role]:
        _register(registry, metric)


_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_D, _P, _MONO = "decode", "prefill", "monolith"

# KV checks (PROTOCOL.md 3.3): every commit is checked; mismatches must stay 0.
KV_CHECKS = role_metric(Counter("pdunit_kv_checks_total", "KV transfers whose checksum D verified", registry=None),
                        _D)
KV_MISMATCH = role_metric(Counter("pdunit_kv_mismatch_total", "KV transfers whose checksum did not match",
                                  registry=None), _D)

# D (the monolith's decode steps use the first five)
D_STREAMS = role_metric(Gauge("pdunit_decode_streams", "Streams decoding in D (or the monolith)", registry=None),
                        _D, _MONO)
D_STEP_SECONDS = role_metric(Histogram("pdunit_decode_step_seconds", "Wall time of one decode step",
                                       buckets=_FAST, registry=None), _D, _MONO)
D_STEP_BATCH = role_metric(Histogram("pdunit_decode_step_batch", "Streams per decode step",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                                              768, 1024), registry=None), _D, _MONO)
D_ADMIT_WAIT_SECONDS = role_metric(Histogram(
    "pdunit_decode_admit_wait_seconds",
    "From a stream's admission to the batcher to the first step that takes it in: more than one step when the "
    "batch was full (--max-batch), or in the prefill-first monolith while the next prompts prefill",
    buckets=_FAST, registry=None), _D, _MONO)
# Rate-floor admission (engine/decode/admission.py)
D_HEADROOM = role_metric(Gauge(
    "pdunit_rate_floor_headroom_streams",
    "Streams like the recent ones the engine would still admit without breaking the rate floor (-1: admission off)",
    registry=None), _D, _MONO)
D_RATE_FLOOR_REFUSALS = role_metric(Counter(
    "pdunit_rate_floor_refusals_total", "Streams refused because admitting them would break the rate floor",
    registry=None), _D, _MONO)
D_RATE_FLOOR_IDLE_ADMITS = role_metric(Counter(
    "pdunit_rate_floor_idle_admissions_total", "Streams admitted against the projection because the engine held "
    "none (its step model or shrunk budget refused even one; the stream's steps refit it)",
    registry=None), _D, _MONO)
D_STEP_MODEL_MS = role_metric(Gauge(
    "pdunit_step_model_coefficient_ms", "The step-time model's coefficients (ms per unit of each term)",
    ["term"], registry=None), _D, _MONO)
D_STEP_MODEL_ERROR = role_metric(Gauge(
    "pdunit_step_model_under_prediction",
    "p90 of observed / predicted decode time over spans of --floor-error-span recent steps (> 1: the model "
    "under-predicts; the budget shrinks)",
    registry=None), _D, _MONO)
D_RATE_FLOOR_FEEDBACK = role_metric(Gauge(
    "pdunit_rate_floor_feedback_factor", "Share of the floor's step budget admission judges with after the feedback "
    "from the rates streams delivered (1: none taken; engine/decode/rate_feedback.py)", registry=None), _D, _MONO)
D_RATE_FLOOR_DELIVERED = role_metric(Gauge(
    "pdunit_rate_floor_delivered_quantile", "The --floor-feedback-quantile of recent streams' delivered rate over the "
    "floor, as last judged (0 until enough streams)", registry=None), _D, _MONO)
D_FRAMES = role_metric(Counter("pdunit_decode_frames_total", "Frames emitted", registry=None), _D, _MONO)
D_GPU_BUSY_SECONDS = role_metric(Counter(
    "pdunit_decode_gpu_busy_seconds_total",
    "Device time of decode steps, from CUDA events around each (D with overlap: first kernel to frames "
    "copied; the monolith: its whole step, prefill chunks included); rate() = GPU busy share, an upper bound",
    registry=None), _D, _MONO)
D_POOL_PAGES = role_metric(Gauge("pdunit_decode_pool_pages", "Pages in D's pool by state", ["state"], registry=None),
                           _D)
D_HELD_RELEASED = role_metric(Counter("pdunit_decode_held_released_total", "Held requests returned to free, by proof",
                                      ["proof"], registry=None), _D)
D_TRANSFER_FAILED = role_metric(Counter("pdunit_decode_transfer_failed_total", "Transfers D failed, by reason",
                                        ["reason"], registry=None), _D)
D_ABORTS_SENT = role_metric(Counter("pdunit_decode_aborts_sent_total", "ABORT messages sent to P (re-sends included)",
                                    registry=None), _D)
D_DRAINING = role_metric(Gauge("pdunit_decode_draining",
                               "1 while D refuses new transfers (held pages above the threshold)", registry=None), _D)
D_P_INSTANCE_CHANGES = role_metric(Counter("pdunit_decode_prefill_instance_changes_total",
                                           "New P instance ids seen by D", registry=None), _D)

# P (the monolith's prefills use the forward time and token counts)
P_QUEUE = role_metric(Gauge("pdunit_prefill_queue", "Prompts admitted by P, not yet prefilled", registry=None), _P)
P_STAGE_SECONDS = role_metric(Histogram(
    "pdunit_prefill_stage_seconds",
    "Wall time of one request in P's pipeline stages that run beside the forward (reserve, transfer); "
    "the forward itself is pdunit_prefill_forward_seconds",
    ["stage"], buckets=_FAST, registry=None), _P)
P_PREFILL_SECONDS = role_metric(Histogram("pdunit_prefill_forward_seconds", "Wall time of one prefill forward",
                                          buckets=_FAST, registry=None), _P, _MONO)
P_FORWARD_GAP_SECONDS = role_metric(Histogram(
    "pdunit_prefill_forward_gap_seconds",
    "From one forward's end to the next one's start, when the next batch was already reserved: P's own work "
    "between forwards (handing results on, building the batch), with the GPU idle and requests waiting",
    buckets=_FAST, registry=None), _P)
P_PREFILL_FORWARDS = role_metric(Counter(
    "pdunit_prefill_forwards_total",
    "Forwards with prompt rows, by how they ran: graph (a captured prefill CUDA graph replayed, "
    "--prefill-graphs) or eager", ["path"], registry=None), _P, _MONO)
MONO_MIXED_STEPS = role_metric(Counter(
    "pdunit_monolith_mixed_steps_total",
    "The monolith's mixed steps (decode rows and prompt rows in one forward), by how they ran: graph (a "
    "captured mixed-step CUDA graph replayed, --mixed-graphs) or eager (the flag off, or no bucket pair "
    "holds the step)", ["path"], registry=None), _MONO)
P_PREFILL_TOKENS = role_metric(Counter("pdunit_prefill_tokens_total", "Prompt rows, by how they were served",
                                       ["source"], registry=None), _P, _MONO)
# A state set per D link (exactly one state is 1): the mode P writes that D's KV with,
# whether --transfer named it or auto's verified probe chose it; "none" until it connects.
P_TRANSFER_MODE = role_metric(Enum(
    "pdunit_transfer_mode", "Transfer mode P writes KV to each D with (--transfer's, or auto's verified probe's)",
    ["decode"], states=["none", *TRANSFER_MODES], registry=None), _P)
P_TRANSFER_SECONDS = role_metric(Histogram("pdunit_transfer_seconds", "Write time of one request's KV", ["mode"],
                                           buckets=_FAST, registry=None), _P)
P_TRANSFER_BYTES = role_metric(Counter("pdunit_transfer_bytes_total", "KV bytes written to D", ["mode"],
                                       registry=None), _P)
P_REQUESTS = role_metric(Counter("pdunit_prefill_requests_total", "Prefill requests by outcome", ["outcome"],
                                 registry=None), _P)
P_HELD_ABORTS = role_metric(Gauge("pdunit_prefill_held_aborts", "Aborts P holds without ACK (P exits at the limit)",
                                  registry=None), _P)
P_ABORTS = role_metric(Counter("pdunit_prefill_aborts_total", "ABORTs received, by answer", ["answer"],
                               registry=None), _P)
