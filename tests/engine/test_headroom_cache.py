"""D's (and the monolith's) headroom is computed at most once per step and change of the
held set (issue 24): Info probes between steps reuse it; a reservation, a commit, a failed
transfer, a cancelled stream or a step computes it again."""

from __future__ import annotations

import time

import pytest

from pdunit.engine.decode.admission import AdmissionControl, RateFloorAdmission
from pdunit.engine.decode.step_model import StepCoefficients, StepModel
from pdunit.engine.decode.stream_lives import HeldStream
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.proto import pdunit_pb2 as pb
from tests.engine.test_codec_serving import (
    ROWS,
    audio_rows,
    commit,
    decode_engine,
    job,
    model,
    monolith,
)

__all__ = ["model"]  # a pytest fixture, imported


def control() -> AdmissionControl:
    # 1 ms + 0.1 ms per stream; floor 10/s -> 90 ms: room for hundreds
    return AdmissionControl(RateFloorAdmission(StepModel(StepCoefficients(1.0, 0.1, 0.0)), 10.0),
                            HeldStream(ROWS, 8))


def test_export_for_computes_once_per_key() -> None:
    ctl = control()
    calls = []

    def held() -> list[tuple[int, ...]]:
        calls.append(1)
        return [(10, 10)]

    first = ctl.export_for((1, 0), held)
    assert [ctl.export_for((1, 0), held) for _ in range(5)] == [first] * 5
    assert ctl.headroom_computations == 1 and len(calls) == 1
    ctl.export_for((2, 0), held)
    assert ctl.headroom_computations == 2


def test_d_info_between_steps_does_not_recompute_headroom(model) -> None:
    d, _ = decode_engine(model, None)
    d.admission = ctl = control()
    base = d.info().headroom_streams
    n = ctl.headroom_computations
    for _ in range(20):
        assert d.info().headroom_streams == base
    assert ctl.headroom_computations == n  # 20 probes, no search

    reply = d.reserve(pb.ReserveRequest(request_id=9, n_tokens=ROWS, total_tokens=ROWS + 8,
                                        identity=pb.Identity(sender_instance="p")))
    assert reply.status == pb.STATUS_OK
    assert d.info().headroom_streams == base - 1 and ctl.headroom_computations == n + 1  # a reservation: again
    d.info()
    assert ctl.headroom_computations == n + 1
    d.cancel(9)  # the reservation fails: again
    assert d.info().headroom_streams == base and ctl.headroom_computations == n + 2

    assert commit(d, 1, audio_rows(1, 1)[0], audio=False, max_frames=8, min_frames=8).status == pb.STATUS_OK
    assert d.info().headroom_streams == base - 1
    after_commit = ctl.headroom_computations
    d.info()
    assert ctl.headroom_computations == after_commit
    assert d._step_once()  # a step: again
    d.info()
    d.info()
    assert ctl.headroom_computations == after_commit + 1
    d.cancel(1)  # a cancelled stream leaves at the next loop iteration, a step or not
    d._step_once()
    deadline = time.monotonic() + 5
    while len(d.batcher) and time.monotonic() < deadline:
        d._step_once()
    assert d.info().headroom_streams == base


def test_the_monolith_info_between_steps_does_not_recompute_headroom(model) -> None:
    e = monolith(model, None, "prefill-first", False)
    e.admission = ctl = control()
    base = e.info().headroom_streams
    n = ctl.headroom_computations
    for _ in range(10):
        e.info()
    assert ctl.headroom_computations == n
    replies: dict[int, pb.SubmitReply] = {}
    # the typical stream's rows: prefill-first's headroom prices the prefills of the typical
    # prompts it counts, so a different prompt would move it beyond the one stream it holds
    e.submit(job(1, ROWS, SamplingParams(max_frames=8, min_frames=8), replies))
    assert e.info().headroom_streams == base - 1 and ctl.headroom_computations == n + 1
    e.info()
    assert ctl.headroom_computations == n + 1
    for _ in range(50):
        e._step_once()
        if 1 in replies and not len(e.batcher):
            break
    assert e.info().headroom_streams == base


@pytest.mark.parametrize("probes", [50])
def test_probes_are_cheap_with_many_held_streams(model, probes: int) -> None:
    d, _ = decode_engine(model, None)
    d.admission = ctl = control()
    for rid in range(1, 41):
        assert d.reserve(pb.ReserveRequest(request_id=rid, n_tokens=ROWS, total_tokens=ROWS + 8,
                                           identity=pb.Identity(sender_instance="p"))).status == pb.STATUS_OK
    d.info()
    n = ctl.headroom_computations
    for _ in range(probes):
        d.info()
    assert ctl.headroom_computations == n
