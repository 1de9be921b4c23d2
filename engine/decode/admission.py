"""Rate-floor admission (ARCHITECTURE.md 4): an engine that decodes refuses a new stream
when its projected step time over the lifetimes of the streams it holds, plus the new
one, would break the rate floor for anyone.

Owns the step model (`StepModel`: step ms from streams, context tokens, prefill rows and
audio streams, seeded from `--step-model` and refitted online), the projection
(`RateFloorAdmission`) and the floor an engine keeps (`resolve_floor`).

Must never block or allocate pages: it answers yes/no and a headroom count; the
caller refuses (status RATE_FLOOR) and holds nothing.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, Field, field_validator

from pdunit.engine import metrics as m
from pdunit.engine.decode.rate_feedback import DeliveringStream, RateFeedback
from pdunit.engine.observability import now_ns
from pdunit.engine.playback import DEFAULT_FPS, FLOOR_X_REAL_TIME

if TYPE_CHECKING:
    from pdunit.engine.audio.codec_stage import StepCost

# The floor when neither a loaded codec nor the model's config names a frame rate: the
# `pdunit` family's, FLOOR_X_REAL_TIME x its real-time rate (`resolve_floor`).
DEFAULT_FLOOR_FPS = FLOOR_X_REAL_TIME * DEFAULT_FPS

RATE_FLOOR_FPS = m.role_metric(Gauge(
    "pdunit_rate_floor_frames_per_second", "The rate floor admission keeps (0 = admission off), and where it "
    f"came from: flag (--rate-floor), codec ({FLOOR_X_REAL_TIME:g} x the loaded codec's frame rate), model "
    f"({FLOOR_X_REAL_TIME:g} x the model config's frame rate), default ({DEFAULT_FLOOR_FPS:g}), cpu (off by "
    "default on CPU)", ["source"], registry=None), "decode", "monolith")
LIFE_REFUSALS = m.role_metric(Counter(
    "pdunit_rate_floor_life_refusals_total", "Of the rate-floor refusals, those of the whole-life check: the "
    "prefills a held stream would wait for (the new prompt's and those admitted before it) would take its rate "
    "over its life under the floor", registry=None), "decode", "monolith")
# Terms of the step model, in the order of StepModel's coefficients; a fit file may leave
# out the optional ones (0).
TERMS = ("base_ms", "per_stream_ms", "per_token_ms", "per_row_ms", "per_audio_stream_ms")
OPTIONAL_TERMS = ("per_row_ms", "per_audio_stream_ms")


def nonneg_fit(x: np.ndarray, y: np.ndarray) -> tuple[tuple[float, ...], float]:
    """Least squares with every coefficient >= 0 (a negative one is dropped, fixed at 0,
    and the rest refitted, so a cost never falls as its term grows); returns the
    coefficients and the fit's worst relative error on its own points."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(x.shape[1])
    full[keep] = np.maximum(coef, 0.0)
    return tuple(float(c) for c in full), float(np.max(np.abs(x @ full - y) / np.maximum(y, 1e-9)))


