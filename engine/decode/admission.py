"""Rate-floor admission (ARCHITECTURE.md 4): an engine that decodes refuses a new stream
when its projected step time over the lifetimes of the streams it holds, plus the new
one, would break the rate floor for anyone.

Owns the projection against the floor (`RateFloorAdmission`), an engine's admission
state and headroom (`AdmissionControl`), its flags and the floor it keeps (`resolve_floor`,
`build_admission`); the step model and the streams' lives live beside it (step_model.py,
stream_lives.py).
Must never block or allocate pages: it answers yes/no and a headroom count; the
caller refuses (status RATE_FLOOR) and holds nothing.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, Field, field_validator

from pdunit.engine import metrics as m
from pdunit.engine.decode.rate_feedback import DeliveringStream, RateFeedback
from pdunit.engine.decode.step_model import (
    ERROR_SPAN,
    TERMS,
    StepCoefficients,
    StepModel,
    WindowRatio,
    load_step_model,
)
from pdunit.engine.decode.stream_lives import (
    HeldStream,
    LifeTimes,
    Lives,
    PendingPrefills,
    Verdict,
    held_stream,
    life_ms,
    typical_room,
    worst_step,
)
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


# Every held stream (decoding, or reserved and not yet committed) grows by one context
# token per step until its max frames; the projected step is piecewise linear between
# stream ends, so its maximum over the horizon is at now or just before a stream ends:
# those points are checked. The budget is 1 / floor less `margin`, shrunk by the model's
# recent under-prediction (budget / p90 of observed/predicted over 16-step spans when
# above 1: a stream's rate sums its steps, so single-step jitter is not one), so one bad
# fit cannot stutter everyone, and by the feedback from the rates streams delivered
# (`feedback`, engine/decode/rate_feedback.py: what no step prediction sees).
# The whole-life check (`life_judge`, where the engine knows its streams' lives and the
# prefills they wait for: the prefill-first monolith) judges each stream's rate as the
# loadgen measures it, frames after the first over the time from the first to the last:
# (frames out - 1 + frames left) / (elapsed + its projected steps + the prefill stall it
# will wait for) must stay >= 1 / budget for every held stream and the new one. The stall
# of the prompts already admitted and the new one's is charged once, as it will fall, not
# per step; a stream that ran fast has banked slack for it, one that just started has
# none. The per-step charge (`charge_ms_per_stream`, the recent stall per stream-step)
# prices the refills to come over the rest of a life; it counts arrivals like those
# known now, which a steady state's queue holds as often at a life's end as now, so a
# life is charged the larger of the two, never their sum (a closed loop at capacity:
# the steady state's; a clump: the prompts known).
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
        stream, its prefill (`new_stall_ms`, each held stream charged its
        `new_stall_share`) and its steps would take a held stream (or the new one) from
        its floor over its whole life to under it. Admits without computing anything when
        no held stream has a life so far or a stall and the new prompt stalls no one: the
        worst step decides."""
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
        coef = self.model.coefficients
        # the per-step charge alone: a life's steady-state wait for the refills to come
        refill = StepCoefficients(0.0, max(0.0, charge_ms_per_stream), 0.0)
        before = Lives.of(held)
        streams = Lives.join([before, Lives.of([new])])
        out, left = streams.out, streams.left.astype(np.float64)
        started = out > 0
        # frames after the first (the loadgen's rate: over the time since the first frame)
        intervals = np.where(started, out - 1 + left, np.maximum(left - 1, 0))
        # the future steps that fall after the first frame: all of a started stream's; a
        # waiting one's first step brings its first frame
        future = np.where(started, 1.0, np.where(left > 0, np.maximum(left - 1, 0) / np.maximum(left, 1), 0.0))
        charged = streams.stall + new_stall_ms * streams.new_share
        n = len(before)
        # a life waits for the larger of the prefills known now and the steady state's
        # (the comment above the class): the latter counts arrivals like these already
        waits = np.maximum(charged, life_ms(refill, streams) * future)
        waits_before = np.maximum(before.stall, life_ms(refill, before) * future[:n])
        with_new = streams.elapsed + life_ms(coef, streams, prefill_rows) * future + waits
        without = before.elapsed + life_ms(coef, before, prefill_rows) * future[:n] + waits_before
        return LifeTimes(with_new, without, intervals * budget, intervals > 0, intervals, waits)

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
        """How many more streams like `typical` would be admitted now."""
        return typical_room(self.coefficients(charge_ms_per_stream), held, typical, self.budget_ms(), limit)


