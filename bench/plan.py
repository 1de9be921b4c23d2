"""`pdunit bench plan`: the capacity a workload would reach on each variant, predicted from
two GPU measurements, so a unit can be sized (D's per P) and a variant judged unrun.

Owns the cost fits (decode step from a `bench step` JSON; prefill forward, graph and eager,
from a `bench prefill` JSON) and a discrete-event model of each variant's scheduler over
`bench capacity`'s seeded workload, its streams judged by the same rules (driver.
summarize_level, capacity.summarize_run). The model's rules and knobs: docs/performance.md
("Predicting", "What each benchmark measures"). It predicts and measures nothing:
`--measured` sets a `bench compare` run beside it; `--kv-scale`/`--prefill-scale` are
what-ifs, never results.
"""

from __future__ import annotations

import heapq
import json
import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field, field_validator

from pdunit.bench import report
from pdunit.bench.capacity import CapacityConfig, summarize_run
from pdunit.bench.compare import ratios, variant_level_overrides
from pdunit.engine.decode.admission import AdmissionControl, RateFloorAdmission
from pdunit.engine.decode.step_model import StepCoefficients, StepModel, nonneg_fit
from pdunit.engine.decode.stream_lives import HeldStream, PendingPrefills
from pdunit.engine.lb.config import LBConfig
from pdunit.engine.loadgen.driver import (
    REFUSAL_CODE,
    StreamResult,
    poisson_schedule,
    summarize_level,
)
from pdunit.engine.loadgen.summary import Column, machine_info, percentiles, text_table
from pdunit.engine.loadgen.workload import (
    StreamSpec,
    Workload,
    WorkloadConfig,
    parse_list,
    parse_range,
)
from pdunit.engine.model.config import get_config
from pdunit.engine.model.prefill_graphs import DEFAULT_ROW_BUCKETS
from pdunit.engine.playback import stream_timing
from pdunit.engine.prefill.main import PrefillConfig
from pdunit.engine.prefill.pipeline import _ROOM_POLL_S
from pdunit.engine.prefill.scheduler import joins_batch
from pdunit.engine.settings import parse_config

BENCH = "plan"
RETRY_AFTER_S = LBConfig.model_fields["retry_after_s"].default  # the LB's Retry-After on a refusal


# The engines' own defaults, so the model runs what `pdunit prefill` and the monolith run.
_ENGINE = {k: f.default for k, f in PrefillConfig.model_fields.items()}


class PlanConfig(BaseModel):
    """pdunit bench plan: predicted capacity per variant from measured step and prefill costs."""

    step: str = Field(..., description="a `bench step` results JSON (decode step vs batch and context)")
    prefill: str = Field(..., description="a `bench prefill` results JSON (forward time vs prompts and rows)")
    gemm: str = Field("fp8", description="which of the prefill JSON's GEMM precisions P and the monolith run")
    graphs: bool = Field(True, description="P and the monolith replay prefill graphs (the prefill JSON's "
                         "graphs rows; eager rows when off)")
    model: str = Field("qwen3-4b-shape", description="model config (its codebooks shape the workload's draws)")
    variants: str = Field("1p1d,1p2d,monolith-prefill-first,monolith-chunked",
                          description="1pNd (N D's fed by one P, N+1 GPUs), monolith-prefill-first, "
                          "monolith-chunked (one per --chunks size)")
    chunks: str = Field("8192", description="monolith-chunked: rows per iteration, comma list")
    rate: str = Field("8,16,24,32", description="Poisson levels (arrivals/s) of every variant")
    variant_rate: str = Field("", description="per-variant levels, 'VARIANT=LIST;...' as bench compare's")
    repeat: int = Field(2, ge=1, description="runs of every level, seed + run; a level passes when all do")
    stop_at_failure: bool = Field(True, description="end a variant's sweep at its first failing level")
    duration: float = Field(12.0, gt=0, description="seconds of arrivals per level")
    ramp: float = Field(3.0, ge=0, description="streams arriving in the first seconds are not counted")
    burst_share: float = Field(0.2, ge=0, lt=1, description="share of requests arriving in clumps")
    burst_size: int = Field(10, ge=1, description="requests per clump")
    prompt_rows: str = Field("1000-2000", description="prompt rows, LOW-HIGH")
    frames: str = Field("105-630", description="frames per stream, LOW-HIGH")
    voices: int = Field(8, ge=0, description="warm voices")
    voice_reuse: float = Field(0.5, ge=0, le=1, description="share of requests using a warm voice")
    seed: int = Field(0, description="workload seed of run 0")
    block_tokens: int = Field(_ENGINE["prefix_block_tokens"], gt=0, description="prefix-cache block (rows)")
    monolith_cache: bool = Field(True, description="the monoliths keep a prefix cache, as P does (their "
                                 "--cache-tokens > 0; runs before 2026-11-30's 4ac169e had none)")
    max_batch_rows: int = Field(_ENGINE["max_batch_rows"], gt=0,
                                description="P's and the prefill-first monolith's rows per forward")
    max_batch_prompts: int = Field(_ENGINE["max_batch_prompts"], gt=0, description="P's prompts per forward")
    reserve_concurrency: int = Field(_ENGINE["reserve_concurrency"], gt=0,
                                     description="P's RESERVEs sent at once (its --reserve-concurrency; 1: one "
                                     "at a time, P before issue 31)")
    pool_tokens: int = Field(400000, gt=0, description="each D's KV pool, and the monolith's, in tokens (the "
                             "device harness's --pool-tokens): a request holds prompt rows + frames")
    admit_ms: float = Field(5.0, ge=0, description="client send -> engine admission (the waterfalls' p50 sum)")
    reserve_ms: float = Field(6.5, ge=0, description="P's reserve stage per request (compare's P reserve ms)")
    handoff_ms: float = Field(10.0, ge=0, description="P forward end -> D commit (write, checksum, COMMIT)")
    deliver_ms: float = Field(2.0, ge=0, description="a frame from the engine to the client")
    rate_floor: float = Field(0.0, ge=0, description="the prefill-first monolith's rate-floor admission, frames/s "
                              "per stream (the engine's --rate-floor; 42 for the pdunit family on a GPU): each "
                              "arriving prompt gets the engine's verdict on the model's state, a refused one is "
                              "a 503 rate_floor as the LB answers it; 0 = off (every prompt admitted)")
    floor_margin: float = Field(0.10, ge=0, lt=1, description="the engine's --floor-margin under --rate-floor")
    overload_rate: float = Field(0.0, ge=0, description="a level at this rate (arrivals/s) after each variant's "
                                 "sweep, whatever the sweep's verdicts: its refused share, goodput and slowest "
                                 "admitted stream; its rows are marked `overload` and are no level of the "
                                 "capacity summary; 0 = none")
    kv_scale: float = Field(1.0, gt=0, description="what-if: multiplies the step's per-context-token cost")
    prefill_scale: float = Field(1.0, gt=0, description="what-if: multiplies every prefill forward's cost")
    measured: str = Field("", description="a `bench compare` JSON of the same workload: its levels beside ours")
    measured_labels: str = Field("", description="--measured's labelled copies to read as their variants, "
                                 "comma-separated (`fp8`: its `1p1d+fp8` rows beside our `1p1d`); by default its "
                                 "variants as they are")
    out: str = Field("", description="results JSON path or folder ('' = print only)")

    @field_validator("gemm")
    @classmethod
    def _gemm(cls, v: str) -> str:
        if v not in ("bf16", "fp8"):
            raise ValueError(f"gemm {v!r}: expected bf16 or fp8")
        return v