@dataclass(frozen=True)
class StepCoefficients:
    base_ms: float
    per_stream_ms: float
    per_token_ms: float
    per_row_ms: float = 0.0
    # the codec stage's time per step per audio stream (engine/audio/codec_stage.py)
    per_audio_stream_ms: float = 0.0

    def ms(self, streams: float, context_tokens: float, prefill_rows: float = 0.0,
           audio_streams: float = 0.0) -> float:
        return (self.base_ms + self.per_stream_ms * streams + self.per_token_ms * context_tokens
                + self.per_row_ms * prefill_rows + self.per_audio_stream_ms * audio_streams)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "step model") -> StepCoefficients:
        """Parses a fit file; a missing, negative or unknown field is a ValueError naming it."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not JSON ({exc})") from exc
        if not isinstance(doc, dict):
            raise ValueError(f"{source}: expected an object with {', '.join(TERMS)}")
        unknown = sorted(set(doc) - set(TERMS))
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}: expected {', '.join(TERMS)}")
        values = {}
        for name in TERMS:
            if name not in doc:
                if name in OPTIONAL_TERMS:
                    continue
                raise ValueError(f"{source}: field {name} is missing")
            v = doc[name]
            if isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) or v < 0:
                raise ValueError(f"{source}: field {name} must be a finite number >= 0 (got {v!r})")
            values[name] = float(v)
        return cls(**values)


# step ms = base + per_stream * streams + per_token * context tokens of the batch
# (+ per_row * prefill rows of a monolith's mixed step) (+ per_audio_stream * the audio
# streams of the step: the codec stage's cost), seeded from a fit file (`--step-model`,
# written by `pdunit bench step --step-model-out`) and refitted online from the engine's
# own steps (non-negative least squares over a window); its recent error (observed /
# predicted) is tracked. The codec term is fitted apart, from the codec stage's own time
# per step (`observe_codec`: least squares through 0 over the audio streams of each step
# that had some), and the other terms from the step's time less the codec's: the codec's
# time is measured, never guessed from the mix. With `fixed` (--no-step-model-refit) a
# fit file's own codec term is kept; one without it (0) still gets the measured term.
class StepModel:
    """The engine's step-time model: a seed, then refits from observed steps.

    `observe(streams, context_tokens, ms, prefill_rows)` after every step; the model
    refits every `refit_every` observations over the last `window`, once it has
    `min_points` with at least two distinct batch sizes (a fit from one batch size
    cannot separate base from per-stream cost). Thread-safe."""

    def __init__(self, seed: StepCoefficients, window: int = 512, refit_every: int = 32,
                 min_points: int = 64, error_window: int = 256, fixed: bool = False) -> None:
        self._lock = threading.Lock()
        # fixed (--no-step-model-refit): the seed is the model; observed steps feed the
        # error metric only, never a refit or the budget
        self.fixed = fixed
        self.coefficients = seed
        self.seed = seed
        self._points: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._ratios: deque[float] = deque(maxlen=error_window)
        self._refit_every = refit_every
        self._min_points = min_points
        self._since_fit = 0
        self.fits = 0
        self.fit_error = 0.0  # worst relative error of the last fit on its own points
        # the codec term's points: (audio streams, codec ms) of recent steps with audio,
        # and their running sums of a*c and a*a
        self._codec_points: deque[tuple[float, float]] = deque(maxlen=window)
        self._codec_sums = [0.0, 0.0]

    def predict(self, streams: float, context_tokens: float, prefill_rows: float = 0.0,
                audio_streams: float = 0.0) -> float:
        return self.coefficients.ms(streams, context_tokens, prefill_rows, audio_streams)

    def observe_codec(self, audio_streams: float, codec_ms: float) -> None:
        """One step's codec time over its audio streams: refits the per-audio-stream term
        (least squares through 0 over the window) at once."""
        if audio_streams <= 0 or (self.fixed and self.seed.per_audio_stream_ms > 0):
            return
        a, c = float(audio_streams), max(0.0, float(codec_ms))
        with self._lock:
            if len(self._codec_points) == self._codec_points.maxlen:
                oa, oc = self._codec_points[0]
                self._codec_sums[0] -= oa * oc
                self._codec_sums[1] -= oa * oa
            self._codec_points.append((a, c))
            self._codec_sums[0] += a * c
            self._codec_sums[1] += a * a
            per_audio = max(0.0, self._codec_sums[0] / self._codec_sums[1]) if self._codec_sums[1] > 0 else 0.0
            self.coefficients = replace(self.coefficients, per_audio_stream_ms=per_audio)

    def observe(self, streams: int, context_tokens: int, ms: float, prefill_rows: int = 0) -> None:
        if streams <= 0 and prefill_rows <= 0:
            return
        with self._lock:
            predicted = self.coefficients.ms(streams, context_tokens, prefill_rows)
            if predicted > 0:
                self._ratios.append(ms / predicted)
            if self.fixed:
                return
            self._points.append((float(streams), float(context_tokens), float(prefill_rows), float(ms)))
            self._since_fit += 1
            if self._since_fit >= self._refit_every:
                self._since_fit = 0
                self._refit()

    def _refit(self) -> None:
        """Under the lock."""
        pts = np.array(self._points)
        if len(pts) < self._min_points or len(np.unique(pts[:, 0])) < 2:
            return
        with_rows = bool((pts[:, 2] > 0).any())
        cols = [np.ones(len(pts)), pts[:, 0], pts[:, 1]] + ([pts[:, 2]] if with_rows else [])
        coef, worst = nonneg_fit(np.stack(cols, axis=1), pts[:, 3])
        self.coefficients = StepCoefficients(coef[0], coef[1], coef[2], coef[3] if with_rows else 0.0,
                                             self.coefficients.per_audio_stream_ms)
        self.fit_error = worst
        self.fits += 1

    def under_prediction(self, quantile: float = 0.9) -> float:
        """The `quantile` of observed / predicted over recent steps (1.0 until there are
        enough): above 1 the model under-predicts."""
        with self._lock:
            ratios = list(self._ratios)
        if len(ratios) < 16:
            return 1.0
        return float(np.quantile(ratios, quantile))


class WindowRatio:
    """The last `size` (amount, streams) pairs of decode steps and the ratio of their
    sums, kept as running sums: the new pair added, the evicted one subtracted, O(1) a
    step. Amounts are integers (the caller's unit: rows, ns), so the sums stay exact
    however long the run. Not thread-safe: the caller holds its lock."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self.pairs: deque[tuple[int, int]] = deque(maxlen=size)
        self.amount = 0
        self.streams = 0

    def add(self, amount: int, streams: int) -> float:
        """Appends one step's pair (`streams` > 0); returns the window's amount per stream."""
        if len(self.pairs) == self.size:
            old_amount, old_streams = self.pairs[0]
            self.amount -= old_amount
            self.streams -= old_streams
        self.pairs.append((amount, streams))
        self.amount += amount
        self.streams += streams
        return self.amount / self.streams


@dataclass(frozen=True)
class HeldStream:
    """A stream the engine holds: `context` tokens now (prompt + frames so far, or the
    prompt alone while reserved), `frames_left` steps to go (max frames less those out),
    and whether its frames are decoded to audio (the codec's per-audio-stream cost).

    Where the engine knows them (the prefill-first monolith), its life so far and the
    prefills it will wait for: `frames_out` (0: no frame out yet), `elapsed_ms` from its
    first frame's step to the engine's last published step, `stall_ms` of prefill-only
    steps already admitted that it will wait for, and whether the new prompt's prefill
    would stall it too (`stalled_by_new`): `RateFloorAdmission.life_judge`."""

    context: int
    frames_left: int
    audio: bool = False
    frames_out: int = 0
    elapsed_ms: float = 0.0
    stall_ms: float = 0.0
    stalled_by_new: bool = False


@dataclass(frozen=True)
class Verdict:
    admit: bool
    worst_ms: float      # the projected worst step with the new stream
    budget_ms: float
    at_step: int         # steps from now where the worst step falls
    cold: bool = False   # refused by the trust limit (no fit file, no wide enough steps seen), not the projection
    trusted: int = 0     # with `cold`: the streams the model is trusted for
    engine_bound: bool = False  # alone_fits: not even the smallest stream fits (the engine's steps, not the request)
    idle: bool = False   # admitted against the projection because the engine held nothing (AdmissionControl.judge)
    # refused by the whole-life check (RateFloorAdmission.life_judge): that stream's projected
    # rate over its life and the prefill stall it was charged
    life_fps: float = 0.0
    stall_ms: float = 0.0

    def reason(self) -> str:
        if self.life_fps:
            return (f"rate_floor: the prefills it waits for ({self.stall_ms:.0f} ms) would take a held stream "
                    f"to {self.life_fps:.2f} frames/s over its life, under the floor's budget of "
                    f"{self.budget_ms:.1f} ms a frame")
        if self.cold:
            return (f"rate_floor: without a --step-model fit file the engine trusts its step model for "
                    f"twice the widest step it has seen (at least --cold-streams): it holds at most "
                    f"{self.trusted} streams until it has seen wider steps")
        return (f"rate_floor: the projected step would reach {self.worst_ms:.1f} ms in {self.at_step} "
                f"steps, over the floor's budget of {self.budget_ms:.1f} ms")


def held_stream(h: tuple[int, ...] | HeldStream) -> HeldStream:
    """(context, frames left[, audio]) -> HeldStream (one already is kept)."""
    if isinstance(h, HeldStream):
        return h
    return HeldStream(int(h[0]), int(h[1]), bool(h[2]) if len(h) > 2 else False)


@dataclass(frozen=True)
class Lives:
    """Held streams as arrays, one entry a stream (the fields of HeldStream): what the
    projections read, built once where a search judges one held set many times."""

    context: np.ndarray
    left: np.ndarray
    audio: np.ndarray
    out: np.ndarray
    elapsed: np.ndarray
    stall: np.ndarray
    stalled: np.ndarray

    @classmethod
    def of(cls, streams: Sequence[HeldStream] | Lives) -> Lives:
        if isinstance(streams, Lives):
            return streams
        return cls(np.array([s.context for s in streams], dtype=np.float64),
                   np.array([s.frames_left for s in streams], dtype=np.int64),
                   np.array([s.audio for s in streams], dtype=np.float64),
                   np.array([s.frames_out for s in streams], dtype=np.float64),
                   np.array([s.elapsed_ms for s in streams], dtype=np.float64),
                   np.array([s.stall_ms for s in streams], dtype=np.float64),
                   np.array([s.stalled_by_new for s in streams], dtype=np.float64))

    @classmethod
    def repeat(cls, stream: HeldStream, k: int) -> Lives:
        """`k` streams like `stream`."""
        return cls(np.full(k, float(stream.context)), np.full(k, stream.frames_left, dtype=np.int64),
                   np.full(k, float(stream.audio)), np.full(k, float(stream.frames_out)),
                   np.full(k, stream.elapsed_ms), np.full(k, stream.stall_ms), np.full(k, float(stream.stalled_by_new)))

    @classmethod
    def join(cls, parts: Sequence[Lives]) -> Lives:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in (
            "context", "left", "audio", "out", "elapsed", "stall", "stalled")))

    def __len__(self) -> int:
        return len(self.left)


