"""Admission's feedback from delivered rates (engine/decode/rate_feedback.py): the rates
streams actually got, over the floor, shrink the budget admission judges with when a low
quantile of them falls under 1 + margin and relax it when it is comfortably above; a
stream set the step model alone admits is refused once the delivered rates were under
the floor (the engines feed it every published step: the monolith's test below)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from pdunit.engine import metrics as m
from pdunit.engine.decode.admission import (
    AdmissionControl,
    AdmissionFields,
    RateFloorAdmission,
    build_admission,
)
from pdunit.engine.decode.hub import FrameHub
from pdunit.engine.decode.rate_feedback import LIVE_EVERY_NS, LIVE_MIN_S, MIN_FACTOR, RateFeedback
from pdunit.engine.decode.step_model import StepCoefficients, StepModel
from pdunit.engine.decode.stream_lives import HeldStream
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.monolith.main import MonolithConfig
from pdunit.engine.monolith.worker import MonolithEngine
from pdunit.engine.prefill.scheduler import PrefillJob
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.settings import parse_config
from pdunit.engine.step_pad import StepPad

FLOOR = 40.0  # frames/s
S = 1_000_000_000  # ns


@dataclass
class Delivered:
    """A stream as the engines hand it over: its frames out and its first/last frame's stamps."""

    request_id: int
    frames_out: int
    stamps: dict[str, int] = field(default_factory=dict)


def ended(rid: int, rate_ratio: float, first_ns: int, frames: int = 81) -> Delivered:
    """A stream of `frames` that delivered `rate_ratio` x the floor from `first_ns`."""
    span = int((frames - 1) / (FLOOR * rate_ratio) * S)
    return Delivered(rid, frames, {"first_frame_step": first_ns, "last_frame_step": first_ns + span})


def live(rid: int, rate_ratio: float, first_ns: int, now_ns: int) -> Delivered:
    """A running stream that has delivered `rate_ratio` x the floor since `first_ns`."""
    frames = 1 + int(round(FLOOR * rate_ratio * (now_ns - first_ns) / S))
    return Delivered(rid, frames, {"first_frame_step": first_ns})


def end_all(fb: RateFeedback, streams: list[Delivered]) -> None:
    """Each stream ends on its own step (its last frame's time is `now`)."""
    for s in streams:
        fb.observe([s], list, s.stamps["last_frame_step"])


