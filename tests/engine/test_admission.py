"""Rate-floor admission on synthetic step models (engine/decode/admission.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pdunit.engine.decode.admission import (
    AdmissionControl,
    AdmissionFields,
    RateFloorAdmission,
    build_admission,
    search,
)
from pdunit.engine.decode.step_model import StepCoefficients, StepModel
from pdunit.engine.decode.stream_lives import HeldStream, typical_room, worst_step


def brute_worst(coef: StepCoefficients, streams: list[HeldStream]) -> float:
    horizon = max(s.frames_left for s in streams)
    best = 0.0
    for k in range(horizon):
        alive = [s for s in streams if s.frames_left > k]
        if alive:
            best = max(best, coef.ms(len(alive), sum(s.context + k for s in alive)))
    return best


def test_worst_step_equals_a_step_by_step_projection() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        coef = StepCoefficients(*rng.uniform(0, 2, 3))
        streams = [HeldStream(int(rng.integers(1, 400)), int(rng.integers(1, 120)))
                   for _ in range(int(rng.integers(1, 12)))]
        got, _ = worst_step(coef, streams)
        assert got == pytest.approx(brute_worst(coef, streams))


def test_refuses_when_growth_crosses_the_budget_later_not_only_now() -> None:
    # 1 ms per 100 context tokens; floor 50 frames/s -> 20 ms, margin 0 -> budget 20 ms.
    coef = StepCoefficients(base_ms=0.0, per_stream_ms=0.0, per_token_ms=0.01)
    adm = RateFloorAdmission(StepModel(coef), floor_fps=50.0, margin=0.0)
    held = [HeldStream(context=900, frames_left=1000)]  # 9 ms now, grows 0.01 ms per step
    new = HeldStream(context=100, frames_left=1000)
    # Now: (900 + 100) * 0.01 = 10 ms: fits. At step 500: (1400 + 600) * 0.01 = 20 ms; later more.
    assert coef.ms(2, 1000) <= adm.budget_ms()
    v = adm.judge(held, new)
    assert not v.admit and v.at_step > 0 and v.worst_ms > v.budget_ms
    # The same stream with a short life never crosses it.
    assert adm.judge(held, HeldStream(context=100, frames_left=50)).admit


def test_reserved_streams_count_like_decoding_ones() -> None:
    coef = StepCoefficients(base_ms=1.0, per_stream_ms=1.0, per_token_ms=0.0)
    adm = RateFloorAdmission(StepModel(coef), floor_fps=100.0, margin=0.0)  # budget 10 ms
    decoding = [HeldStream(10, 100)] * 5
    reserved = [HeldStream(10, 100)] * 4  # not committed yet: they will decode too
    new = HeldStream(10, 100)
    assert adm.judge(decoding, new).admit                 # 1 + 6 = 7 ms
    assert not adm.judge(decoding + reserved, new).admit  # 1 + 10 = 11 ms
    assert adm.judge(decoding + reserved[:3], new).admit  # 1 + 9 = 10 ms: at the budget fits


def test_the_margin_is_taken_off_the_budget() -> None:
    coef = StepCoefficients(base_ms=0.0, per_stream_ms=1.0, per_token_ms=0.0)
    plain = RateFloorAdmission(StepModel(coef), floor_fps=50.0, margin=0.0)    # 20 ms
    margined = RateFloorAdmission(StepModel(coef), floor_fps=50.0, margin=0.10)  # 18 ms
    held = [HeldStream(1, 10)] * 18
    assert plain.judge(held, HeldStream(1, 10)).admit        # 19 streams = 19 ms
    assert not margined.judge(held, HeldStream(1, 10)).admit
    assert margined.budget_ms() == pytest.approx(18.0)
    assert plain.headroom(held, HeldStream(1, 10)) == 2
    assert margined.headroom(held, HeldStream(1, 10)) == 0


def test_headroom_is_the_number_of_typical_streams_still_admitted() -> None:
    coef = StepCoefficients(base_ms=2.0, per_stream_ms=0.5, per_token_ms=0.0)
    adm = RateFloorAdmission(StepModel(coef), floor_fps=40.0, margin=0.0)  # 25 ms -> 46 streams
    typical = HeldStream(100, 200)
    assert adm.headroom([], typical) == 46
    assert adm.headroom([typical] * 40, typical) == 6
    k = adm.headroom([typical] * 10, typical)
    assert adm.judge([typical] * (10 + k - 1), typical).admit
    assert not adm.judge([typical] * (10 + k), typical).admit


def test_the_worst_steps_count_in_one_pass_is_what_adding_streams_one_by_one_finds() -> None:
    """`typical_room` (headroom's count by the worst step: linear in the typical streams
    at each step the projection checks) against adding typical streams one at a time
    until `worst_step` breaks the budget, on random held sets, models and budgets, at
    and off the boundary."""
    rng = np.random.default_rng(33)
    for _ in range(300):
        coef = StepCoefficients(*(float(rng.choice([0.0, rng.uniform(0, hi)])) for hi in (10, 1, 0.01, 0.1, 0.5)))
        held = [HeldStream(int(rng.integers(1, 2000)), int(rng.integers(0, 300)), bool(rng.integers(0, 2)))
                for _ in range(int(rng.integers(0, 40)))]
        typical = HeldStream(int(rng.integers(1, 2000)), int(rng.integers(0, 300)), bool(rng.integers(0, 2)))
        limit = int(rng.integers(0, 200))
        # a budget just at some count's worst step (the boundary's rounding), or anywhere
        at = worst_step(coef, held + [typical] * int(rng.integers(0, 60)))[0]
        budget = at if rng.integers(0, 2) else float(rng.uniform(0, 80))
        want = 0
        while want < limit and worst_step(coef, held + [typical] * (want + 1))[0] <= budget:
            want += 1
        assert typical_room(coef, held, typical, budget, limit) == want, (coef, held, typical, budget, limit)


def test_the_search_from_any_hint_finds_the_same_count_and_two_probes_confirm_a_right_one() -> None:
    """`search` gallops from its hint (the last count): from any hint it finds the largest
    k that fits, and a hint that is the count costs two probes (it fits, one more does
    not), where a search from 1 costs about twice log2 of the count."""
    rng = np.random.default_rng(24)
    for _ in range(2000):
        limit, count = int(rng.integers(0, 5000)), int(rng.integers(0, 6000))
        probes: list[int] = []

        def fits(k: int, count: int = count, limit: int = limit, probes: list[int] = probes) -> bool:
            assert 1 <= k <= limit
            probes.append(k)
            return k <= count

        want = min(count, max(limit, 0))
        assert search(fits, limit, int(rng.integers(-3, 7000))) == want
        probes.clear()
        assert search(fits, limit, want) == want
        assert len(probes) <= 2
    calls: list[int] = []
    assert search(lambda k: calls.append(k) is None and k <= 1000, 4096) == 1000 and len(calls) >= 20


def test_step_model_refits_to_the_engines_own_steps() -> None:
    truth = StepCoefficients(base_ms=3.0, per_stream_ms=0.05, per_token_ms=0.0004)
    model = StepModel(StepCoefficients(1.0, 0.01, 0.0001), refit_every=16, min_points=32)
    rng = np.random.default_rng(0)
    for _ in range(256):
        b = int(rng.integers(1, 256))
        tokens = b * int(rng.integers(500, 3000))
        model.observe(b, tokens, truth.ms(b, tokens) * float(rng.uniform(0.99, 1.01)))
    c = model.coefficients
    assert model.fits > 0
    assert c.base_ms == pytest.approx(3.0, rel=0.1)
    assert c.per_stream_ms == pytest.approx(0.05, rel=0.2)
    assert c.per_token_ms == pytest.approx(0.0004, rel=0.05)


def test_one_batch_size_never_replaces_the_seed() -> None:
    seed = StepCoefficients(1.0, 0.1, 0.0)
    model = StepModel(seed, refit_every=8, min_points=16)
    for _ in range(64):
        model.observe(8, 800, 5.0)
    assert model.coefficients == seed


def test_an_under_predicting_model_shrinks_the_budget() -> None:
    coef = StepCoefficients(base_ms=0.0, per_stream_ms=1.0, per_token_ms=0.0)
    model = StepModel(coef, refit_every=10_000)  # keep the seed: only the error moves
    adm = RateFloorAdmission(model, floor_fps=50.0, margin=0.0)
    assert adm.budget_ms() == pytest.approx(20.0)
    for _ in range(64):
        model.observe(10, 0, 15.0)  # predicted 10 ms, observed 15: 1.5x under
    assert model.under_prediction() == pytest.approx(1.5)
    assert adm.budget_ms() == pytest.approx(20.0 / 1.5)
    assert not adm.judge([HeldStream(1, 10)] * 14, HeldStream(1, 10)).admit


def test_step_jitter_a_stream_averages_out_does_not_shrink_the_budget_a_slow_run_does(tmp_path) -> None:
    """A stream's rate sums its steps: decode steps alternately 30% faster and slower
    than predicted keep the budget whole (the p90 of single steps says 1.3 and took a
    quarter of it), while a run of slow steps, a few spans long, still shrinks it."""
    coef = StepCoefficients(base_ms=0.0, per_stream_ms=1.0, per_token_ms=0.0)
    model = StepModel(coef, refit_every=10_000)
    adm = RateFloorAdmission(model, floor_fps=50.0, margin=0.0)
    for i in range(256):
        model.observe(10, 0, 13.0 if i % 2 else 7.0)
    assert model.under_prediction() == pytest.approx(1.0)
    assert adm.budget_ms() == pytest.approx(20.0)
    for _ in range(48):  # 48 steps at 1.5x: every span inside the run says 1.5
        model.observe(10, 0, 15.0)
    assert model.under_prediction() > 1.4
    assert adm.budget_ms() < 20.0 / 1.4
    # --floor-error-span 1: single steps, as before (the A/B's other side)
    fit = tmp_path / "fit.json"
    fit.write_text(coef.to_json())
    single = build_admission(AdmissionFields(rate_floor=50, floor_margin=0, floor_error_span=1, step_model=str(fit)),
                             False)
    assert single is not None and single.model.error_span == 1
    for i in range(256):
        single.model.observe(10, 0, 13.0 if i % 2 else 7.0)
    assert single.model.under_prediction() == pytest.approx(1.3)
    with pytest.raises(ValueError, match="floor_error_span"):
        AdmissionFields(floor_error_span=0)


def test_prefill_only_steps_are_priced_by_their_own_fit_and_leave_the_decode_fit_alone() -> None:
    """The prefill-first monolith's prefill-only steps (no stream decodes) cost what the
    prompt's forward costs, not the decode step's base: fitted apart, they price the
    stalls streams will wait for, and the decode fit and its error see decode steps only."""
    decode = StepCoefficients(base_ms=8.0, per_stream_ms=0.02, per_token_ms=1e-5)
    model = StepModel(StepCoefficients(1.0, 0.01, 0.0), refit_every=16, min_points=32)
    assert model.prefill_coefficients == StepCoefficients(1.0, 0.0, 0.0, 0.0)  # before any: the decode base
    rng = np.random.default_rng(1)
    for i in range(400):
        if i % 4 == 0:  # a prompt's forward: 4 ms + 6 us a row
            rows = int(rng.integers(1000, 2000))
            model.observe(0, 0, 4.0 + 0.006 * rows, prefill_rows=rows)
        else:
            b = int(rng.integers(16, 256))
            tokens = b * int(rng.integers(1000, 2500))
            model.observe(b, tokens, decode.ms(b, tokens))
    c, p = model.coefficients, model.prefill_coefficients
    assert (c.base_ms, c.per_stream_ms, c.per_token_ms, c.per_row_ms) == pytest.approx((8.0, 0.02, 1e-5, 0.0), rel=1e-3)
    assert (p.base_ms, p.per_row_ms, p.per_stream_ms, p.per_token_ms) == pytest.approx((4.0, 0.006, 0.0, 0.0), rel=1e-3)
    assert model.under_prediction() == pytest.approx(1.0, rel=1e-3)


def test_a_fixed_model_keeps_its_seed_and_its_budget_whatever_the_steps_take(tmp_path) -> None:
    """--no-step-model-refit: neither a refit nor an under-predicting model moves the
    verdicts (the same steps as the two tests above move a refitting model)."""
    seed = StepCoefficients(base_ms=0.0, per_stream_ms=1.0, per_token_ms=0.0)
    model = StepModel(seed, refit_every=8, min_points=16, fixed=True)
    adm = RateFloorAdmission(model, floor_fps=50.0, margin=0.0)
    for b in (2, 4, 8, 16) * 32:
        model.observe(b, 0, 3.0 * b)  # three times the seed's prediction, four batch sizes
    assert model.coefficients == seed and model.fits == 0
    assert model.under_prediction() == pytest.approx(3.0)  # still measured, for the metric
    assert adm.budget_ms() == pytest.approx(20.0)
    assert adm.judge([HeldStream(1, 10)] * 18, HeldStream(1, 10)).admit
    fit = tmp_path / "fit.json"
    fit.write_text(seed.to_json())
    fixed = build_admission(AdmissionFields(rate_floor=50, step_model=str(fit), step_model_refit=False), True)
    assert fixed is not None and fixed.admission.model.fixed
    with pytest.raises(ValueError, match="--no-step-model-refit needs --step-model"):
        build_admission(AdmissionFields(rate_floor=50, step_model_refit=False), True)


def test_even_alone_blames_the_request_only_when_a_smaller_one_would_fit() -> None:
    """A stream too long for the floor on its own is the request's fault (a 4xx); a model
    whose every step is over the budget (an engine refitted to slow eager steps) is the
    engine's: `engine_bound`, answered as a refusal to retry, not a 422."""
    long_streams = RateFloorAdmission(StepModel(StepCoefficients(1.0, 1.0, 0.01)), floor_fps=50.0, margin=0.0)
    v = long_streams.alone_fits(HeldStream(1500, 420))
    assert not v.admit and not v.engine_bound
    assert long_streams.alone_fits(HeldStream(10, 10)).admit
    slow_engine = RateFloorAdmission(StepModel(StepCoefficients(26.0, 0.006, 0.0)), floor_fps=42.0, margin=0.1)
    v = slow_engine.alone_fits(HeldStream(1500, 420))
    assert not v.admit and v.engine_bound
    assert not slow_engine.judge([], HeldStream(1500, 420)).admit


