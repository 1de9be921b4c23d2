"""Prometheus metrics of the engine processes (P, D, monolith), defined once.

Names: `pdunit_` prefix, units in the name. The LB, router, proxy and operator define
their own next to their code; these are the ones the workers share.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

# KV checks (PROTOCOL.md 3.3): every commit is checked; mismatches must stay 0.
KV_CHECKS = Counter("pdunit_kv_checks_total", "KV transfers whose checksum D verified")
KV_MISMATCH = Counter("pdunit_kv_mismatch_total", "KV transfers whose checksum did not match")

# D
D_STREAMS = Gauge("pdunit_decode_streams", "Streams decoding in D (or the monolith)")
D_STEP_SECONDS = Histogram("pdunit_decode_step_seconds", "Wall time of one decode step", buckets=_FAST)
D_STEP_BATCH = Histogram("pdunit_decode_step_batch", "Streams per decode step", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
D_FRAMES = Counter("pdunit_decode_frames_total", "Frames emitted")
D_GPU_BUSY_SECONDS = Counter(
    "pdunit_decode_gpu_busy_seconds_total",
    "Device time of decode steps, from CUDA events around each (D with overlap: first kernel to frames "
    "copied; the monolith: its whole step, prefill chunks included); rate() = GPU busy share, an upper bound")
D_POOL_PAGES = Gauge("pdunit_decode_pool_pages", "Pages in D's pool by state", ["state"])
D_HELD_RELEASED = Counter("pdunit_decode_held_released_total", "Held requests returned to free, by proof", ["proof"])
D_TRANSFER_FAILED = Counter("pdunit_decode_transfer_failed_total", "Transfers D failed, by reason", ["reason"])
D_ABORTS_SENT = Counter("pdunit_decode_aborts_sent_total", "ABORT messages sent to P (re-sends included)")
D_DRAINING = Gauge("pdunit_decode_draining", "1 while D refuses new transfers (held pages above the threshold)")
D_P_INSTANCE_CHANGES = Counter("pdunit_decode_prefill_instance_changes_total", "New P instance ids seen by D")

# P
P_QUEUE = Gauge("pdunit_prefill_queue", "Prompts admitted by P, not yet prefilled")
P_STAGE_SECONDS = Histogram(
    "pdunit_prefill_stage_seconds",
    "Wall time in each stage of P's pipeline, each in threads of its own: reserve and transfer per "
    "request, forward per batch",
    ["stage"], buckets=_FAST)
P_PREFILL_SECONDS = Histogram("pdunit_prefill_forward_seconds", "Wall time of one prefill forward", buckets=_FAST)
P_PREFILL_TOKENS = Counter("pdunit_prefill_tokens_total", "Prompt rows, by how they were served", ["source"])
P_TRANSFER_SECONDS = Histogram("pdunit_transfer_seconds", "Write time of one request's KV", ["mode"], buckets=_FAST)
P_TRANSFER_BYTES = Counter("pdunit_transfer_bytes_total", "KV bytes written to D", ["mode"])
P_REQUESTS = Counter("pdunit_prefill_requests_total", "Prefill requests by outcome", ["outcome"])
P_HELD_ABORTS = Gauge("pdunit_prefill_held_aborts", "Aborts P holds without ACK (P exits at the limit)")
P_ABORTS = Counter("pdunit_prefill_aborts_total", "ABORTs received, by answer", ["answer"])
