"""The streams an engine holds, as the rate-floor projection sees them: each stream's
context, frames left and life so far (`HeldStream`, `Lives`), the projected worst step
and time to each stream's last frame (`worst_step`, `life_ms`), the prefill-first
monolith's prefills they will wait for (`PendingPrefills`), and what a check answers
(`Verdict`, `LifeTimes`).

Must never hold the floor, a budget or any state: pure data and projections over a step
model, so a verdict and a headroom search read the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from pdunit.engine.decode.step_model import StepCoefficients


@dataclass(frozen=True)
class HeldStream:
    """A stream the engine holds: `context` tokens now (prompt + frames so far, or the
    prompt alone while reserved), `frames_left` steps to go (max frames less those out),
    and whether its frames are decoded to audio (the codec's per-audio-stream cost).

    Where the engine knows them (the prefill-first monolith), its life so far and the
    prefills it will wait for: `frames_out` (0: no frame out yet), `elapsed_ms` from its
    first frame's step to the engine's last published step, `stall_ms` of prefill-only
    steps already admitted that it will wait for, and the share of the new prompt's
    prefill that it would wait for too (`new_stall_share`, 0 to 1):
    `RateFloorAdmission.life_judge`."""

    context: int
    frames_left: int
    audio: bool = False
    frames_out: int = 0
    elapsed_ms: float = 0.0
    stall_ms: float = 0.0
    new_stall_share: float = 0.0


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
    new_share: np.ndarray

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
                   np.array([s.new_stall_share for s in streams], dtype=np.float64))

    @classmethod
    def repeat(cls, stream: HeldStream, k: int) -> Lives:
        """`k` streams like `stream`."""
        return cls(np.full(k, float(stream.context)), np.full(k, stream.frames_left, dtype=np.int64),
                   np.full(k, float(stream.audio)), np.full(k, float(stream.frames_out)),
                   np.full(k, stream.elapsed_ms), np.full(k, stream.stall_ms), np.full(k, stream.new_stall_share))

    @classmethod
    def join(cls, parts: Sequence[Lives]) -> Lives:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in (
            "context", "left", "audio", "out", "elapsed", "stall", "new_share")))

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


def typical_room(model: StepCoefficients, streams: Sequence[HeldStream] | Lives, typical: HeldStream,
                 budget_ms: float, limit: int) -> int:
    """The most streams like `typical` (at most `limit`) that can join `streams` with
    `worst_step` within `budget_ms`, in one pass: at each step `worst_step` checks (those
    of the held streams and the typical one's last) the projected step is linear in their
    count. `worst_step` itself then settles the count's last unit (rounding)."""
    lives = Lives.of(streams)
    left = lives.left
    ks = np.unique(np.concatenate([[0, max(typical.frames_left - 1, 0)], np.maximum(left - 1, 0)]))
    order = np.argsort(left)
    suffix_ctx = np.concatenate([np.cumsum(lives.context[order][::-1])[::-1], [0.0]])
    suffix_audio = np.concatenate([np.cumsum(lives.audio[order][::-1])[::-1], [0.0]])
    first_alive = np.searchsorted(left[order], ks, side="right")
    alive = len(left) - first_alive
    held_ms = (model.base_ms + model.per_stream_ms * alive + model.per_token_ms * (suffix_ctx[first_alive] + alive * ks)
               + model.per_audio_stream_ms * suffix_audio[first_alive])
    with_typical = typical.frames_left > ks
    per_typical = np.where(with_typical, model.per_stream_ms + model.per_token_ms * (typical.context + ks)
                           + model.per_audio_stream_ms * float(typical.audio), 0.0)
    judged = (alive > 0) | with_typical
    grows = judged & (per_typical > 0)
    room = limit
    if (judged & ~grows & (held_ms > budget_ms)).any():
        room = 0
    elif grows.any():
        room = int(np.clip(np.floor(np.min((budget_ms - held_ms[grows]) / per_typical[grows])), 0, limit))

    def fits(k: int) -> bool:
        return worst_step(model, Lives.join([lives, Lives.repeat(typical, k)]))[0] <= budget_ms

    while room < limit and fits(room + 1):
        room += 1
    while room > 0 and not fits(room):
        room -= 1
    return room


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
    unplanned ones, FIFO, the next steps of up to `step_rows` (a prompt's rows may span
    two), which a new prompt joins (its rows) or opens (each step it opens adds the
    step's base). `waiting_all` (decoding streams, prompts prefilled and about to run)
    wait for every step. A prompt waits for the steps after its own (`in_step`: every
    unplanned one), the new one's included: its first frame may go out as its own step
    ends (the overlap pipeline publishes it after the next step and decodes between
    prefill steps). With `first_frames_after_queue` (the plain loop: a prompt's first
    frame goes out with the first decode step after every queued prompt is prefilled)
    a prompt waits for none. The streams carry their lives so far, no stall: `held`
    prices it."""

    waiting_all: tuple[HeldStream, ...]
    in_step: tuple[HeldStream, ...]
    unplanned: tuple[HeldStream, ...]
    in_step_rows: int
    unplanned_rows: int
    step_rows: int
    first_frames_after_queue: bool = False

    def __len__(self) -> int:
        return len(self.waiting_all) + len(self.in_step) + len(self.unplanned)

    def held(self, coef: StepCoefficients, new_rows: int,
             queued: Sequence[HeldStream] = ()) -> tuple[list[HeldStream], float]:
        """The held streams with the stalls they will wait for, priced at `coef`'s
        prefill-only step (base + per-row term: StepModel.prefill_coefficients), and the
        stall the new prompt's prefill of `new_rows` adds (each stream waits for its `new_stall_share` of it); `queued`:
        prompts admitted after these (unplanned, their context their rows), last in the
        list."""
        stall, share, new_stall_ms = self.stalls(coef, new_rows, [q.context for q in queued])
        streams = [*self.waiting_all, *self.in_step, *self.unplanned, *queued]
        return [replace(s, stall_ms=float(a), new_stall_share=float(b))
                for s, a, b in zip(streams, stall, share, strict=True)], new_stall_ms

    def lives(self, coef: StepCoefficients, typical: HeldStream, queued: int) -> tuple[Lives, float]:
        """`held` for a new prompt like `typical` with `queued` of them queued, as arrays."""
        stall, share, new_stall_ms = self.stalls(coef, typical.context, [typical.context] * queued)
        lives = Lives.join([self._base_lives, Lives.repeat(typical, queued)])
        return replace(lives, stall=stall, new_share=share), new_stall_ms

    def stalls(self, coef: StepCoefficients, new_rows: int,
               queued_rows: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray, float]:
        """Per held stream, then per prompt of `queued_rows` queued after them: the stall
        of the prefill-only steps it will wait for and its share of the new prompt's; and
        the new prompt's stall (what `waiting_all` waits for more)."""
        limit = max(self.step_rows, 1)
        queued = np.asarray(queued_rows, dtype=np.int64)
        rows = self.unplanned_rows + int(queued.sum())

        def steps_from(first: np.ndarray | int, total: int) -> np.ndarray:
            """The unplanned steps from the `first`-th on (1: all) of `total` rows, priced."""
            steps = np.maximum(0, -(-total // limit) - (np.asarray(first) - 1))
            return steps * coef.base_ms + coef.per_row_ms * np.maximum(0, total - (np.asarray(first) - 1) * limit)

        # The first unplanned step each stream waits for: every one for `waiting_all` and
        # `in_step`; for a queued prompt the step after its last row's, found from the
        # back (a prompt after the first with rows left is all unplanned, FIFO; a cached
        # prefix counts too, so the step found is never later than its own).
        sizes = np.concatenate([np.array([u.context for u in self.unplanned], dtype=np.int64), queued])
        ends = rows - (np.cumsum(sizes[::-1])[::-1] - sizes)
        waiting, in_step = len(self.waiting_all), len(self.in_step)
        first = np.concatenate([np.ones(waiting + in_step, dtype=np.int64), np.maximum(1, -(-ends // limit) + 1)])
        stall, with_new = steps_from(first, rows), steps_from(first, rows + new_rows)
        if self.first_frames_after_queue:  # a prompt's first frame goes out after every queued prefill
            stall[waiting:] = with_new[waiting:] = 0.0
        new_stall_ms = float(steps_from(1, rows + new_rows) - steps_from(1, rows))
        share = (with_new - stall) / new_stall_ms if new_stall_ms > 0 else np.zeros(len(stall))
        if self.in_step_rows:  # the step under way: only `waiting_all` waits for it
            stall[:waiting] += coef.base_ms + coef.per_row_ms * self.in_step_rows
        return stall, share, new_stall_ms

    @cached_property
    def _base_lives(self) -> Lives:
        return Lives.of([*self.waiting_all, *self.in_step, *self.unplanned])


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
    # the prefill wait each was charged: the prefills known (the new prompt's included) or
    # the steady state's refills over its life, the larger
    charged_ms: np.ndarray