def test_fit_files_name_the_bad_field() -> None:
    good = StepCoefficients(1.0, 0.1, 0.001)
    assert StepCoefficients.from_json(good.to_json()) == good
    with pytest.raises(ValueError, match="per_token_ms is missing"):
        StepCoefficients.from_json('{"base_ms": 1, "per_stream_ms": 0.1}', "fit.json")
    with pytest.raises(ValueError, match="base_ms must be a finite number"):
        StepCoefficients.from_json('{"base_ms": -1, "per_stream_ms": 0.1, "per_token_ms": 0}')
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['slope'\]"):
        StepCoefficients.from_json('{"base_ms": 1, "per_stream_ms": 0.1, "per_token_ms": 0, "slope": 2}')
    with pytest.raises(ValueError, match="not JSON"):
        StepCoefficients.from_json("{", "fit.json")


def test_a_floor_or_margin_out_of_range_is_refused() -> None:
    model = StepModel(StepCoefficients(1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="rate floor"):
        RateFloorAdmission(model, floor_fps=0.0)
    with pytest.raises(ValueError, match="margin"):
        RateFloorAdmission(model, floor_fps=42.0, margin=1.0)


def test_without_a_fit_file_the_model_is_trusted_for_twice_its_widest_step() -> None:
    ctl = AdmissionControl(RateFloorAdmission(StepModel(StepCoefficients(0.0, 0.0, 0.0)), 42.0),
                           HeldStream(10, 10), seeded=False, cold_streams=2)
    held = [(10, 10)] * 2
    v = ctl.judge(held, 10, 10)
    assert not v.admit and v.cold and "at most 2 streams" in v.reason()
    assert ctl.headroom(held[:1]) == 1
    ctl.observe(3, 30, 1.0)  # a step of three streams was seen: six may be held
    assert ctl.trusted_streams() == 6
    assert ctl.judge([(10, 10)] * 5, 10, 10).admit
    assert not ctl.judge([(10, 10)] * 6, 10, 10).admit
    seeded = AdmissionControl(RateFloorAdmission(StepModel(StepCoefficients(0.0, 0.0, 0.0)), 42.0),
                              HeldStream(10, 10), seeded=True, cold_streams=2)
    assert seeded.judge([(10, 10)] * 50, 10, 10).admit  # a fit file vouches for any batch


def test_alone_is_judged_against_the_nominal_budget_not_the_shrunk_one() -> None:
    model = StepModel(StepCoefficients(base_ms=0.0, per_stream_ms=15.0, per_token_ms=0.0), refit_every=10_000)
    adm = RateFloorAdmission(model, floor_fps=50.0, margin=0.0)  # nominal 20 ms
    for _ in range(64):
        model.observe(1, 0, 30.0)  # 2x under-predicted: the budget shrinks to 10 ms
    assert adm.budget_ms() == pytest.approx(10.0)
    assert adm.alone_fits(HeldStream(1, 10)).admit          # 15 ms alone: servable (a retry, not a 4xx)
    assert not adm.judge([], HeldStream(1, 10)).admit       # the projection alone would not admit it now


def test_an_engine_holding_nothing_admits_one_stream_whatever_its_model_says() -> None:
    """Liveness: an idle engine takes no steps, so a budget shrunk below one stream's step
    (a burst of slow steps) would refuse every retry forever. Empty, it admits one stream
    (its steps refit the model); holding one, the projection decides again."""
    model = StepModel(StepCoefficients(base_ms=0.0, per_stream_ms=15.0, per_token_ms=0.0), refit_every=10_000)
    ctl = AdmissionControl(RateFloorAdmission(model, floor_fps=50.0, margin=0.0), HeldStream(1, 10))
    for _ in range(64):
        model.observe(1, 0, 30.0)  # the budget shrinks to 10 ms: one 15-ms stream is over it
    v = ctl.judge([], 1, 10)
    assert v.admit and v.idle and v.worst_ms > v.budget_ms
    assert ctl.headroom([]) == 1  # what /v1/load and the router see for an idle engine
    held = ctl.judge([(1, 10)], 1, 10)
    assert not held.admit and not held.idle
    assert ctl.headroom([(1, 10)]) == 0


def test_a_stream_between_take_incoming_and_running_still_counts_as_held() -> None:
    from types import SimpleNamespace

    from pdunit.engine.decode.batcher import DecodeBatcher, Stream
    from pdunit.engine.model.sampling import SamplingParams

    b = DecodeBatcher(SimpleNamespace(), None, None, max_batch=4)  # type: ignore[arg-type]
    s = Stream(7, prompt_tokens=100, params=SamplingParams(max_frames=50), last_frame=np.zeros(2, np.int32),
               frames_out=1)
    b.admit(s)
    assert b.lifetimes() == [(101, 49)]
    assert b.take_incoming() == [s]
    assert b.lifetimes() == [(101, 49)]  # the step that takes it in is still running: it is held
    b.running[s.request_id] = s
    b.joined()
    assert b.lifetimes() == [(101, 49)]  # once, not twice


def test_the_stall_and_row_windows_keep_running_sums_equal_to_their_pairs_resummed() -> None:
    """observe_stall / observe_rows keep running sums over their last 256 decode steps (the
    evicted step subtracted): after each of 700 steps the sums equal the window's pairs
    re-summed, and each per-stream figure is the last 256 steps' amounts over their streams;
    once the window holds only steps without a stall, the stall reads 0 exactly."""
    ctl = AdmissionControl(RateFloorAdmission(StepModel(StepCoefficients(10.0, 1.0, 0.0)), 42.0), HeldStream(1, 10))
    rng = np.random.default_rng(7)
    steps: list[tuple[float, int, int]] = []
    for i in range(700):
        stall, rows, streams = float(rng.uniform(0, 90)), int(rng.integers(0, 200)), int(rng.integers(1, 9))
        steps.append((stall, rows, streams))
        ctl.observe_stall(stall, streams)
        ctl.observe_rows(rows, streams)
        last = steps[-256:]
        for window in (ctl._stalls, ctl._row_loads):
            assert len(window.pairs) == len(last), i
            assert window.amount == sum(a for a, _ in window.pairs), i
            assert window.streams == sum(n for _, _, n in last) == sum(n for _, n in window.pairs), i
        assert ctl.stall_ms_per_stream == pytest.approx(sum(s for s, _, _ in last) / sum(n for _, _, n in last))
        assert ctl.rows_per_stream == sum(r for _, r, _ in last) / sum(n for _, _, n in last)
    for _ in range(256):
        ctl.observe_stall(0.0, 1)
    assert ctl.stall_ms_per_stream == 0.0