def search(fits: Callable[[int], bool], limit: int, hint: int = 1) -> int:
    """The largest k in [0, `limit`] with `fits(k)`, for `fits` true up to some k and false
    after: galloping from `hint` (up while it fits, down while not, each step twice the
    last), then halving. A hint that is the answer costs two probes."""
    if limit <= 0:
        return 0
    hint, step = min(max(hint, 1), limit), 1
    if fits(hint):  # lo fits, hi does not (or is past the limit)
        lo = hint
        while lo + step <= limit and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, limit + 1)
    else:
        hi = hint
        while hi - step >= 1 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(hi - step, 0)
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
        # `life_headroom`'s last count, where its search starts: a held set changes little
        # from one computation to the next (any start gives the same count)
        self._lives_hint = 1
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
        their lives so far and the prefills they wait for; `new_stall_ms`: the new
        prompt's prefill, of which each waits for its `new_stall_share`. An admitted one
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
    # judges it) and every typical one: each stream's life only grows with k (more
    # streams, and more rows queued ahead of the new prompt only add steps after anyone's
    # first frame). The worst step's count comes first (`typical_room`: one pass); the
    # lives are searched under it, from the last count (two projections while it holds).
    def life_headroom(self, pending: PendingPrefills, typical: HeldStream, limit: int) -> int:
        """How many prompts like `typical` `verdict` would admit one after another with
        the prefills `pending` (at most `limit`)."""
        admission, coef, charge = self.admission, self.model.prefill_coefficients, self.charge_ms_per_stream()
        budget = admission.budget_ms()
        charged = admission.coefficients(charge)
        first, _ = pending.lives(coef, typical, 0)
        n = len(first)

        room = typical_room(charged, first, typical, budget, limit)
        if not room:
            return 0
        lost = np.zeros(n, dtype=bool)
        if n:
            t = admission.life_times(first, typical, 0.0, 0.0, charge, budget)
            lost = t.judged[:n] & (t.without > t.allowed[:n])

        def lives_fit(k: int) -> bool:
            held, new_stall_ms = pending.lives(coef, typical, k - 1)
            if not admission.lives_matter(held, new_stall_ms):
                return True
            t = admission.life_times(held, typical, new_stall_ms, 0.0, charge, budget)
            broken = t.judged & (t.with_new > t.allowed)
            return not bool((broken[:n] & ~lost).any() or broken[n:].any())

        room = search(lives_fit, room, self._lives_hint)
        self._lives_hint = room
        return room

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
        last instead of a new projection over the held streams' lifetimes. The key is read
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
        prefill = self.model.prefill_coefficients  # a prefill-only step's price
        m.D_STEP_MODEL_MS.labels(term="prefill_base_ms").set(prefill.base_ms)
        m.D_STEP_MODEL_MS.labels(term="prefill_per_row_ms").set(prefill.per_row_ms)
        m.D_STEP_MODEL_MS.labels(term="prompt_rows_per_stream_ms").set(c.per_row_ms * self.rows_per_stream)
        m.D_STEP_MODEL_ERROR.set(self.model.under_prediction())
        feedback = self.admission.feedback
        m.D_RATE_FLOOR_FEEDBACK.set(feedback.factor if feedback is not None else 1.0)
        quantile = feedback.last_quantile if feedback is not None else None
        m.D_RATE_FLOOR_DELIVERED.set(quantile if quantile is not None else 0.0)
        return headroom


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
                                        "decode time, summed over spans of --floor-error-span consecutive steps, "
                                        "that shrinks the budget when above 1 (0.5: the model's typical error; 0.9: "
                                        "its bad tail)")
    floor_error_span: int = Field(ERROR_SPAN, ge=1, le=256, description="consecutive decode steps whose summed "
                                  "observed / predicted time --floor-error-quantile is taken over (a stream's rate "
                                  "sums its steps: one step's jitter averages out over its life; 1: single steps, "
                                  "as before 2026-12-07)")
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
    model = StepModel(seed, fixed=not cfg.step_model_refit, error_span=cfg.floor_error_span)
    feedback = (RateFeedback(floor_fps, cfg.floor_feedback_quantile, cfg.floor_feedback_margin)
                if cfg.floor_feedback_quantile > 0 and cfg.step_model_refit else None)
    return AdmissionControl(RateFloorAdmission(model, floor_fps, cfg.floor_margin, cfg.floor_error_quantile,
                                               feedback),
                            HeldStream(int(rows), int(frames)), seeded=bool(cfg.step_model),
                            cold_streams=cfg.cold_streams)
