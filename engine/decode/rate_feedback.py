"""Feedback from the rates an engine delivered to the budget its admission judges with.

Owns the budget factor (`RateFeedback.factor`, in (0, 1]) from each stream's delivered
rate over the floor (the loadgen's `rate`: frames after the first over the time since
it): a low quantile of recent streams' under 1 + margin shrinks it, one comfortably above
relaxes it slowly. The step model predicts steps; this measures the promise itself.

Must never refuse, admit or block anything: it only scales the budget RateFloorAdmission
judges with; the caller's liveness rule (an idle engine admits one) holds whatever it is.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

log = logging.getLogger("pdunit.decode.rate_feedback")

# A live stream counts once it has delivered frames over at least this long: a rate over
# a few frames says more about one step than about the stream.
LIVE_MIN_S = 1.0
# How often the live streams are looked at (their rate so far), in ns of the engine's clock.
LIVE_EVERY_NS = 250_000_000
MIN_FACTOR = 0.25  # the budget is never shrunk below this share of the nominal one
MAX_SHRINK = 0.5  # one shrink takes at most half the budget


class DeliveringStream(Protocol):
    """What the feedback reads of a stream (engine/decode/batcher.py's Stream): its id,
    frames out so far and the stamps of its first (and, once ended, last) frame's step."""

    request_id: int
    frames_out: int
    stamps: dict[str, int]


# The controller works in epochs: a change of the factor starts a new one, and only
# streams whose first frame went out after the change count in it (older ones met the
# old budget's crowd). In an epoch, once `min_streams` streams count:
# - the `quantile` of their delivered rate / floor (ended streams: over their life; live
#   ones: so far, once LIVE_MIN_S old) under 1 + `margin` shrinks the factor by that
#   quantile / (1 + margin) (at most MAX_SHRINK at once, never below MIN_FACTOR): the
#   step's share the slow ones lacked;
# - the quantile above (1 + margin) x (1 + `relax`), with `min_streams` of them ended
#   (a live rate may still fall), relaxes it by 1 + `relax`, up to 1: after the step up
#   the quantile is still expected above 1 + margin, so a relax does not undo itself.
# Each epoch holds the last `window` streams.
class RateFeedback:
    """The budget factor from delivered rates (the comment above). Thread-safe."""

    def __init__(self, floor_fps: float, quantile: float = 0.05, margin: float = 0.02, window: int = 256,
                 min_streams: int = 8, relax: float = 0.05) -> None:
        if floor_fps <= 0:
            raise ValueError(f"rate floor must be > 0 frames/s (got {floor_fps})")
        if not 0 < quantile < 1:
            raise ValueError(f"floor feedback quantile must be in (0, 1) (got {quantile})")
        if not 0 <= margin < 1:
            raise ValueError(f"floor feedback margin must be in [0, 1) (got {margin})")
        self.floor_fps = floor_fps
        self.quantile = quantile
        self.target = 1.0 + margin
        self.window = window
        self.min_streams = min_streams
        self.relax = relax
        self.factor = 1.0
        self.last_quantile: float | None = None  # the quantile last judged (None: none yet)
        self.changes = 0
        self._lock = threading.Lock()
        self._epoch_ns = 0  # streams whose first frame is before it do not count
        self._ratios: OrderedDict[int, tuple[float, bool]] = OrderedDict()  # stream -> (rate / floor, ended)
        self._live_at_ns = 0  # when live streams were last looked at

    def ratio(self, frames: int, first_ns: int, last_ns: int) -> float | None:
        """A stream's rate over the floor: frames after the first over the time since it
        (None under 2 frames; a stream of 2+ frames in no time is infinitely fast)."""
        if frames < 2:
            return None
        span = (last_ns - first_ns) / 1e9
        return float("inf") if span <= 0 else (frames - 1) / span / self.floor_fps

    def observe(self, ended: Iterable[DeliveringStream], running: Callable[[], Iterable[DeliveringStream]],
                now_ns: int) -> None:
        """After a step is published (its stamps set): the streams it ended, and, every
        LIVE_EVERY_NS, the running ones (`running()`, called only then)."""
        with self._lock:
            for s in ended:
                first, last = s.stamps.get("first_frame_step"), s.stamps.get("last_frame_step")
                if first is None or last is None or first < self._epoch_ns:
                    continue
                r = self.ratio(s.frames_out, first, last)
                if r is not None:
                    self._put(s.request_id, r, ended=True)
            if now_ns - self._live_at_ns >= LIVE_EVERY_NS:
                self._live_at_ns = now_ns
                for s in running():
                    first = s.stamps.get("first_frame_step")
                    if first is None or first < self._epoch_ns or now_ns - first < LIVE_MIN_S * 1e9:
                        continue
                    r = self.ratio(s.frames_out, first, now_ns)
                    if r is not None:
                        self._put(s.request_id, r, ended=False)
            self._judge(now_ns)

    def _put(self, key: int, ratio: float, ended: bool) -> None:
        """Under the lock."""
        self._ratios[key] = (ratio, ended)
        self._ratios.move_to_end(key)
        while len(self._ratios) > self.window:
            self._ratios.popitem(last=False)

    def _judge(self, now_ns: int) -> None:
        """Under the lock: a change of the factor, if the epoch's streams call for one."""
        if len(self._ratios) < self.min_streams:
            return
        values = [r for r, _ in self._ratios.values()]
        q = float(np.quantile(values, self.quantile))
        self.last_quantile = q
        before = self.factor
        if q < self.target:
            self.factor = max(MIN_FACTOR, before * max(MAX_SHRINK, q / self.target))
        elif (q > self.target * (1 + self.relax) and before < 1.0
              and sum(e for _, e in self._ratios.values()) >= self.min_streams):
            self.factor = min(1.0, before * (1 + self.relax))
        if self.factor == before:
            return
        self.changes += 1
        self._epoch_ns = now_ns
        streams = len(values)
        self._ratios.clear()
        log.info("rate floor feedback: budget factor changed", extra={
            "factor_before": round(before, 4), "factor": round(self.factor, 4),
            "delivered_quantile": round(q, 4), "quantile": self.quantile, "target": round(self.target, 4),
            "streams": streams})