def test_a_window_of_slow_streams_shrinks_the_factor_by_their_shortfall() -> None:
    fb = RateFeedback(FLOOR, quantile=0.05, margin=0.02, min_streams=16)
    end_all(fb, [ended(i, 0.9, first_ns=i * S // 10) for i in range(15)])
    assert fb.factor == 1.0 and fb.last_quantile is None  # fewer than min_streams: not judged
    end_all(fb, [ended(15, 0.9, first_ns=2 * S)])
    assert fb.factor == pytest.approx(0.9 / 1.02, rel=1e-3) and fb.changes == 1
    # a huge shortfall is taken at most halfway at once
    fb2 = RateFeedback(FLOOR, min_streams=4)
    end_all(fb2, [ended(i, 0.2, first_ns=0) for i in range(4)])
    assert fb2.factor == pytest.approx(0.5)


def test_streams_at_the_floor_plus_margin_change_nothing() -> None:
    fb = RateFeedback(FLOOR, quantile=0.05, margin=0.02, min_streams=16, relax=0.05)
    rates = np.linspace(1.03, 1.07, 40)  # above 1.02, never above 1.02 x 1.05 at the 5th percentile
    end_all(fb, [ended(i, r, first_ns=i * S) for i, r in enumerate(rates)])
    assert fb.factor == 1.0 and fb.changes == 0 and 1.02 < (fb.last_quantile or 0) < 1.02 * 1.05


def test_the_low_quantile_decides_not_the_typical_stream() -> None:
    """Most streams fast, a few slow: the 5th percentile (the slow ones) shrinks it."""
    fb = RateFeedback(FLOOR, quantile=0.05, min_streams=16)
    rates = [1.5] * 36 + [0.8] * 4
    end_all(fb, [ended(i, r, first_ns=0) for i, r in enumerate(rates)])
    assert fb.factor < 1.0


def test_streams_that_began_before_a_change_do_not_count_after_it() -> None:
    """A change starts an epoch: streams whose first frame was before it met the old
    budget's crowd and are not judged again (else one slow cohort would shrink the budget
    once per stream end)."""
    fb = RateFeedback(FLOOR, min_streams=4)
    end_all(fb, [ended(i, 0.9, first_ns=0) for i in range(4)])
    shrunk = fb.factor
    change_ns = ended(3, 0.9, first_ns=0).stamps["last_frame_step"]
    # the rest of the same slow cohort ends afterwards: ignored
    end_all(fb, [ended(10 + i, 0.9, first_ns=S // 10) for i in range(20)])
    assert fb.factor == shrunk and fb.changes == 1
    # slow streams that began after the change do count
    end_all(fb, [ended(100 + i, 0.9, first_ns=change_ns + 1) for i in range(4)])
    assert fb.factor < shrunk and fb.changes == 2


def test_fast_streams_relax_it_slowly_up_to_one() -> None:
    fb = RateFeedback(FLOOR, min_streams=4, relax=0.05)
    end_all(fb, [ended(i, 0.6, first_ns=0) for i in range(4)])
    assert fb.factor == pytest.approx(0.6 / 1.02, rel=1e-3)
    factors = [fb.factor]
    t, rid = 100 * S, 1000
    while fb.factor < 1.0 and len(factors) < 50:
        batch = [ended(rid + i, 1.5, first_ns=t) for i in range(4)]
        end_all(fb, batch)
        rid, t = rid + 4, t + 10 * S
        factors.append(fb.factor)
    # each step up is 5% at most, and it ends at 1, never above
    steps = np.array(factors[1:]) / np.array(factors[:-1])
    assert (steps <= 1.05 + 1e-9).all() and (steps > 1).all(), factors
    assert fb.factor == 1.0 and len(factors) > 5
    end_all(fb, [ended(rid + i, 2.0, first_ns=t) for i in range(8)])
    assert fb.factor == 1.0


def test_live_streams_shrink_it_before_they_end_but_never_relax_it() -> None:
    fb = RateFeedback(FLOOR, min_streams=4)
    now = 10 * S
    slow = [live(i, 0.7, first_ns=now - 2 * S, now_ns=now) for i in range(4)]
    young = [live(10 + i, 0.1, first_ns=now - S // 2, now_ns=now) for i in range(4)]
    fb.observe([], lambda: young, now)  # under LIVE_MIN_S of life: not judged yet
    assert fb.factor == 1.0
    fb.observe([], lambda: slow + young, now + LIVE_EVERY_NS)
    assert fb.factor < 1.0
    shrunk = fb.factor
    # live fast streams alone, however many, never relax it: a live rate may still fall
    later = now + 10 * S
    fast = [live(100 + i, 2.0, first_ns=later - 3 * S, now_ns=later) for i in range(20)]
    for k in range(5):
        fb.observe([], lambda: fast, later + k * LIVE_EVERY_NS)
    assert fb.factor == shrunk
    # the running streams are asked for only every LIVE_EVERY_NS
    asked = []
    fb.observe([], lambda: asked.append(1) or [], later + 5 * LIVE_EVERY_NS)
    fb.observe([], lambda: asked.append(1) or [], later + 5 * LIVE_EVERY_NS + 1)
    assert asked == [1]
    assert LIVE_MIN_S >= 0.5  # a live rate over fewer frames than that says more about one step


def test_the_factor_never_falls_under_its_floor() -> None:
    fb = RateFeedback(FLOOR, min_streams=2)
    t = 0
    for k in range(20):
        end_all(fb, [ended(2 * k + i, 0.1, first_ns=t) for i in range(2)])
        t += 100 * S
    assert fb.factor == MIN_FACTOR


def test_short_streams_and_streams_without_stamps_are_not_judged() -> None:
    fb = RateFeedback(FLOOR, min_streams=1)
    fb.observe([Delivered(1, 1, {"first_frame_step": 0, "last_frame_step": S}),  # one frame: no rate
                Delivered(2, 40, {})], list, S)  # never published (no stamps)
    assert fb.last_quantile is None and fb.factor == 1.0


def test_bad_settings_are_refused_naming_them() -> None:
    for kwargs, says in ((dict(floor_fps=0), "rate floor"), (dict(floor_fps=1, quantile=0), "quantile"),
                         (dict(floor_fps=1, quantile=1), "quantile"), (dict(floor_fps=1, margin=1), "margin")):
        with pytest.raises(ValueError, match=says):
            RateFeedback(**kwargs)


def test_a_change_is_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    fb = RateFeedback(FLOOR, min_streams=2)
    with caplog.at_level(logging.INFO, logger="pdunit.decode.rate_feedback"):
        end_all(fb, [ended(i, 0.8, first_ns=0) for i in range(2)])
    (rec,) = [r for r in caplog.records if "budget factor" in r.getMessage()]
    assert rec.levelno == logging.INFO and rec.factor < rec.factor_before == 1.0  # type: ignore[attr-defined]


# ---------------------------------------------------------------- in admission and the monolith
class ExactModel(StepModel):
    """10 ms a stream, never refitted and never said to under-predict: the verdicts below
    rest on the seed and the delivered rates alone."""

    def __init__(self) -> None:
        super().__init__(StepCoefficients(base_ms=0.0, per_stream_ms=10.0, per_token_ms=0.0), refit_every=1 << 30)

    def under_prediction(self, quantile: float = 0.9) -> float:
        return 1.0


MONO_FLOOR = 20.0  # frames/s: a 50-ms budget at margin 0, five of the model's 10-ms streams
ROWS, FRAMES = 16, 6


def test_the_feedback_shrinks_the_budget_admission_judges_with() -> None:
    feedback = RateFeedback(MONO_FLOOR, min_streams=4)
    adm = RateFloorAdmission(ExactModel(), floor_fps=MONO_FLOOR, margin=0.0, feedback=feedback)
    control = AdmissionControl(adm, HeldStream(ROWS, FRAMES))
    held = [(ROWS, FRAMES)] * 4
    assert control.judge(held, ROWS, FRAMES).admit  # 5 x 10 ms = the 50-ms budget
    # four streams that delivered 16 frames/s: 0.8 of the floor
    control.observe_delivery([ended(i, 0.8 * MONO_FLOOR / FLOOR, first_ns=0) for i in range(4)], list)
    assert feedback.factor == pytest.approx(0.8 / 1.02, rel=1e-3)
    verdict = control.judge(held, ROWS, FRAMES)
    assert not verdict.admit and verdict.budget_ms == pytest.approx(50 * 0.8 / 1.02, rel=1e-3), verdict
    assert control.judge([], ROWS, FRAMES).admit  # an idle engine still admits one
    # what "even alone" is judged against does not move: a shrunk budget delays, never rejects
    assert adm.alone_fits(HeldStream(ROWS, FRAMES)).budget_ms == pytest.approx(50.0)
    control.export(held)
    assert m.D_RATE_FLOOR_FEEDBACK._value.get() == pytest.approx(feedback.factor)
    assert m.D_RATE_FLOOR_DELIVERED._value.get() == pytest.approx(feedback.last_quantile)


def test_flags_turn_it_on_by_default_off_with_quantile_zero_and_with_a_fixed_model(tmp_path) -> None:
    fit = tmp_path / "fit.json"
    fit.write_text(StepCoefficients(1.0, 1.0, 0.0).to_json())
    on = build_admission(AdmissionFields(rate_floor=42), on_gpu=False)
    assert on is not None and on.admission.feedback is not None
    assert on.admission.feedback.quantile == 0.05 and on.admission.feedback.target == pytest.approx(1.02)
    tuned = build_admission(AdmissionFields(rate_floor=42, floor_feedback_quantile=0.1, floor_feedback_margin=0.05),
                            on_gpu=False)
    assert tuned is not None and tuned.admission.feedback is not None
    assert tuned.admission.feedback.quantile == 0.1 and tuned.admission.feedback.target == pytest.approx(1.05)
    off = build_admission(AdmissionFields(rate_floor=42, floor_feedback_quantile=0), on_gpu=False)
    assert off is not None and off.admission.feedback is None
    off.observe_delivery([ended(1, 0.5, first_ns=0)], list)  # nothing to feed: no error
    # --no-step-model-refit: the fit file as it is, no shrink of any kind
    fixed = build_admission(AdmissionFields(rate_floor=42, step_model=str(fit), step_model_refit=False), on_gpu=False)
    assert fixed is not None and fixed.admission.feedback is None
    assert parse_config(MonolithConfig, ["--floor-feedback-quantile", "0"], "test").floor_feedback_quantile == 0


def test_the_monolith_refuses_what_its_model_admits_once_its_streams_ran_under_the_floor() -> None:
    """The monolith's steps take 60 ms (the pad) where its model says 10 ms a stream: its
    streams deliver under 16.7 frames/s against a floor of 20. After four of them ended, a
    fifth beside four held is refused, which the model alone (5 x 10 = the 50-ms budget)
    admits."""
    loop = asyncio.new_event_loop()
    try:
        model = load_model("random:tiny:0", device="cpu")
        feedback = RateFeedback(MONO_FLOOR, min_streams=4)
        admission = AdmissionControl(RateFloorAdmission(ExactModel(), floor_fps=MONO_FLOOR, margin=0.0,
                                                        feedback=feedback), HeldStream(ROWS, FRAMES))
        engine = MonolithEngine(model, "random:tiny:0", PagePool(1024, 1), model.new_kv_storage(1024),
                                FrameHub(loop), "prefill-first", chunk_tokens=256, max_batch=8,
                                max_batch_rows=4096, admission=admission)
        engine.step_pad = StepPad(60.0, 0.0)
        held = [(ROWS, FRAMES)] * 4
        assert admission.judge(held, ROWS, FRAMES).admit
        replies: dict[int, pb.SubmitReply] = {}
        for rid in range(1, 5):
            prompt = np.random.default_rng(rid).integers(0, 100, size=(ROWS, 11), dtype=np.int64)
            engine.submit(PrefillJob(rid, prompt, SamplingParams(max_frames=FRAMES, min_frames=FRAMES),
                                     int(time.time() * 1000) + 60_000, {},
                                     done=lambda reply, rid=rid: replies.__setitem__(rid, reply)))
        for _ in range(4 * FRAMES):
            if not engine._step_once() and not len(engine.batcher):
                break
        assert {r.status for r in replies.values()} == {pb.STATUS_OK} and len(replies) == 4, replies
        assert feedback.factor < 0.85 and feedback.last_quantile is not None and feedback.last_quantile < 0.85
        assert not admission.judge(held, ROWS, FRAMES).admit
    finally:
        loop.close()