# ---------------------------------------------------------------------------- costs
@dataclass(frozen=True)
class StepCost:
    """Decode step ms = base + per_stream * streams + per_token * their context tokens."""

    base_ms: float
    per_stream_ms: float
    per_token_ms: float
    worst_error: float = 0.0  # of the fit on its own points
    points: int = 0

    def ms(self, streams: int, context_tokens: int) -> float:
        return self.base_ms + self.per_stream_ms * streams + self.per_token_ms * context_tokens

    def scaled(self, kv: float) -> StepCost:
        return StepCost(self.base_ms, self.per_stream_ms, self.per_token_ms * kv, self.worst_error, self.points)

    @classmethod
    def fit(cls, rows: Sequence[dict[str, Any]], overlap: bool) -> StepCost:
        pts = [r for r in rows if bool(r.get("overlap")) == overlap and r.get("step_ms")]
        if len(pts) < 3:
            raise ValueError(f"the step JSON has {len(pts)} points with overlap={overlap}: need 3 or more")
        x = np.array([[1.0, r["batch"], r["batch"] * r.get("mean_context", r["context"])] for r in pts])
        (base, stream, token), worst = nonneg_fit(x, np.array([r["step_ms"] for r in pts]))
        return cls(base, stream, token, worst_error=worst, points=len(pts))


@dataclass(frozen=True)
class PrefillCost:
    """Forward ms = max(floor, base + per_row * rows + per_pair * attention pairs), where
    `rows` are the computed rows, or with `buckets` (a replayed prefill graph) the
    smallest bucket that holds them (a graph computes its whole bucket); `floor` is an
    eager forward's host time: it launches every kernel from Python while the GPU runs
    them, so a small eager forward takes the launches' time, not the GPU's."""

    base_ms: float
    per_row_ms: float
    per_pair_ms: float
    worst_error: float = 0.0
    points: int = 0
    buckets: tuple[int, ...] = ()
    floor_ms: float = 0.0

    def gemm_rows(self, rows: int) -> int:
        return next((b for b in self.buckets if b >= rows), rows)

    def ms(self, seqs: Sequence[tuple[int, int]]) -> float:
        """`seqs`: (computed rows, cached rows) per prompt of the forward."""
        rows = self.gemm_rows(sum(n for n, _ in seqs))
        pairs = sum(n * c + n * (n + 1) / 2 for n, c in seqs)
        return max(self.floor_ms, self.base_ms + self.per_row_ms * rows + self.per_pair_ms * pairs)

    def scaled(self, factor: float) -> PrefillCost:
        return PrefillCost(self.base_ms * factor, self.per_row_ms * factor, self.per_pair_ms * factor,
                           self.worst_error, self.points, self.buckets, self.floor_ms * factor)

    @classmethod
    def fit(cls, rows: Sequence[dict[str, Any]], gemm: str, graphs: bool, buckets: tuple[int, ...] = ()) -> PrefillCost:
        """From `bench prefill` rows of one GEMM precision: the eager forwards
        (`graphs` False), or those replayed from a graph (`graphs` True: the rows
        measured with --graphs that did replay, priced at their bucket)."""
        pts = [r for r in rows if r.get("gemm") == gemm and bool(r.get("graphs")) == graphs and r.get("ms")
               and (not graphs or r.get("replayed"))]
        if len(pts) < 3:
            what = "replayed from a graph" if graphs else "eager"
            raise ValueError(f"the prefill JSON has {len(pts)} points for gemm={gemm}, {what}: need 3 or more "
                             "(bench prefill --gemm ... --graphs measures both)")
        floor = 0.0
        if not graphs:  # the cheapest eager forward is its launches' time; the line fits the rest
            floor = min(r["ms"] for r in pts)
            above = [r for r in pts if r["ms"] > 1.1 * floor]
            pts = above if len(above) >= 3 else pts
        bucket = cls(0, 0, 0, buckets=buckets).gemm_rows
        x = np.array([[1.0, bucket(r["prompts"] * r["rows"]), r["prompts"] * r["rows"] * (r["rows"] + 1) / 2]
                      for r in pts])
        (base, row, pair), worst = nonneg_fit(x, np.array([r["ms"] for r in pts]))
        return cls(base, row, pair, worst_error=worst, points=len(pts), buckets=buckets, floor_ms=floor)


@dataclass(frozen=True)
class Costs:
    step: StepCost | None          # D (overlap); None when no 1pNd variant is planned
    mono_step: StepCost | None     # the monolith's decode steps (no overlap); None without a monolith
    eager: PrefillCost             # forwards that replay no graph; the chunked monolith's mixed ones
    graph: PrefillCost | None      # forwards that fit a prefill graph (None: graphs off)
    graph_prompts: int             # prompts a graph holds
    admit_s: float
    reserve_s: float
    handoff_s: float
    deliver_s: float

    def forward_ms(self, seqs: Sequence[tuple[int, int]]) -> float:
        """A prefill forward as P and the prefill-first monolith run it: replayed from a
        graph when it fits the largest bucket and the graphs' prompt count, else eager."""
        g = self.graph
        if g is not None and len(seqs) <= self.graph_prompts and sum(n for n, _ in seqs) <= g.buckets[-1]:
            return g.ms(seqs)
        return self.eager.ms(seqs)


