"""The codec's cost in rate-floor admission (issue 26.4): the step model's per-audio-stream
term (fitted from the codec stage's own time per step, or read from a fit file; a file
without it reads as 0), projected for the audio streams held, so that an engine decoding
audio refuses earlier than one decoding frames only; D and the monolith observe it."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from pdunit.engine.audio.codec_stage import CodecStage, StepCost
from pdunit.engine.decode.admission import AdmissionControl, RateFloorAdmission
from pdunit.engine.decode.step_model import StepCoefficients, StepModel
from pdunit.engine.decode.stream_lives import HeldStream, worst_step
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.proto import pdunit_pb2 as pb
from tests.engine.test_codec_serving import (
    audio_rows,
    codec,
    commit,
    decode_engine,
    job,
    model,
    monolith,
)

__all__ = ["codec", "model"]  # pytest fixtures, imported


def test_a_fit_file_without_the_codec_term_reads_as_zero_and_one_with_it_is_kept() -> None:
    old = StepCoefficients.from_json(json.dumps({"base_ms": 3.2, "per_stream_ms": 0.006, "per_token_ms": 3e-5}))
    assert old.per_audio_stream_ms == 0.0 and old.per_row_ms == 0.0
    new = StepCoefficients.from_json(old.to_json().replace('"per_audio_stream_ms": 0.0', '"per_audio_stream_ms": 0.02'))
    assert new.per_audio_stream_ms == 0.02
    with pytest.raises(ValueError, match="per_audio_stream_ms must be a finite number"):
        StepCoefficients.from_json(json.dumps({"base_ms": 1, "per_stream_ms": 0, "per_token_ms": 0,
                                               "per_audio_stream_ms": -1}))


def brute_worst(coef: StepCoefficients, streams: list[HeldStream]) -> float:
    best = 0.0
    for k in range(max(s.frames_left for s in streams)):
        alive = [s for s in streams if s.frames_left > k]
        best = max(best, coef.ms(len(alive), sum(s.context + k for s in alive), 0,
                                 sum(s.audio for s in alive)))
    return best


def test_the_projection_counts_the_audio_streams_alive_at_each_step() -> None:
    rng = np.random.default_rng(5)
    for _ in range(50):
        coef = StepCoefficients(*rng.uniform(0, 2, 3), 0.0, float(rng.uniform(0, 3)))
        streams = [HeldStream(int(rng.integers(1, 300)), int(rng.integers(1, 100)), bool(rng.integers(0, 2)))
                   for _ in range(int(rng.integers(1, 12)))]
        assert worst_step(coef, streams)[0] == pytest.approx(brute_worst(coef, streams))


def test_admission_refuses_earlier_with_the_codec_term() -> None:
    # 1 ms + 1 ms per stream + 1 ms per audio stream; floor 100/s, margin 0 -> 10 ms
    coef = StepCoefficients(base_ms=1.0, per_stream_ms=1.0, per_token_ms=0.0, per_audio_stream_ms=1.0)
    ctl = AdmissionControl(RateFloorAdmission(StepModel(coef), floor_fps=100.0, margin=0.0), HeldStream(10, 100))
    frames = [(10, 100, False)] * 4
    audio = [(10, 100, True)] * 4
    assert ctl.judge(frames, 10, 100).admit                     # 1 + 5 = 6 ms
    assert not ctl.judge(audio, 10, 100, audio=True).admit      # 1 + 5 + 5 = 11 ms
    assert ctl.judge(audio, 10, 100).admit                      # 1 + 5 + 4 = 10 ms: a frames stream still fits
    # the same mix without the term admits the audio stream
    plain = AdmissionControl(RateFloorAdmission(StepModel(StepCoefficients(1.0, 1.0, 0.0)), 100.0, 0.0),
                             HeldStream(10, 100))
    assert plain.judge(audio, 10, 100, audio=True).admit
    # headroom in audio streams is smaller than in frames streams
    frames_room = AdmissionControl(RateFloorAdmission(StepModel(coef), 100.0, 0.0), HeldStream(10, 100))
    audio_room = AdmissionControl(RateFloorAdmission(StepModel(coef), 100.0, 0.0), HeldStream(10, 100, True))
    assert frames_room.headroom([]) == 9 and audio_room.headroom([]) == 4


def test_the_codec_term_is_fitted_from_the_codecs_own_time_and_the_rest_from_the_step() -> None:
    truth = StepCoefficients(base_ms=2.0, per_stream_ms=0.5, per_token_ms=0.001, per_audio_stream_ms=0.25)
    model = StepModel(StepCoefficients(0.0, 0.0, 0.0), refit_every=8, min_points=16)
    ctl = AdmissionControl(RateFloorAdmission(model, 10.0), HeldStream(10, 10), seeded=False)
    rng = np.random.default_rng(0)
    for _ in range(256):
        n = int(rng.integers(1, 64))
        a = int(rng.integers(0, n + 1))
        tokens = n * 500
        codec_ms = truth.per_audio_stream_ms * a
        ctl.observe(n, tokens, truth.ms(n, tokens, 0, a), codec=StepCost(codec_ms / 1000, a))
    c = model.coefficients
    assert c.per_audio_stream_ms == pytest.approx(0.25, rel=1e-6)
    assert c.base_ms == pytest.approx(2.0, rel=1e-3) and c.per_stream_ms + 500 * c.per_token_ms == pytest.approx(1.0)
    assert model.under_prediction() == pytest.approx(1.0, rel=1e-3)


def test_a_fixed_model_keeps_its_files_codec_term_and_measures_one_it_lacks() -> None:
    with_term = StepModel(StepCoefficients(1.0, 0.1, 0.0, 0.0, 0.5), fixed=True)
    with_term.observe_codec(10, 20.0)
    assert with_term.coefficients.per_audio_stream_ms == 0.5
    without = StepModel(StepCoefficients(1.0, 0.1, 0.0), fixed=True)
    without.observe_codec(10, 20.0)
    assert without.coefficients.per_audio_stream_ms == pytest.approx(2.0)
    assert without.coefficients.base_ms == 1.0  # the rest of the file stays as it is


class Recording(AdmissionControl):
    def __init__(self) -> None:
        super().__init__(RateFloorAdmission(StepModel(StepCoefficients(0.0, 0.0, 0.0)), 1.0), HeldStream(12, 8))
        self.costs: list[StepCost] = []

    def observe(self, streams, context_tokens, ms, prefill_rows=0, codec=None) -> None:  # type: ignore[override]
        if codec is not None:
            self.costs.append(codec)
        super().observe(streams, context_tokens, ms, prefill_rows, codec=codec)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_d_observes_its_codec_cost_per_step(model, codec, overlap: bool) -> None:
    d, _ = decode_engine(model, codec, overlap)
    d.admission = rec = Recording()
    first = audio_rows(1, 1)[0]
    assert commit(d, 1, first, audio=True, max_frames=8, min_frames=8).status == pb.STATUS_OK
    assert commit(d, 2, audio_rows(2, 1)[0], audio=False, max_frames=8, min_frames=8).status == pb.STATUS_OK
    for _ in range(40):
        if not d._step_once() and not len(d.batcher):
            break
    assert rec.costs and all(c.audio_streams == 1 for c in rec.costs)  # the audio stream, not the frames one
    assert sum(c.seconds for c in rec.costs) > 0
    assert rec.model.coefficients.per_audio_stream_ms > 0
    # a reservation counts as audio when D has a codec (RESERVE does not say)
    assert all(h[2] for h in d._lifetimes()) or not d._lifetimes()


def test_the_monolith_observes_its_codec_cost_and_judges_audio_as_audio(model, codec) -> None:
    e = monolith(model, codec, "prefill-first", False)
    e.admission = rec = Recording()
    replies: dict[int, pb.SubmitReply] = {}
    e.submit(job(1, 20, SamplingParams(max_frames=8, min_frames=8, temperature=1.0, seed=1), replies, audio=True))
    e.submit(job(2, 9, SamplingParams(max_frames=6, min_frames=6, temperature=1.0, seed=2), replies))
    assert sorted(h[2] for h in e._lifetimes()) == [False, True]
    for _ in range(100):
        e._step_once()
        if len(replies) == 2 and not len(e.batcher):
            break
    assert all(r.status == pb.STATUS_OK for r in replies.values()), replies
    assert rec.costs and {c.audio_streams for c in rec.costs} == {1}
    assert rec.model.coefficients.per_audio_stream_ms > 0


def test_the_codec_stage_reports_its_cost(model, codec) -> None:
    stage = CodecStage.for_model(codec, model)
    stage.open(7)

    class Out:
        request_ids = np.array([7, 8], dtype=np.uint64)
        frames = audio_rows(3, 2).astype(np.int32)
        finished = np.zeros(2, dtype=np.uint8)

    t0 = time.perf_counter()
    chunks, _, cost = stage.step_costed(Out())
    assert len(chunks) == 1 and cost.audio_streams == 1 and 0 < cost.seconds <= time.perf_counter() - t0
    stage.drop([7])