def worst_step(model: StepCoefficients, streams: Sequence[HeldStream] | Lives,
               prefill_rows: float = 0.0) -> tuple[float, int]:
    """The largest projected step time over the streams' remaining lifetimes and the step
    (from now) where it falls. At step k a stream with `frames_left > k` is in the batch
    with `context + k` tokens."""
    if not len(streams):
        return (model.ms(0, 0, prefill_rows) if prefill_rows else 0.0), 0
    lives = Lives.of(streams)
    left, ctx, audio = lives.left, lives.context, lives.audio
    # Candidate steps: now, and the last step of each stream (just before the batch shrinks).
    ks = np.unique(np.concatenate([[0], np.maximum(left - 1, 0)]))
    order = np.argsort(left)
    left_sorted, ctx_sorted, audio_sorted = left[order], ctx[order], audio[order]
    # Streams alive at step k: frames_left > k. Suffix sums over streams sorted by end.
    suffix_ctx = np.concatenate([np.cumsum(ctx_sorted[::-1])[::-1], [0.0]])
    suffix_audio = np.concatenate([np.cumsum(audio_sorted[::-1])[::-1], [0.0]])
    first_alive = np.searchsorted(left_sorted, ks, side="right")  # index of first stream with left > k
    alive = len(left) - first_alive
    tokens = suffix_ctx[first_alive] + alive * ks
    ms = (model.base_ms + model.per_stream_ms * alive + model.per_token_ms * tokens + model.per_row_ms * prefill_rows
          + model.per_audio_stream_ms * suffix_audio[first_alive])
    ms = np.where(alive > 0, ms, 0.0)
    i = int(np.argmax(ms))
    return float(ms[i]), int(ks[i])


def life_ms(model: StepCoefficients, streams: Sequence[HeldStream] | Lives, prefill_rows: float = 0.0) -> np.ndarray:
    """Each stream's projected time to its last frame: the sum of the projected steps
    over its `frames_left` steps (the steps of `worst_step`'s projection). Between two
    stream ends the batch is fixed and its context grows by one token a stream a step, so
    each segment sums in closed form: O(n log n) for n streams."""
    if not len(streams):
        return np.zeros(0)
    lives = Lives.of(streams)
    order = np.argsort(lives.left, kind="stable")
    ends = lives.left[order].astype(np.float64)
    ctx = lives.context[order]
    audio = lives.audio[order]
    n = len(ends)
    # segment j: steps [ends[j-1], ends[j]), where the sorted streams j.. are alive
    alive = n - np.arange(n, dtype=np.float64)
    suffix_ctx = np.cumsum(ctx[::-1])[::-1]
    suffix_audio = np.cumsum(audio[::-1])[::-1]
    lo = np.concatenate([[0.0], ends[:-1]])
    steps = ends - lo
    sum_k = (lo + ends - 1) * steps / 2  # the step indices k of the segment, summed
    per_step = (model.base_ms + model.per_stream_ms * alive + model.per_token_ms * suffix_ctx
                + model.per_row_ms * prefill_rows + model.per_audio_stream_ms * suffix_audio)
    segment = steps * per_step + model.per_token_ms * alive * sum_k
    out = np.empty(n)
    out[order] = np.cumsum(segment)
    return out