def load_costs(cfg: PlanConfig) -> tuple[Costs, dict[str, Any]]:
    step_doc = json.loads(Path(cfg.step).read_text())
    prefill_doc = json.loads(Path(cfg.prefill).read_text())
    # each decode cost only where a planned variant runs it: `bench step --overlap on`
    # (what --tune emits) has no plain steps, and a plan of PD alone needs none
    kinds = {v.decoders > 0 for v in variants_of(cfg)}
    d = StepCost.fit(step_doc["rows"], overlap=True).scaled(cfg.kv_scale) if True in kinds else None
    mono = StepCost.fit(step_doc["rows"], overlap=False).scaled(cfg.kv_scale) if False in kinds else None
    eager = PrefillCost.fit(prefill_doc["rows"], cfg.gemm, False).scaled(cfg.prefill_scale)
    graph = (PrefillCost.fit(prefill_doc["rows"], cfg.gemm, True, DEFAULT_ROW_BUCKETS).scaled(cfg.prefill_scale)
             if cfg.graphs else None)
    # P captures its graphs for --max-batch-prompts prompts; the monolith for the same 16
    costs = Costs(d, mono, eager, graph, cfg.max_batch_prompts, cfg.admit_ms / 1e3, cfg.reserve_ms / 1e3,
                  cfg.handoff_ms / 1e3, cfg.deliver_ms / 1e3)
    sources = {name: {"path": path, "command": doc.get("command"), "machine": report.machine_slug(doc["machine"])}
               for name, path, doc in (("step", cfg.step, step_doc), ("prefill", cfg.prefill, prefill_doc))}
    return costs, sources


def describe_costs(costs: Costs) -> dict[str, Any]:
    def rounded(obj: Any) -> dict[str, Any]:
        return {k: round(v, 7) if isinstance(v, float) else v for k, v in obj.__dict__.items()}

    return {"decode_step_overlap": rounded(costs.step) if costs.step else None,
            "decode_step_monolith": rounded(costs.mono_step) if costs.mono_step else None,
            "prefill_eager": rounded(costs.eager), "prefill_graph": rounded(costs.graph) if costs.graph else None}


# ---------------------------------------------------------------------------- requests
@dataclass
class Request:
    index: int
    arrival: float            # s since the level started
    spec: StreamSpec
    reference_rows: int       # a warm voice's leading rows (the cacheable part)
    times: list[float] = field(default_factory=list)  # frame arrival times at the client
    stamps: dict[str, float] = field(default_factory=dict)  # the engines' stage stamps (s), as they name them
    refused: bool = False     # its pool could not hold it (the engines' no_capacity)
    floor_refused: bool = False  # refused by rate-floor admission (503 rate_floor), answered at stamps["refused"]
    answered: float | None = None  # a refusal's answer at the client, where the model times it

    @property
    def rows(self) -> int:
        return self.spec.rows


