"""The decode step's time model (ARCHITECTURE.md 4): step ms from the batch's streams,
context tokens, prefill rows and audio streams (`StepCoefficients`), seeded from a fit
file (`--step-model`, `load_step_model`) and refitted online from the engine's own steps
(`StepModel`), and the running window ratios an engine's charges are measured with.

Must never judge a stream or know the floor: it predicts and learns step times only, so
the projection (engine/decode/admission.py) and `pdunit bench` fit and read one model.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import asdict, dataclass, replace

import numpy as np

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
# predicted, over spans of ERROR_SPAN consecutive steps: a stream's rate sums its steps,
# so one step's jitter averages out over its life and a run of slow steps does not) is
# tracked. A prefill-only step (no stream decodes: the prefill-first monolith's) is no
# decode step: its own fit (`prefill_coefficients`, base + per row) prices the prefills
# streams will wait for, and it moves neither the decode fit nor the error. The codec
# term is fitted apart, from the codec stage's own time per step (`observe_codec`: least
# squares through 0 over the audio streams of each step that had some), and the other
# terms from the step's time less the codec's: the codec's time is measured, never
# guessed from the mix. With `fixed` (--no-step-model-refit) a
# fit file's own codec term is kept; one without it (0) still gets the measured term.
ERROR_SPAN = 16  # consecutive decode steps whose summed times under_prediction compares (--floor-error-span)
PREFILL_MIN_POINTS = 8  # prefill-only steps before their own fit prices them


class StepModel:
    """The engine's step-time model: a seed, then refits from observed steps.

    `observe(streams, context_tokens, ms, prefill_rows)` after every step; the model
    refits every `refit_every` observations over the last `window`, once it has
    `min_points` with at least two distinct batch sizes (a fit from one batch size
    cannot separate base from per-stream cost). Thread-safe."""

    def __init__(self, seed: StepCoefficients, window: int = 512, refit_every: int = 32,
                 min_points: int = 64, error_window: int = 256, fixed: bool = False,
                 error_span: int = ERROR_SPAN) -> None:
        if not 1 <= error_span <= error_window:
            raise ValueError(f"error span must be in [1, {error_window}] steps (got {error_span})")
        self._lock = threading.Lock()
        self.error_span = error_span
        # fixed (--no-step-model-refit): the seed is the model; observed steps feed the
        # error metric only, never a refit or the budget
        self.fixed = fixed
        self.coefficients = seed
        self.seed = seed
        self._points: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._errors: deque[tuple[float, float]] = deque(maxlen=error_window)  # (observed, predicted) ms
        # prefill-only steps: (rows, ms), and their fit (base, per row) once there is one
        self._prefill_points: deque[tuple[float, float]] = deque(maxlen=window)
        self._prefill_fit: tuple[float, float] | None = None
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

    @property
    def prefill_coefficients(self) -> StepCoefficients:
        """A prefill-only step's price (base_ms + per_row_ms x rows; the other terms 0):
        fitted from the engine's own prefill-only steps once it has `PREFILL_MIN_POINTS`
        of two or more sizes, else the decode model's base and per-row terms."""
        with self._lock:
            fit, coef = self._prefill_fit, self.coefficients
        base, per_row = fit if fit is not None else (coef.base_ms, coef.per_row_ms)
        return StepCoefficients(base, 0.0, 0.0, per_row)

    def observe(self, streams: int, context_tokens: int, ms: float, prefill_rows: int = 0) -> None:
        if streams <= 0 and prefill_rows <= 0:
            return
        with self._lock:
            if streams <= 0:
                if not self.fixed:
                    self._observe_prefill(float(prefill_rows), float(ms))
                return
            predicted = self.coefficients.ms(streams, context_tokens, prefill_rows)
            if predicted > 0:
                self._errors.append((float(ms), predicted))
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

    def _observe_prefill(self, rows: float, ms: float) -> None:
        """Under the lock: one prefill-only step; refits its base and per-row terms."""
        self._prefill_points.append((rows, ms))
        pts = np.array(self._prefill_points)
        if len(pts) < PREFILL_MIN_POINTS or len(np.unique(pts[:, 0])) < 2:
            return
        coef, _ = nonneg_fit(np.stack([np.ones(len(pts)), pts[:, 0]], axis=1), pts[:, 1])
        self._prefill_fit = (coef[0], coef[1])

    def under_prediction(self, quantile: float = 0.9) -> float:
        """The `quantile`, over every span of `error_span` consecutive recent decode steps,
        of their observed over their predicted time (1.0 until there are 16 steps): above
        1 the model under-predicts."""
        with self._lock:
            pairs = np.array(self._errors).reshape(-1, 2)
        if len(pairs) < 16:
            return 1.0
        span = min(self.error_span, len(pairs))
        sums = np.vstack([np.zeros((1, 2)), np.cumsum(pairs, axis=0)])
        spans = sums[span:] - sums[:-span]
        return float(np.quantile(spans[:, 0] / spans[:, 1], quantile))


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


def load_step_model(path: str) -> StepCoefficients:
    """`--step-model FILE`: a fit file as `pdunit bench step` writes it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--step-model {path}: {exc.strerror or exc}") from exc
    return StepCoefficients.from_json(text, f"--step-model {path}")