@dataclass(frozen=True)
class PendingPrefills:
    """The prefill-first monolith's held streams and the prefill-only steps they will wait
    for (`life_judge`). Prompts in a step now form one step of `in_step_rows`; the
    unplanned ones the next FIFO steps of up to `step_rows`, which a new prompt joins (its
    rows) or opens (each step it opens adds the step's base). `waiting_all` (decoding
    streams, prompts prefilled and about to run) wait for every step; `in_step` prompts
    for the unplanned steps and the new one; `unplanned` ones only for a step the new
    prompt opens. The streams carry their lives so far, no stall: `held` prices it."""

    waiting_all: tuple[HeldStream, ...]
    in_step: tuple[HeldStream, ...]
    unplanned: tuple[HeldStream, ...]
    in_step_rows: int
    unplanned_rows: int
    step_rows: int

    def __len__(self) -> int:
        return len(self.waiting_all) + len(self.in_step) + len(self.unplanned)

    def held(self, coef: StepCoefficients, new_rows: int,
             queued: Sequence[HeldStream] = ()) -> tuple[list[HeldStream], float]:
        """The held streams with the stalls they will wait for, priced at the model's
        prefill-only step (base + per-row term), and the stall the new prompt's prefill
        of `new_rows` adds for those `stalled_by_new`; `queued`: prompts admitted after
        these (unplanned, their context their rows), last in the list."""
        waiting_ms, in_step_ms, opened = self.stalls(coef, new_rows, sum(q.context for q in queued))
        held = [replace(s, stall_ms=waiting_ms, stalled_by_new=True) for s in self.waiting_all]
        held += [replace(s, stall_ms=in_step_ms, stalled_by_new=True) for s in self.in_step]
        held += [replace(s, stall_ms=0.0, stalled_by_new=opened > 0) for s in (*self.unplanned, *queued)]
        return held, opened * coef.base_ms + coef.per_row_ms * new_rows

    def stalls(self, coef: StepCoefficients, new_rows: int, queued_rows: int = 0) -> tuple[float, float, int]:
        """(stall of `waiting_all`, of `in_step`, steps the new prompt opens) with
        `queued_rows` more unplanned."""
        limit = max(self.step_rows, 1)
        rows = self.unplanned_rows + queued_rows
        steps = -(-rows // limit)
        unplanned_ms = steps * coef.base_ms + coef.per_row_ms * rows
        in_step_ms = coef.base_ms + coef.per_row_ms * self.in_step_rows if self.in_step_rows else 0.0
        return in_step_ms + unplanned_ms, unplanned_ms, -(-(rows + new_rows) // limit) - steps

    def lives(self, coef: StepCoefficients, typical: HeldStream, queued: int) -> tuple[Lives, float]:
        """`held` for a new prompt like `typical` with `queued` of them queued, as arrays."""
        waiting_ms, in_step_ms, opened = self.stalls(coef, typical.context, queued * typical.context)
        waiting, in_step, unplanned = len(self.waiting_all), len(self.in_step), len(self.unplanned) + queued
        lives = Lives.join([self._base_lives, Lives.repeat(typical, queued)])
        lives = replace(lives, stall=np.concatenate([np.full(waiting, waiting_ms), np.full(in_step, in_step_ms),
                                                     np.zeros(unplanned)]),
                        stalled=np.concatenate([np.ones(waiting + in_step), np.full(unplanned, float(opened > 0))]))
        return lives, opened * coef.base_ms + coef.per_row_ms * typical.context

    @cached_property
    def _base_lives(self) -> Lives:
        return Lives.of([*self.waiting_all, *self.in_step, *self.unplanned])

    def opened_last(self, rows: int, k: int) -> int:
        """Of `k` prompts of `rows` rows queued one after another, the last that opened a
        step (0: none did)."""
        limit, rows = max(self.step_rows, 1), max(rows, 1)
        before, after = -(-self.unplanned_rows // limit), -(-(self.unplanned_rows + k * rows) // limit)
        if after == before:
            return 0
        return ((after - 1) * limit - self.unplanned_rows) // rows + 1


@dataclass(frozen=True)
class LifeTimes:
    """`RateFloorAdmission.life_times`: per stream (the held ones, then the new one), its
    time from its first frame to its last with the new stream (`with_new`), without it
    (held ones only), what the floor allows, and whether it is judged at all (it has
    frames after its first to come)."""

    with_new: np.ndarray
    without: np.ndarray
    allowed: np.ndarray
    judged: np.ndarray
    intervals: np.ndarray
    charged_ms: np.ndarray  # the prefill stall each was charged, the new prompt's included


# Every held stream (decoding, or reserved and not yet committed) grows by one context
# token per step until its max frames; the projected step is piecewise linear between
# stream ends, so its maximum over the horizon is at now or just before a stream ends:
# those points are checked. The budget is 1 / floor less `margin`, shrunk by the model's
# recent under-prediction (budget / p90 of observed/predicted when above 1), so one bad
# fit cannot stutter everyone, and by the feedback from the rates streams delivered
# (`feedback`, engine/decode/rate_feedback.py: what no step prediction sees).
# The whole-life check (`life_judge`, where the engine knows its streams' lives and the
# prefills they wait for: the prefill-first monolith) judges each stream's rate as the
# loadgen measures it, frames after the first over the time from the first to the last:
# (frames out - 1 + frames left) / (elapsed + its projected steps + the prefill stall it
# will wait for) must stay >= 1 / budget for every held stream and the new one. The stall
# of the prompts already admitted is charged once, as it will fall, not per step; a
# stream that ran fast has banked slack for it, one that just started has none. The
# per-step charge (`charge_ms_per_stream`) still covers the refills to come.
class RateFloorAdmission:
    """Admits a stream only while the projected step stays within the floor's budget
    for every stream held (the comment above)."""

    def __init__(self, model: StepModel, floor_fps: float, margin: float = 0.10,
                 error_quantile: float = 0.9, feedback: RateFeedback | None = None) -> None:
        if floor_fps <= 0:
            raise ValueError(f"rate floor must be > 0 frames/s (got {floor_fps})")
        if not 0 <= margin < 1:
            raise ValueError(f"floor margin must be in [0, 1) (got {margin})")
        if not 0 < error_quantile <= 1:
            raise ValueError(f"floor error quantile must be in (0, 1] (got {error_quantile})")
        self.model = model
        self.floor_fps = floor_fps
        self.margin = margin
        self.error_quantile = error_quantile  # which quantile of observed / predicted shrinks the budget
        self.feedback = feedback  # None: the delivered rates do not move the budget

    def nominal_budget_ms(self) -> float:
        """1 / floor less the margin: a stream over it alone can never be served."""
        return 1000.0 / self.floor_fps * (1.0 - self.margin)

    def budget_ms(self) -> float:
        """The nominal budget, shrunk when the model has been under-predicting and by the
        delivered rates' feedback factor (a fixed model is trusted as it is)."""
        if self.model.fixed:
            return self.nominal_budget_ms()
        factor = self.feedback.factor if self.feedback is not None else 1.0
        return self.nominal_budget_ms() * factor / max(1.0, self.model.under_prediction(self.error_quantile))

    def coefficients(self, charge_ms_per_stream: float = 0.0) -> StepCoefficients:
        """The model's terms, each stream charged `charge_ms_per_stream` more: the work
        not its own that it waits for, per decoding stream (a monolith's prompts:
        AdmissionControl.charge_ms_per_stream)."""
        coef = self.model.coefficients
        if charge_ms_per_stream <= 0:
            return coef
        return replace(coef, per_stream_ms=coef.per_stream_ms + charge_ms_per_stream)

    def judge(self, held: Iterable[HeldStream], new: HeldStream, prefill_rows: float = 0.0,
              charge_ms_per_stream: float = 0.0) -> Verdict:
        """`prefill_rows`: prompt rows every step is expected to carry whatever its
        streams (the budget monolith's minimum chunk); `charge_ms_per_stream`: see
        `coefficients`."""
        streams = list(held) + [new]
        worst, at = worst_step(self.coefficients(charge_ms_per_stream), streams, prefill_rows)
        budget = self.budget_ms()
        return Verdict(worst <= budget, worst, budget, at)

    def life_judge(self, held: Sequence[HeldStream], new: HeldStream, new_stall_ms: float = 0.0,
                   prefill_rows: float = 0.0, charge_ms_per_stream: float = 0.0) -> Verdict:
        """The whole-life check (the comment above the class): refuses when the new
        stream, its prefill (`new_stall_ms`, charged to the held streams that wait for it)
        and its steps would take a held stream (or the new one) from its floor over its
        whole life to under it. Admits without computing anything when no held stream has
        a life so far or a stall and the new prompt stalls no one: the worst step decides."""
        budget = self.budget_ms()
        if not self.lives_matter(held, new_stall_ms):
            return Verdict(True, 0.0, budget, 0)
        t = self.life_times(held, new, new_stall_ms, prefill_rows, charge_ms_per_stream, budget)
        # a held stream that misses its floor even without the new one is lost to it either
        # way: refusing would only hold every new stream back for the rest of its life
        breaks = t.judged & (t.with_new > t.allowed) & np.concatenate([t.without <= t.allowed[:len(held)], [True]])
        if not breaks.any():
            return Verdict(True, 0.0, budget, 0)
        i = int(np.argmax(np.where(breaks, t.with_new / np.maximum(t.allowed, 1e-9), -np.inf)))
        fps = float(t.intervals[i] / t.with_new[i] * 1000) if t.with_new[i] > 0 else 0.0
        left = held[i].frames_left if i < len(held) else new.frames_left
        return Verdict(False, float(t.with_new[i] / t.intervals[i]), budget, left, life_fps=fps,
                       stall_ms=float(t.charged_ms[i]))

    @staticmethod
    def lives_matter(held: Sequence[HeldStream] | Lives, new_stall_ms: float) -> bool:
        """Whether the whole-life check can refuse anything the worst step admits: some held
        stream has a life so far or a stall, or the new prompt stalls someone."""
        if isinstance(held, Lives):
            return new_stall_ms > 0 or bool((held.out > 0).any() or (held.stall > 0).any())
        return new_stall_ms > 0 or any(s.frames_out or s.stall_ms > 0 for s in held)

    def life_times(self, held: Sequence[HeldStream] | Lives, new: HeldStream, new_stall_ms: float,
                   prefill_rows: float, charge_ms_per_stream: float, budget: float) -> LifeTimes:
        """Each stream's life with and without the new one (`life_judge`)."""
        coef = self.coefficients(charge_ms_per_stream)
        before = Lives.of(held)
        streams = Lives.join([before, Lives.of([new])])
        out, left = streams.out, streams.left.astype(np.float64)
        started = out > 0
        # frames after the first (the loadgen's rate: over the time since the first frame)
        intervals = np.where(started, out - 1 + left, np.maximum(left - 1, 0))
        # the future steps that fall after the first frame: all of a started stream's; a
        # waiting one's first step brings its first frame
        future = np.where(started, 1.0, np.where(left > 0, np.maximum(left - 1, 0) / np.maximum(left, 1), 0.0))
        charged = streams.stall + new_stall_ms * streams.stalled
        n = len(before)
        with_new = streams.elapsed + life_ms(coef, streams, prefill_rows) * future + charged
        without = before.elapsed + life_ms(coef, before, prefill_rows) * future[:n] + before.stall
        return LifeTimes(with_new, without, intervals * budget, intervals > 0, intervals, charged)

    def alone_fits(self, new: HeldStream) -> Verdict:
        """Whether the stream could meet the floor even alone, against the nominal budget
        (a 4xx, not a retry, if not: a budget shrunk for the model's recent error only
        delays a stream, it never makes one unservable). When not even a one-row,
        one-frame stream fits, the engine's own steps are the cause, not the request:
        `engine_bound`, and the caller judges it as any stream (a retry, 503)."""
        worst, at = worst_step(self.model.coefficients, [new])
        budget = self.nominal_budget_ms()
        if worst <= budget:
            return Verdict(True, worst, budget, at)
        smallest, _ = worst_step(self.model.coefficients, [HeldStream(1, 1, new.audio)])
        return Verdict(False, worst, budget, at, engine_bound=smallest > budget)

    def headroom(self, held: Sequence[HeldStream], typical: HeldStream, limit: int = 4096,
                 charge_ms_per_stream: float = 0.0) -> int:
        """How many more streams like `typical` would be admitted now (binary search)."""
        lives = Lives.of(held)
        budget = self.budget_ms()
        coef = self.coefficients(charge_ms_per_stream)

        def fits(k: int) -> bool:
            return worst_step(coef, Lives.join([lives, Lives.repeat(typical, k)]))[0] <= budget

        return search(fits, limit)


def search(fits: Callable[[int], bool], limit: int) -> int:
    """The largest k in [0, `limit`] with `fits(k)`, for `fits` true up to some k and false
    after: doubling from 1, then halving."""
    if limit <= 0 or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


class AdmissionControl:
    """An engine's admission state: the step model it refits from its steps, the floor,
    and the typical stream (median of the recent admitted requests, seeded by
    `typical`) that headroom counts in. Exports its metrics; thread-safe."""

    def __init__(self, admission: RateFloorAdmission, typical: HeldStream, recent: int = 64,
                 seeded: bool = True, cold_streams: int = 8) -> None:
        self.admission = admission
        # Without a fit file the model knows only the steps it has seen: it is trusted
        # for at most `trusted_streams()` (cold_streams, or twice the widest step seen):
        # a fit of small batches must not admit a burst by extrapolation.
        self.seeded = seeded
        self.cold_streams = cold_streams
        self.widest_step = 0
        self._lock = threading.Lock()
        self._recent: deque[tuple[int, int, bool]] = deque([(typical.context, typical.frames_left, typical.audio)],
                                                           maxlen=recent)
        # `export_for`'s last answer and the key it was computed for
        self._exported: tuple[Hashable, int] | None = None
        self.headroom_computations = 0
        # The work of prompts its streams wait for, per decoding stream per step recently
        # (`charge_ms_per_stream`): the prefill-first monolith's prefill-only steps, in ms
        # (`observe_stall`), and the chunked monolith's prompt rows in its mixed steps
        # (`observe_rows`), priced at the model's per-row term when judged
        self._stalls = WindowRatio(256)  # (stall ns, streams) per decode step
        self.stall_ms_per_stream = 0.0
        self._row_loads = WindowRatio(256)  # (prompt rows, streams) per decode step
        self.rows_per_stream = 0.0

    @property
    def model(self) -> StepModel:
        return self.admission.model

    def typical(self) -> HeldStream:
        """The median recent stream; an audio one when at least half the recent ones were."""
        with self._lock:
            pts = np.array(self._recent, dtype=np.float64)
        return HeldStream(int(np.median(pts[:, 0])), int(np.median(pts[:, 1])), bool(pts[:, 2].mean() >= 0.5))

    def judge(self, held: Iterable[tuple[int, ...] | HeldStream], prompt_tokens: int, max_frames: int,
              prefill_rows: float = 0.0, audio: bool = False, new_stall_ms: float = 0.0) -> Verdict:
        """The verdict on a new stream (`audio`: its frames are decoded by the codec);
        `held`: (context, frames left[, audio]) of each held stream, or HeldStreams with
        their lives so far and the prefills they wait for; `new_stall_ms`: what the new
        prompt's prefill adds to the stall of those `stalled_by_new`. An admitted one
        becomes part of the typical mix."""
        streams = [held_stream(h) for h in held]
        v = self.verdict(streams, HeldStream(prompt_tokens, max_frames, audio), prefill_rows, new_stall_ms)
        if v.life_fps:
            LIFE_REFUSALS.inc()
        if v.idle:
            m.D_RATE_FLOOR_IDLE_ADMITS.inc()
        if v.admit:
            with self._lock:
                self._recent.append((prompt_tokens, max_frames, audio))
        else:
            m.D_RATE_FLOOR_REFUSALS.inc()
        return v

    def verdict(self, streams: Sequence[HeldStream], new: HeldStream, prefill_rows: float = 0.0,
                new_stall_ms: float = 0.0) -> Verdict:
        """`judge`'s verdict, nothing recorded: the trust limit, the worst step, then the
        whole-life check; an engine that holds nothing admits one stream whatever."""
        trusted = self.trusted_streams()
        if len(streams) >= trusted:  # beyond what the model has seen: not judged by it at all
            v = Verdict(False, 0.0, self.admission.budget_ms(), 0, cold=True, trusted=trusted)
        else:
            charge = self.charge_ms_per_stream()
            v = self.admission.judge(streams, new, prefill_rows, charge)
            if v.admit:
                life = self.admission.life_judge(streams, new, new_stall_ms, prefill_rows, charge)
                if not life.admit:
                    v = life
        if not v.admit and not streams:
            # Liveness: an engine that holds nothing takes no steps, so a model (or a
            # budget shrunk by its error) that refuses one stream would never see the
            # step that corrects it and would refuse forever. One stream alone is what
            # this engine can do at best; its steps refit the model.
            v = replace(v, admit=True, idle=True)
        return v

    def trusted_streams(self) -> int:
        """How many streams the model may judge: any with a fit file; else the cold-start
        limit, or twice the widest step observed when that is more."""
        if self.seeded:
            return 1 << 30
        return max(self.cold_streams, 2 * self.widest_step)

    def alone_fits(self, prompt_tokens: int, max_frames: int, audio: bool = False) -> Verdict:
        return self.admission.alone_fits(HeldStream(prompt_tokens, max_frames, audio))

    def headroom(self, held: Iterable[tuple[int, ...]] | PendingPrefills) -> int:
        """Streams like `typical()` that would still be admitted one after another: by the
        worst step over `held`, or, for the prefill-first monolith's `PendingPrefills`,
        by `verdict` with the prefills they will wait for (`life_headroom`)."""
        self.headroom_computations += 1
        if isinstance(held, PendingPrefills):
            n = len(held)
            room = self.life_headroom(held, self.typical(), max(0, min(4096, self.trusted_streams() - n)))
        else:
            streams = [held_stream(h) for h in held]
            n = len(streams)
            room = self.admission.headroom(streams, self.typical(), charge_ms_per_stream=self.charge_ms_per_stream())
        if not n:
            room = max(room, 1)  # an engine holding nothing admits one stream (judge: liveness)
        return max(0, min(room, self.trusted_streams() - n))

    # `life_headroom` counts what `verdict` would admit of k prompts like `typical` queued
    # one after another (the k-th judged with the k - 1 before it queued unplanned), in
    # O(log k) projections. The k-th is refused at the first k where the worst step breaks
    # or some stream's life with it breaks, among the held streams not already lost
    # without any (one that breaks at k was inside its floor at k - 1, so the verdict
    # judges it) and every typical one: each stream's life only grows with k. Unplanned
    # prompts are charged only by a k that opens a step, so their worst is at the last k
    # that opened one: that k is judged too. The worst step's count comes first (one
    # cheap projection a probe); the lives are searched under it only when it breaks them.
    def life_headroom(self, pending: PendingPrefills, typical: HeldStream, limit: int) -> int:
        """How many prompts like `typical` `verdict` would admit one after another with
        the prefills `pending` (at most `limit`)."""
        admission, coef, charge = self.admission, self.model.coefficients, self.charge_ms_per_stream()
        budget = admission.budget_ms()
        charged = admission.coefficients(charge)
        first, _ = pending.lives(coef, typical, 0)
        n = len(first)

        def steps_fit(k: int) -> bool:
            return worst_step(charged, Lives.join([first, Lives.repeat(typical, k)]))[0] <= budget

        room = search(steps_fit, limit)
        if not room:
            return 0
        lost = np.zeros(n, dtype=bool)
        if n:
            t = admission.life_times(first, typical, 0.0, 0.0, charge, budget)
            lost = t.judged[:n] & (t.without > t.allowed[:n])

        def life_breaks(k: int) -> bool:
            held, new_stall_ms = pending.lives(coef, typical, k - 1)
            if not admission.lives_matter(held, new_stall_ms):
                return False
            t = admission.life_times(held, typical, new_stall_ms, 0.0, charge, budget)
            broken = t.judged & (t.with_new > t.allowed)
            return bool((broken[:n] & ~lost).any() or broken[n:].any())

        def lives_fit(k: int) -> bool:
            opened = pending.opened_last(typical.context, k)
            return not (life_breaks(k) or (0 < opened < k and life_breaks(opened)))

        if lives_fit(room):
            return room
        return search(lives_fit, room - 1)

    def observe(self, streams: int, context_tokens: int, ms: float, prefill_rows: int = 0,
                codec: StepCost | None = None) -> None:
        """One step: `ms` its whole time, `codec` the codec stage's part of it and the
        step's audio streams (engine/step_loop.py `publish_step`): the codec term; the
        rest of the time fits the other terms."""
        self.widest_step = max(self.widest_step, streams)
        codec_ms = 0.0
        if codec is not None and codec.audio_streams > 0:
            codec_ms = codec.seconds * 1000
            self.model.observe_codec(codec.audio_streams, codec_ms)
        self.model.observe(streams, context_tokens, max(0.0, ms - codec_ms), prefill_rows)

    def observe_stall(self, stall_ms: float, streams: int) -> None:
        """One decode step of `streams` streams that waited `stall_ms` since the previous
        one for steps not theirs (the prefill-first monolith's prefill-only steps): over
        the last 256 decode steps, their waits over their streams become
        `stall_ms_per_stream`."""
        if streams <= 0:
            return
        with self._lock:
            # the waits over the stream-steps that saw them: a decode step of few streams
            # (a ramp's start) weighs as little as it decodes
            self.stall_ms_per_stream = self._stalls.add(round(max(0.0, stall_ms) * 1e6), streams) / 1e6

    def observe_rows(self, rows: int, streams: int) -> None:
        """One decode step of `streams` streams that carried `rows` prompt rows (the
        chunked monolith's mixed steps): over the last 256 decode steps, their rows over
        their stream-steps become `rows_per_stream`."""
        if streams <= 0:
            return
        with self._lock:
            self.rows_per_stream = self._row_loads.add(max(0, rows), streams)

    def observe_delivery(self, ended: Iterable[DeliveringStream],
                         running: Callable[[], Iterable[DeliveringStream]]) -> None:
        """After a published step: the streams it ended and (`running()`, asked now and
        then) the running ones, whose delivered rates feed the budget's feedback factor."""
        feedback = self.admission.feedback
        if feedback is not None:
            feedback.observe(ended, running, now_ns())

    def charge_ms_per_stream(self) -> float:
        """What every projected stream is charged per step beyond the model's per-stream
        term: the prompts of a closed loop at capacity, each held stream bringing its
        refill's (the stall of `observe_stall`, and the rows of `observe_rows` at the
        model's per-row term)."""
        return self.stall_ms_per_stream + self.model.coefficients.per_row_ms * self.rows_per_stream

    def export_for(self, key: Hashable, held: Callable[[], Iterable[tuple[int, ...]] | PendingPrefills]) -> int:
        """`export` at most once per `key`: the engine's step and the version of its held
        set (it changes whenever the held streams, the step model or the typical stream
        can change). Between steps and changes, a probe (Info) gets the headroom computed
        last instead of a binary search over the held streams' lifetimes. The key is read
        before `held()`, so a value is never kept past a change."""
        with self._lock:
            last = self._exported
        if last is not None and last[0] == key:
            return last[1]
        value = self.export(held())
        with self._lock:
            self._exported = (key, value)
        return value

    def export(self, held: Iterable[tuple[int, ...]] | PendingPrefills) -> int:
        """Sets the admission gauges; returns the headroom."""
        headroom = self.headroom(held)
        m.D_HEADROOM.set(headroom)
        c = self.model.coefficients
        for term in TERMS:
            m.D_STEP_MODEL_MS.labels(term=term).set(getattr(c, term))
        m.D_STEP_MODEL_MS.labels(term="stall_per_stream_ms").set(self.stall_ms_per_stream)
        m.D_STEP_MODEL_MS.labels(term="prompt_rows_per_stream_ms").set(c.per_row_ms * self.rows_per_stream)
        m.D_STEP_MODEL_ERROR.set(self.model.under_prediction())
        feedback = self.admission.feedback
        m.D_RATE_FLOOR_FEEDBACK.set(feedback.factor if feedback is not None else 1.0)
        quantile = feedback.last_quantile if feedback is not None else None
        m.D_RATE_FLOOR_DELIVERED.set(quantile if quantile is not None else 0.0)
        return headroom


def load_step_model(path: str) -> StepCoefficients:
    """`--step-model FILE`: a fit file as `pdunit bench step` writes it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--step-model {path}: {exc.strerror or exc}") from exc
    return StepCoefficients.from_json(text, f"--step-model {path}")


class AdmissionFields(BaseModel):
    """The flags of every engine that decodes (D, the monolith)."""

    rate_floor: float | None = Field(None, ge=0, description=f"rate floor in frames/s per stream "
                                     f"({FLOOR_X_REAL_TIME:g} x the codec's frame rate: {DEFAULT_FLOOR_FPS:g} for "
                                     f"{DEFAULT_FPS:g} Hz): a stream whose admission would break it for any held "
                                     f"stream is refused (RATE_FLOOR); 0 = off; default on a CUDA device: "
                                     f"{FLOOR_X_REAL_TIME:g} x the --codec's frame rate, else {FLOOR_X_REAL_TIME:g} "
                                     f"x the model config's (CSM: codec_config's 12.5 Hz -> "
                                     f"{FLOOR_X_REAL_TIME * 12.5:g}), else {DEFAULT_FLOOR_FPS:g}; 0 (off) on CPU")
    floor_margin: float = Field(0.10, ge=0, lt=1, description="share of the floor's step budget (1 / floor) kept "
                                "free")
    step_model: str = Field("", description="the step-time model's seed: a fit file from `pdunit bench step` "
                            "(<results>.fit.json); without one the engine holds at most --cold-streams until it "
                            "has fitted its own steps")
    step_model_refit: bool = Field(True, description="refit the step model from the engine's own steps and shrink "
                                   "the budget while it under-predicts; --no-step-model-refit: the --step-model fit "
                                   "is used as it is (measured on this hardware and trusted; needs --step-model)")
    cold_streams: int = Field(8, gt=0, description="without --step-model: streams held before the first fit")
    floor_error_quantile: float = Field(0.9, gt=0, le=1, description="the quantile of recent observed / predicted "
                                        "step times that shrinks the budget when above 1 (0.5: the model's typical "
                                        "error, for steps that jitter, e.g. on a shared CPU; 0.9: its bad tail)")
    floor_feedback_quantile: float = Field(0.05, ge=0, lt=1, description="the quantile of recent streams' "
                                           "delivered rate / floor that shrinks the budget when under 1 + "
                                           "--floor-feedback-margin and relaxes it slowly when well above "
                                           "(engine/decode/rate_feedback.py); 0 = off; off with "
                                           "--no-step-model-refit")
    floor_feedback_margin: float = Field(0.02, ge=0, lt=1, description="how far above the floor that quantile "
                                         "of delivered rates must stay")
    headroom_stream: str = Field("1500:420", description="PROMPT_ROWS:FRAMES of the stream headroom counts in "
                                 "until the engine has seen its own (then the median of the recent ones)")

    @field_validator("headroom_stream")
    @classmethod
    def _rows_colon_frames(cls, v: str) -> str:
        rows, _, frames = v.partition(":")
        if not (rows.isdigit() and frames.isdigit() and int(rows) > 0 and int(frames) > 0):
            raise ValueError(f"expected PROMPT_ROWS:FRAMES, two positive integers (got {v!r})")
        return v

    def floor_fps(self, on_gpu: bool) -> float:
        """The floor without a model's frame rate (`resolve_floor` for an engine's)."""
        return resolve_floor(self.rate_floor, on_gpu).fps


@dataclass(frozen=True)
class FloorSetting:
    """The rate floor an engine keeps and where it came from (`resolve_floor`)."""

    fps: float
    source: str  # flag | codec | model | default | cpu
    detail: str

    def export(self) -> None:
        RATE_FLOOR_FPS.clear()
        RATE_FLOOR_FPS.labels(source=self.source).set(self.fps)

    def log_fields(self) -> dict[str, object]:
        return {"floor_fps": self.fps, "floor_source": self.source, "floor_detail": self.detail}


def resolve_floor(flag: float | None, on_gpu: bool, codec_frame_rate_hz: float | None = None,
                  model_frame_rate_hz: float | None = None) -> FloorSetting:
    """The floor follows the model (ARCHITECTURE.md 4: FLOOR_X_REAL_TIME x the codec's
    frame rate). `--rate-floor` wins; else off on CPU (a shared CPU meets no floor); else
    that many times the loaded codec's frame rate; else the frame rate the model's config
    names (CSM's codec_config); else DEFAULT_FLOOR_FPS (engine/playback.py's DEFAULT_FPS)."""
    if flag is not None:
        return FloorSetting(float(flag), "flag", f"--rate-floor {flag:g}" + (" (admission off)" if flag <= 0 else ""))
    if not on_gpu:
        return FloorSetting(0.0, "cpu", "off by default on CPU: --rate-floor turns admission on")
    x = FLOOR_X_REAL_TIME
    if codec_frame_rate_hz:
        return FloorSetting(x * codec_frame_rate_hz, "codec", f"{x:g} x the codec's {codec_frame_rate_hz:g} Hz")
    if model_frame_rate_hz:
        return FloorSetting(x * model_frame_rate_hz, "model",
                            f"{x:g} x the model config's {model_frame_rate_hz:g} Hz (no --codec loaded)")
    return FloorSetting(DEFAULT_FLOOR_FPS, "default", f"{DEFAULT_FLOOR_FPS:g}: neither a codec nor the model's "
                        f"config names a frame rate ({x:g} x {DEFAULT_FPS:g} Hz, the pdunit family's)")


def build_admission(cfg: AdmissionFields, on_gpu: bool, floor: FloorSetting | None = None) -> AdmissionControl | None:
    """The engine's admission from its flags and its floor (`resolve_floor`; without one,
    resolved from the flag alone); None when the floor is 0 (off). Raises ValueError
    naming the flag for a bad fit file."""
    setting = floor if floor is not None else resolve_floor(cfg.rate_floor, on_gpu)
    setting.export()
    floor_fps = setting.fps
    if floor_fps <= 0:
        return None
    if not cfg.step_model_refit and not cfg.step_model:
        raise ValueError("--no-step-model-refit needs --step-model: without a fit file there is no model to keep")
    seed = load_step_model(cfg.step_model) if cfg.step_model else StepCoefficients(0.0, 0.0, 0.0)
    rows, _, frames = cfg.headroom_stream.partition(":")
    model = StepModel(seed, fixed=not cfg.step_model_refit)
    feedback = (RateFeedback(floor_fps, cfg.floor_feedback_quantile, cfg.floor_feedback_margin)
                if cfg.floor_feedback_quantile > 0 and cfg.step_model_refit else None)
    return AdmissionControl(RateFloorAdmission(model, floor_fps, cfg.floor_margin, cfg.floor_error_quantile,
                                               feedback),
                            HeldStream(int(rows), int(frames)), seeded=bool(cfg.step_model),
                            cold_streams=cfg.cold_streams)