class PrefixCacheModel:
    """Which warm voices an engine's prefix cache holds, and since when (published at the
    end of the forward that computed them). Capacity is not modelled: the bench's
    cache holds every warm voice. `enabled` False: an engine without one."""

    def __init__(self, block_tokens: int, enabled: bool = True) -> None:
        self.block = block_tokens
        self.enabled = enabled
        self.published: dict[str, float] = {}

    def cached(self, r: Request, at: float) -> int:
        if not self.enabled or not r.spec.reused or self.published.get(r.spec.voice, float("inf")) > at:
            return 0
        return min((r.reference_rows // self.block) * self.block, r.rows - 1)

    def publish(self, r: Request, at: float) -> None:
        if r.spec.reused:
            self.published[r.spec.voice] = min(at, self.published.get(r.spec.voice, float("inf")))


def _take_rows(queue: deque[Request], max_rows: int) -> list[Request]:
    """The prefill-first monolith's next forward: its waiting prompts, FIFO, up to
    `max_rows` (the first one always)."""
    batch = [queue.popleft()]
    rows = batch[0].rows
    while queue and rows + queue[0].rows <= max_rows:
        rows += queue[0].rows
        batch.append(queue.popleft())
    return batch


def _stream_frames(r: Request, frame_end: float, costs: Costs) -> None:
    r.times.append(frame_end + costs.deliver_s)


def refuse_beyond_pool(requests: Sequence[Request], pool_tokens: int, held_from: str, costs: Costs) -> None:
    """Marks `refused` the requests one pool could not hold: each holds rows + frames
    tokens from its `held_from` stamp to its last frame, in the order they ask."""
    held: list[tuple[float, int]] = []  # (release time, tokens), a heap
    used = 0
    for r in sorted((x for x in requests if not x.floor_refused), key=lambda x: x.stamps[held_from]):
        at = r.stamps[held_from]
        while held and held[0][0] <= at:
            used -= heapq.heappop(held)[1]
        need = r.rows + r.spec.frames
        if used + need > pool_tokens:
            r.refused = True
            continue
        used += need
        heapq.heappush(held, (max(r.times) - costs.deliver_s, need))


# ---------------------------------------------------------------------------- 1PnD
class DecodeLane:
    """One D: its pool (`pool_tokens`; a request holds its prompt rows + frames from its
    RESERVE to its last frame) and its loop over committed requests, P's first frame at
    commit, run only as far as `run_until` asks: a RESERVE at t sees the streams that
    ended by t, and commits after t are not known yet."""

    def __init__(self, index: int, step: StepCost, costs: Costs, overlap: bool, pool_tokens: int = 0) -> None:
        self.index, self.step, self.costs, self.overlap = index, step, costs, overlap
        self.pool_tokens = pool_tokens
        self.pending: deque[tuple[float, Request]] = deque()  # (commit time, request), not in a step yet
        self.active: list[list[Any]] = []  # [request, frames done, context tokens]
        self.t = 0.0  # the end of the last step run
        self.prepared_at = 0.0  # when the next step's batch is fixed (overlap: the last step's start)
        self.held: dict[int, int] = {}  # request index -> tokens, reserved here until its last frame
        self.reserved_total = 0

    def order_key(self) -> tuple[int, int, int, int]:
        """P's ranking of its D's (links.DecodeLink.order_key), best first: most free
        tokens, fewest streams, fewest grants so far."""
        return (sum(self.held.values()), len(self.held), self.reserved_total, self.index)

    def reserve(self, r: Request) -> bool:
        """D's RESERVE: granted when the pool holds the request now (else no_capacity)."""
        need = r.rows + r.spec.frames
        if sum(self.held.values()) + need > self.pool_tokens:
            return False
        self.held[r.index] = need
        self.reserved_total += 1
        return True

    def commit(self, at: float, r: Request) -> None:
        """P's COMMIT at `at`, never before one already given (P's forwards end in order)."""
        self.pending.append((at, r))

    def run_until(self, until: float) -> None:
        """Every step that ends by `until`."""
        while self.pending or self.active:
            if not self.active:  # idle: the next step starts with the next commit
                if self.pending[0][0] > until:
                    return
                self.t = self.prepared_at = max(self.t, self.pending[0][0])
            while self.pending and self.pending[0][0] <= (self.prepared_at if self.overlap else self.t):
                at, r = self.pending.popleft()
                _stream_frames(r, at, self.costs)  # P's frame
                if r.spec.frames > 1:
                    self.active.append([r, 1, r.rows + 1])
                else:
                    self.held.pop(r.index, None)
            if not self.active:
                continue
            end = self.t + self.step.ms(len(self.active), sum(a[2] for a in self.active)) / 1e3
            if end > until:
                return
            self.prepared_at, self.t = self.t, end
            for a in self.active:
                _stream_frames(a[0], end, self.costs)
                a[1] += 1
                a[2] += 1
                if a[1] == a[0].spec.frames:
                    self.held.pop(a[0].index, None)
            self.active = [a for a in self.active if a[1] < a[0].spec.frames]


class PrefillModel:
    """P as engine/prefill/pipeline.py runs it, in the model's time.

    The reserve stage takes the next request once it is in P's queue, with those queued
    behind it by then (`reserve_concurrency` in all), and RESERVEs them at once
    (`reserve_s`): D's verdict comes before any wait for room, so a refusal is answered
    then. The granted go into the batch the next forward takes while they fit
    (`max_batch_rows`, `max_batch_prompts`); the rest wait for room reserved, and while
    fewer than `reserve_concurrency` wait, newcomers are reserved too (the queue looked
    at every `_ROOM_POLL_S`). The forward stage takes the whole batch when the forward
    in flight ends, or, idle, as soon as a request goes in."""

    def __init__(self, requests: list[Request], costs: Costs, cfg: PlanConfig, lanes: list[DecodeLane]) -> None:
        self.costs, self.cfg, self.lanes = costs, cfg, lanes
        self.queue = deque(sorted(requests, key=lambda r: r.arrival))  # P's queue, each from its p_admitted
        for r in self.queue:
            r.stamps["p_admitted"] = r.arrival + costs.admit_s
        self.cache = PrefixCacheModel(cfg.block_tokens)
        self.open: list[Request] = []  # reserved, for the next forward
        self.busy_until: float | None = None  # the forward in flight's end; None: P idle
        self.route: dict[int, DecodeLane] = {}

    def run(self) -> None:
        t = 0.0
        while self.queue:
            t = self.reserve_once(max(t, self.queue[0].stamps["p_admitted"]))
        self.forwards_until(float("inf"))
        for lane in self.lanes:
            lane.run_until(float("inf"))

    # the reserve stage (pipeline._reserve_once); `t` is its clock
    def reserve_once(self, t: float) -> float:
        k = self.cfg.reserve_concurrency
        waiting, t = self.reserve_group(self.take(t, k), t)
        while waiting:
            waiting = waiting[self.add_fitting(waiting, t):]
            if not waiting:
                break
            if len(waiting) < k and self.queue and self.queue[0].stamps["p_admitted"] <= t:
                more, t = self.reserve_group(self.take(t, k - len(waiting)), t)
                waiting += more
                continue
            assert self.busy_until is not None, "a batch with no room is taken by the forward in flight's end"
            if len(waiting) < k and self.queue:  # room, or the first poll to find the next request queued
                polls = max(1, math.ceil((self.queue[0].stamps["p_admitted"] - t) / _ROOM_POLL_S - 1e-9))
                t = min(self.busy_until, t + polls * _ROOM_POLL_S)
            else:
                t = self.busy_until
        return t

    def take(self, t: float, most: int) -> list[Request]:
        """The next queued requests at `t`, up to `most` (the first is queued by then)."""
        jobs = [self.queue.popleft()]
        while len(jobs) < most and self.queue and self.queue[0].stamps["p_admitted"] <= t:
            jobs.append(self.queue.popleft())
        return jobs

    def reserve_group(self, jobs: list[Request], t: float) -> tuple[list[Request], float]:
        """The RESERVEs of `jobs`, sent at `t` together: the granted, in order, and when D
        answered. A refused request (no D's pool holds it) ends there."""
        answered = t + self.costs.reserve_s
        self.forwards_until(answered)
        for d in self.lanes:
            d.run_until(answered)
        granted = []
        for r in jobs:
            lane = next((d for d in sorted(self.lanes, key=DecodeLane.order_key) if d.reserve(r)), None)
            if lane is None:
                r.refused, r.answered = True, answered + self.costs.deliver_s
                r.stamps.update(p_taken=t, p_reserve_sent=t, p_reserve_answered=answered)
                continue
            r.stamps["p_reserved"] = answered
            self.route[r.index] = lane
            granted.append(r)
        return granted, answered

    def add_fitting(self, waiting: list[Request], t: float) -> int:
        """How many of `waiting`, in order, join the open batch at `t` (handoff.OpenBatch.
        add_fitting); an idle P's forward takes them at once, and the rest of the group
        then waits in the emptied batch for the next forward."""
        self.forwards_until(t)
        n = self._fill(waiting)
        if n and self.busy_until is None:
            self.start_forward(t)
            n += self._fill(waiting[n:])
        return n

    def _fill(self, items: list[Request]) -> int:
        n = 0
        for r in items:
            if not joins_batch(len(self.open), sum(x.rows for x in self.open), r.rows,
                               self.cfg.max_batch_prompts, self.cfg.max_batch_rows):
                break
            self.open.append(r)
            n += 1
        return n

    # the forward stage (pipeline._forward_once)
    def forwards_until(self, t: float) -> None:
        """Each forward that ends by `t` takes the open batch then, or P goes idle."""
        while self.busy_until is not None and self.busy_until <= t:
            if self.open:
                self.start_forward(self.busy_until)
            else:
                self.busy_until = None

    def start_forward(self, at: float) -> None:
        taken, self.open = self.open, []
        seqs = [(r.rows - c, c) for r in taken for c in [self.cache.cached(r, at)]]
        end = at + self.costs.forward_ms(seqs) / 1e3
        for r in taken:
            self.cache.publish(r, end)
            r.stamps.update(prefill_start=at, prefill_end=end, d_committed=end + self.costs.handoff_s)
            self.route[r.index].commit(end + self.costs.handoff_s, r)
        self.busy_until = end


def simulate_pd(requests: list[Request], costs: Costs, n_decode: int, cfg: PlanConfig) -> None:
    """P (PrefillModel), then each D (DecodeLane, overlap), in one timeline: frame times
    into every request's `times`; a request no D's pool holds at its RESERVE is refused
    there (`refused`, `answered`) and costs P and D nothing more."""
    assert costs.step is not None, "load_costs fits D's step for every planned 1pNd variant"
    lanes = [DecodeLane(i, costs.step, costs, True, cfg.pool_tokens) for i in range(n_decode)]
    PrefillModel(requests, costs, cfg, lanes).run()


def simulate_decode(commits: list[tuple[float, Request]], step: StepCost, costs: Costs, overlap: bool) -> None:
    """One D's loop over committed requests (time, request), its pool not counted."""
    lane = DecodeLane(0, step, costs, overlap)
    for at, r in sorted(commits, key=lambda x: x[0]):
        lane.commit(at, r)
    lane.run_until(float("inf"))


# ---------------------------------------------------------------------------- admission
def prefill_per_row_ms(costs: Costs, base_ms: float, prompt_rows: int, max_batch_rows: int) -> float:
    """The per-row term an engine's step model learns from its prefill-only steps: the
    prefill forward of 1, 2, ... prompts of `prompt_rows` (up to `max_batch_rows`) less
    the step's base, over their rows (least squares through 0)."""
    rows = max(1, prompt_rows)
    k = np.arange(1, max(1, max_batch_rows // rows) + 1)
    x = k * rows
    y = np.array([costs.forward_ms([(rows, 0)] * int(n)) for n in k]) - base_ms
    return max(0.0, float(x @ y / (x @ x)))


class FloorAdmission:
    """The prefill-first monolith's rate-floor admission in the model: the engine's own
    verdict (engine/decode/admission.py AdmissionControl.verdict: the worst step, then
    every held stream's rate over its life with the prefills pending) on a step model
    fixed at the plan's fits (the engine started with them as --step-model and
    --no-step-model-refit); the per-stream stall charge is measured from the model's own
    steps as the engine measures its own (observe_stall). Not modelled: the budget's
    delivered-rate feedback, and a prompt that could not meet the floor even alone (a
    4xx)."""

    def __init__(self, coefficients: StepCoefficients, floor_fps: float, margin: float, step_rows: int) -> None:
        admission = RateFloorAdmission(StepModel(coefficients, fixed=True), floor_fps, margin)
        self.control = AdmissionControl(admission, HeldStream(1, 1))
        self.step_rows = step_rows
        self.stall_ms = 0.0  # prefill-only steps since the last decode step, while streams decoded

    @classmethod
    def for_plan(cls, cfg: PlanConfig, costs: Costs) -> FloorAdmission | None:
        if cfg.rate_floor <= 0:
            return None
        step = costs.mono_step
        assert step is not None, "load_costs fits the plain step for every planned monolith"
        low, high = parse_range(cfg.prompt_rows, "prompt_rows")
        per_row = prefill_per_row_ms(costs, step.base_ms, (low + high) // 2, cfg.max_batch_rows)
        coefficients = StepCoefficients(step.base_ms, step.per_stream_ms, step.per_token_ms, per_row)
        return cls(coefficients, cfg.rate_floor, cfg.floor_margin, cfg.max_batch_rows)

    def admits(self, r: Request, active: Sequence[list[Any]], in_step: Sequence[Request],
               waiting: Sequence[Request]) -> bool:
        """The verdict on `r` while `active` streams decode (their frames so far as
        published), `in_step` prompts prefill in the step under way and `waiting` ones
        are queued (admitted, unplanned)."""
        decoding = tuple(HeldStream(a[2], a[0].spec.frames - a[1], frames_out=a[1],
                                    elapsed_ms=(a[0].times[-1] - a[0].times[0]) * 1e3) for a in active)
        pending = PendingPrefills(decoding, tuple(HeldStream(q.rows, q.spec.frames) for q in in_step),
                                  tuple(HeldStream(q.rows, q.spec.frames) for q in waiting),
                                  sum(q.rows for q in in_step), sum(q.rows for q in waiting), self.step_rows)
        held, new_stall_ms = pending.held(self.control.model.prefill_coefficients, r.rows)
        return self.control.verdict(held, HeldStream(r.rows, r.spec.frames), 0.0, new_stall_ms).admit

    def prefill_step(self, ms: float, decoding: int) -> None:
        if decoding:
            self.stall_ms += ms

    def decode_step(self, streams: int) -> None:
        self.control.observe_stall(self.stall_ms, streams)
        self.stall_ms = 0.0


# ---------------------------------------------------------------------------- monoliths
def simulate_monolith(requests: list[Request], costs: Costs, cfg: PlanConfig, chunk: int | None) -> None:
    """prefill-first (`chunk` None), with --rate-floor's admission, or chunked: one
    loop, one GPU."""
    _loop_monolith(requests, costs, cfg, chunk, FloorAdmission.for_plan(cfg, costs) if chunk is None else None)
    refuse_beyond_pool(requests, cfg.pool_tokens, "prefill_start", costs)


# Arrivals reach the loop at their admission time: those due by a step's start can join
# it; those due while it runs are judged then (a prefill step's prompts as in the step
# under way, the decoding streams' frames as published before it) and queue for the next.
def _loop_monolith(requests: list[Request], costs: Costs, cfg: PlanConfig, chunk: int | None,
                   admission: FloorAdmission | None = None) -> None:
    assert costs.mono_step is not None, "load_costs fits the plain step for every planned monolith"
    mono_step = costs.mono_step
    cache = PrefixCacheModel(cfg.block_tokens, cfg.monolith_cache)
    arrivals = deque(sorted(requests, key=lambda r: r.arrival))
    waiting: deque[Request] = deque()
    prefilling: list[list[Any]] = []  # chunked: [request, rows done (its cached rows to start)]
    active: list[list[Any]] = []

    def take_arrivals(until: float, in_step: Sequence[Request] = ()) -> None:
        while arrivals and arrivals[0].arrival + costs.admit_s <= until:
            r = arrivals.popleft()
            r.stamps["p_admitted"] = r.arrival + costs.admit_s
            if admission is not None and not admission.admits(r, active, in_step, waiting):
                r.floor_refused = True
                r.stamps["refused"] = r.stamps["p_admitted"] + costs.deliver_s
                continue
            waiting.append(r)

    t = 0.0
    while arrivals or waiting or prefilling or active:
        take_arrivals(t)
        if not (waiting or prefilling or active):
            if arrivals:
                t = arrivals[0].arrival + costs.admit_s
            continue
        if chunk is None and waiting:
            batch = _take_rows(waiting, cfg.max_batch_rows)
            seqs = [(r.rows - c, c) for r in batch for c in [cache.cached(r, t)]]
            start, t = t, t + costs.forward_ms(seqs) / 1e3
            take_arrivals(t, batch)
            if admission is not None:
                admission.prefill_step((t - start) * 1e3, len(active))
            for r in batch:
                r.stamps.update(prefill_start=start, prefill_end=t)
                cache.publish(r, t)
                _stream_frames(r, t, costs)
                if r.spec.frames > 1:
                    active.append([r, 1, r.rows + 1])
            continue
        if chunk is not None:
            while waiting:
                r = waiting.popleft()
                prefilling.append([r, cache.cached(r, t)])
        budget = (chunk - len(active)) if chunk is not None else 0
        pieces: list[tuple[list[Any], int]] = []
        for p in prefilling:
            if budget <= 0:
                break
            n = min(p[0].rows - p[1], budget)
            pieces.append((p, n))
            budget -= n
        ctx = sum(a[2] for a in active)
        for p, _ in pieces:
            p[0].stamps.setdefault("prefill_start", t)
        if pieces:
            dur = (costs.eager.ms([(n, p[1]) for p, n in pieces])
                   + mono_step.per_stream_ms * len(active) + mono_step.per_token_ms * ctx)
        else:
            dur = mono_step.ms(len(active), ctx)
        t += dur / 1e3
        if chunk is None:
            take_arrivals(t)
            if admission is not None:
                admission.decode_step(len(active))
        for a in active:
            _stream_frames(a[0], t, costs)
            a[1] += 1
            a[2] += 1
        active = [a for a in active if a[1] < a[0].spec.frames]
        for p, n in pieces:
            p[1] += n
            if p[1] == p[0].rows:
                prefilling.remove(p)
                p[0].stamps["prefill_end"] = t
                cache.publish(p[0], t)
                _stream_frames(p[0], t, costs)
                if p[0].spec.frames > 1:
                    active.append([p[0], 1, p[0].rows + 1])


# ---------------------------------------------------------------------------- levels
@dataclass(frozen=True)
class Variant:
    name: str
    gpus: int
    decoders: int = 0          # 1PnD: N
    chunk: int | None = None   # chunked monolith


def variants_of(cfg: PlanConfig) -> list[Variant]:
    out: list[Variant] = []
    for spec in filter(None, (v.strip() for v in cfg.variants.split(","))):
        if spec == "monolith-prefill-first":
            out.append(Variant(spec, 1))
        elif spec == "monolith-chunked":
            out += [Variant(f"monolith-chunked-{c}", 1, chunk=c) for c in parse_list(cfg.chunks, "chunks", int)]
        elif spec.startswith("1p") and spec.endswith("d") and spec[2:-1].isdigit() and int(spec[2:-1]) >= 1:
            n = int(spec[2:-1])
            out.append(Variant(spec, n + 1, decoders=n))
        else:
            raise ValueError(f"variant {spec!r}: expected 1pNd (N >= 1), monolith-prefill-first or "
                             "monolith-chunked")
    return out


def levels_of(cfg: PlanConfig, variant: Variant) -> list[float]:
    overrides = variant_level_overrides("--variant-rate", cfg.variant_rate)
    family = "monolith-chunked" if variant.chunk is not None else variant.name
    return parse_list(overrides.get(variant.name) or overrides.get(family) or cfg.rate, "rate", float)


def capacity_config(cfg: PlanConfig, variant: Variant, levels: list[float]) -> CapacityConfig:
    return CapacityConfig(rate=levels, burst_share=cfg.burst_share, burst_size=cfg.burst_size,
                          duration=cfg.duration, warmup=cfg.ramp, prompt_rows=parse_range(cfg.prompt_rows, "prompt_rows"),
                          frames=parse_range(cfg.frames, "frames"), voices=cfg.voices, voice_reuse=cfg.voice_reuse,
                          seed=cfg.seed, mode_label=variant.name, gpus=variant.gpus, progress=False)


def level_requests(cfg: PlanConfig, cap: CapacityConfig, rate: float, seed: int) -> list[Request]:
    """The requests `bench capacity` sends at this level and seed."""
    model = get_config(cfg.model)
    wcfg = WorkloadConfig(n_codebooks=model.n_codebooks, vocab_sizes=tuple(model.vocab_sizes),
                          prompt_rows=cap.prompt_rows, frames=cap.frames, voices=cap.voices,
                          voice_reuse=cap.voice_reuse, seed=seed)
    schedule = poisson_schedule(Workload(wcfg), cap.model_copy(update={"seed": seed}), rate)
    return [Request(spec.index, at, spec, wcfg.reference_rows) for at, spec in schedule]


def judge(requests: list[Request], cap: CapacityConfig, rate: float) -> dict[str, Any]:
    """The level's row, by driver.summarize_level's rules, over the streams arriving
    after the ramp."""
    results = []
    for r in requests:
        if r.arrival < cap.warmup:
            continue
        res = StreamResult(index=r.index, voice=r.spec.voice, reused=r.spec.reused, prompt_rows=r.rows,
                           frames_requested=r.spec.frames, started_s=r.arrival, send_unix_ns=0, status=200)
        if r.floor_refused:  # as the LB answers it: 503 rate_floor with Retry-After
            res.status, res.error = 503, f"http_503:{REFUSAL_CODE}"
            res.answered_s, res.retry_after = r.stamps["refused"] - r.arrival, str(RETRY_AFTER_S)
            results.append(res)
            continue
        if r.refused:
            res.status, res.error = 429, "http_429:no_capacity"
            res.answered_s = None if r.answered is None else r.answered - r.arrival
            results.append(res)
            continue
        arrivals = np.sort(np.asarray(r.times)) - r.arrival
        if len(arrivals) != r.spec.frames:
            raise AssertionError(f"request {r.index}: {len(arrivals)} frames simulated, {r.spec.frames} asked")
        timing = stream_timing(arrivals, cap.start_frames, cap.fps)
        res.frames, res.arrivals = len(arrivals), arrivals
        res.ttft_s, res.ttfa_s, res.rate, res.worst_window = timing.ttft_s, timing.ttfa_s, timing.rate, \
            timing.worst_window
        res.stalls, res.stall_s = timing.playback.stalls, timing.playback.stall_s
        results.append(res)
    row = summarize_level(results, cap, None, rate, cap.duration)
    row["stages"] = stage_percentiles([r for r in requests if r.arrival >= cap.warmup], cap.start_frames)
    return row


def stage_percentiles(requests: list[Request], start_frames: int) -> dict[str, dict[str, float | None]]:
    """p50/p99 ms of each stage of the model, after the one before it, named by the
    engines' stamps (BENCHMARKS.md section 5's waterfall), over the requests that got
    frames. The model folds the LB's stages into `p_admitted`, RESERVE's into
    `p_reserved`, and the write, checksum and COMMIT into `d_committed`; a monolith has
    no reserve and no commit. 1PnD adds `refusal_in` (a refusal at the client) over the
    requests refused at RESERVE."""
    served = [r for r in requests if r.times]
    pd = any("p_reserved" in r.stamps for r in served) or any(r.answered is not None for r in requests)
    chain = (["p_admitted", "p_reserved", "prefill_start", "prefill_end", "d_committed"] if pd
             else ["p_admitted", "prefill_start", "prefill_end"])
    pairs = [("p_admitted", "client_send"), *zip(chain[1:], chain[:-1], strict=True),
             ("first_frame_in", "client_send"), ("start_frames_in", "client_send")]
    stamps = []
    for r in served:
        times = sorted(r.times)
        stamps.append(dict(r.stamps, client_send=r.arrival, first_frame_in=times[0],
                           start_frames_in=times[min(start_frames, len(times)) - 1]))
    out: dict[str, dict[str, float | None]] = {}
    for stage, after in pairs:
        values = [(st[stage] - st[after]) * 1e3 for st in stamps]
        out[f"{stage} after {after}"] = {k: None if v is None else round(v, 3)
                                         for k, v in percentiles(values, (50, 99)).items()}
    if pd:
        refusals = [(r.answered - r.arrival) * 1e3 for r in requests if r.answered is not None]
        out["refusal_in after client_send"] = {k: None if v is None else round(v, 3)
                                               for k, v in percentiles(refusals, (50, 99)).items()}
    return out


def simulate_level(cfg: PlanConfig, costs: Costs, variant: Variant, cap: CapacityConfig, rate: float,
                   seed: int) -> dict[str, Any]:
    requests = level_requests(cfg, cap, rate, seed)
    if variant.decoders:
        simulate_pd(requests, costs, variant.decoders, cfg)
    else:
        simulate_monolith(requests, costs, cfg, variant.chunk)
    return judge(requests, cap, rate)


def plan_variant(cfg: PlanConfig, costs: Costs, variant: Variant) -> dict[str, Any]:
    levels = levels_of(cfg, variant)
    cap = capacity_config(cfg, variant, levels)
    rows: list[dict[str, Any]] = []
    for level in levels:
        for run in range(cfg.repeat):
            row = simulate_level(cfg, costs, variant, cap, level, cfg.seed + run)
            row["repeat"] = run
            rows.append(row)
        if cfg.stop_at_failure and not all(r["passed"] for r in rows if r["rate"] == level):
            break
    summary = summarize_run(rows, cap)
    if cfg.overload_rate > 0:
        over = capacity_config(cfg, variant, [cfg.overload_rate])
        for run in range(cfg.repeat):
            row = simulate_level(cfg, costs, variant, over, cfg.overload_rate, cfg.seed + run)
            rows.append({**row, "repeat": run, "overload": True})
    return {"rows": rows, "summary": summary}


# ---------------------------------------------------------------------------- measured
def measured_levels(path: str, labels: Sequence[str] = ()) -> dict[str, dict[float, bool]]:
    """A `bench compare` JSON's verdict per variant and level (passed in every run): its
    variants as they are, or with `labels` its copies of those labels, read as their
    variants (a run of one family, `1p1d+fp8,monolith-prefill-first+fp8`, beside a plan
    priced for that family). ValueError when two rows would be read as one variant."""
    doc = json.loads(Path(path).read_text())
    wanted = set(labels) or {""}
    out: dict[str, dict[float, bool]] = {}
    source: dict[str, str] = {}
    for row in doc["rows"]:
        if row.get("rate") is None:
            raise ValueError(f"{path}: closed-loop levels; plan predicts Poisson (--rate) levels only")
        mode, _, label = row["mode"].partition("+")
        if label not in wanted:
            continue
        if source.setdefault(mode, row["mode"]) != row["mode"]:
            raise ValueError(f"{path}: {source[mode]} and {row['mode']} would both be read as {mode}: "
                             "give --measured-labels one label per variant")
        levels = out.setdefault(mode, {})
        levels[row["rate"]] = levels.get(row["rate"], True) and bool(row["passed"])
    if not out:
        raise ValueError(f"{path}: no rows of {'the variants as they are' if wanted == {''} else sorted(wanted)}")
    return out


def versus_measured(rows: list[dict[str, Any]], measured: dict[str, dict[float, bool]]) -> list[dict[str, Any]]:
    """Per variant and level both verdicts, where both exist."""
    predicted: dict[tuple[str, float], bool] = {}
    for row in rows:
        key = (row["mode"], row["rate"])
        predicted[key] = predicted.get(key, True) and bool(row["passed"])
    out = []
    for (mode, rate), passed in sorted(predicted.items()):
        if rate in measured.get(mode, {}):
            out.append({"mode": mode, "rate": rate, "predicted": passed, "measured": measured[mode][rate],
                        "agree": passed == measured[mode][rate]})
    return out


COLUMNS = [
    Column("mode", "mode"),
    Column("rate", "rate/s", "{:g}"),
    Column("repeat", "run"),
    Column("streams", "streams"),
    Column("errors", "errors"),
    Column("refused_share", "refused", "{:.1%}"),
    Column("stutter_share", "stutter", "{:.1%}"),
    Column("min_rate", "min fps", "{:.1f}"),
    Column("goodput_fps", "goodput", "{:.0f}"),
    Column("worst_window", "worst 1s", "{:.0f}"),
    Column("ttft_p50_ms", "TTFT p50", "{:.0f}"),
    Column("ttft_p95_ms", "p95", "{:.0f}"),
    Column("ttfa_p50_ms", "TTFA p50", "{:.0f}"),
    Column("ttfa_p95_ms", "p95", "{:.0f}"),
    Column("ttfa_p99_ms", "p99", "{:.0f}"),
    Column("passed", "pass"),
]
STAGE_COLUMNS = [Column("stage", "stage"), Column("p50", "p50 ms", "{:.1f}"),
                 Column("p99", "p99 ms", "{:.1f}")]
VERSUS_COLUMNS = [Column("mode", "mode"), Column("rate", "rate/s", "{:g}"),
                  Column("predicted", "predicted pass"), Column("measured", "measured pass"),
                  Column("agree", "agree")]


def overload_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant, its --overload-rate runs: the worst of each figure (the most refused,
    the least goodput, the slowest admitted stream) and whether the admitted streams kept the floor in every run."""
    out: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r["mode"] for r in rows if r.get("overload")):
        runs = [r for r in rows if r.get("overload") and r["mode"] == mode]
        worst = {key: pick(vals) if vals else None for key, pick in (("refused_share", max), ("goodput_fps", min),
                                                                     ("min_rate", min))
                 for vals in [[r[key] for r in runs if r[key] is not None]]}
        out[mode] = {"rate": runs[0]["rate"], "runs": len(runs), **worst, "errors": sum(r["errors"] for r in runs),
                     "admitted_kept_floor": all(r["admitted_kept_floor"] for r in runs)}
    return out


def run_plan(cfg: PlanConfig, command: str) -> dict[str, Any]:
    costs, sources = load_costs(cfg)
    rows: list[dict[str, Any]] = []
    per_gpu: dict[str, float | None] = {}
    bounds: dict[str, list[float | None]] = {}
    for variant in variants_of(cfg):
        doc = plan_variant(cfg, costs, variant)
        for row in doc["rows"]:
            row["gpus"] = variant.gpus
        rows += doc["rows"]
        per_gpu.update(doc["summary"]["capacity_per_gpu"])
        bounds.update(doc["summary"]["capacity_bounds_per_gpu"])
    summary: dict[str, Any] = {"predicted": True, "capacity_per_gpu": per_gpu, "capacity_bounds_per_gpu": bounds,
                               **ratios(per_gpu, bounds), "costs": describe_costs(costs), "sources": sources}
    if cfg.overload_rate > 0:
        summary["overload"] = overload_summary(rows)
    if cfg.measured:
        labels = [x.strip() for x in cfg.measured_labels.split(",") if x.strip()]
        versus = versus_measured(rows, measured_levels(cfg.measured, labels))
        summary["versus_measured"] = {"path": cfg.measured, "labels": labels, "levels": versus,
                                      "agree": sum(v["agree"] for v in versus), "of": len(versus)}
    return report.Results(BENCH, machine_info(), command, cfg.model_dump(), rows, summary).document()


def main(argv: list[str]) -> int:
    cfg = parse_config(PlanConfig, argv, "pdunit bench plan")
    try:
        doc = run_plan(cfg, report.command_line(argv, prog="pdunit bench plan"))
    except (OSError, ValueError, KeyError) as exc:
        print(f"pdunit bench plan: {exc}", file=sys.stderr)
        return 2
    print(text_table(doc["rows"], COLUMNS))
    for mode, per_gpu in doc["summary"]["capacity_per_gpu"].items():
        mine = [r for r in doc["rows"] if r["mode"] == mode]
        at = next((r for r in mine if per_gpu and abs(r["rate"] - per_gpu * r["gpus"]) < 1e-6), mine[0])
        print(f"\nthe model's stages, {mode} at {at['rate']:g}/s run {at['repeat']} (compare them with the "
              "measured waterfall there):")
        print(text_table([{"stage": k, **v} for k, v in at["stages"].items()], STAGE_COLUMNS))
    for mode, o in doc["summary"].get("overload", {}).items():
        print(f"\n{mode} at {o['rate']:g}/s (--overload-rate, worst of {o['runs']} runs): "
              + ", ".join(f"{name} {'-' if o[key] is None else fmt.format(o[key])}" for name, key, fmt in (
                  ("refused", "refused_share", "{:.1%}"), ("goodput", "goodput_fps", "{:.0f} frames/s"),
                  ("slowest admitted", "min_rate", "{:.1f} frames/s"))) + f", errors {o['errors']}, "
              + ("admitted streams kept the floor" if o["admitted_kept_floor"] else "admitted streams broke the floor"))
    versus = doc["summary"].get("versus_measured")
    if versus:
        print(f"\nagainst {versus['path']}: {versus['agree']} of {versus['of']} levels agree")
        print(text_table(versus["levels"], VERSUS_COLUMNS))
    report.print_and_write(doc, cfg.out, COLUMNS, "Capacity predicted from measured costs (not a measurement)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

