"""The LB plays every stream at the frame rate D's Hello names (the codec's, else the
model config's, else 21), not at a fixed 21: a CSM stream (12.5 Hz) that keeps real time
does not stutter; GET /v1/model and pdunit_lb_frame_rate_hz show the rate and the floor
(2x it) the load generator and the alerts read."""

from __future__ import annotations

from typing import Any

import pytest

from pdunit.engine.lb.streams import Stream
from tests.lb.conftest import RunningLB, wait_until

FRAMES, ARRIVAL_FPS, FIRST_S = 45, 15.0, 0.05


def stream_at(fps: float, frames: int = FRAMES) -> Stream:
    """A finished stream whose frames the LB wrote one by one at `fps`, the first FIRST_S
    after it received the request."""
    s = Stream(request_id=1, stamps={"lb_received": 1_000_000_000})
    s.frame_out_ns = [1_000_000_000 + round((FIRST_S + k / fps) * 1e9) for k in range(frames)]
    s.frame_out_counts = [1] * frames
    return s


def played(r: RunningLB) -> tuple[dict[str, Any], float]:
    """The LB's playback of a 15-frames/s stream: its log fields and the stutter count."""
    extra: dict[str, Any] = {}
    r.lb._observe_playback(stream_at(ARRIVAL_FPS), extra)
    return extra, r.lb.registry.get_sample_value("pdunit_lb_stutter_streams_total") or 0.0


def test_a_csm_stream_is_played_at_its_12_5_hz_and_the_same_arrivals_stutter_at_21(start_lb, fake_unit):
    fake_unit.decode.frame_rate_hz = 12.5
    csm = start_lb()
    with csm.client() as c:
        doc = c.get("/v1/model").json()
    assert (doc["frame_rate_hz"], doc["rate_floor_fps"]) == (12.5, 25.0)
    assert csm.lb.registry.get_sample_value("pdunit_lb_frame_rate_hz") == 12.5
    extra, stutters = played(csm)
    # 15 frames/s outruns a 12.5-Hz player: no stall; TTFA is the 9th frame's arrival
    assert stutters == 0 and "stalls" not in extra
    assert extra["ttfa_ms"] == pytest.approx((FIRST_S + 8 / ARRIVAL_FPS) * 1000, abs=1e-3)
    assert extra["rate_fps"] == pytest.approx(ARRIVAL_FPS)
    # the rate histogram has edges at CSM's real time and floor: the stream lies between them
    bucket = csm.lb.registry.get_sample_value
    assert bucket("pdunit_lb_stream_rate_frames_per_second_bucket", {"le": "12.5"}) == 0.0
    assert bucket("pdunit_lb_stream_rate_frames_per_second_bucket", {"le": "25.0"}) == 1.0

    fake_unit.decode.frame_rate_hz = 21.0
    pdunit = start_lb()
    with pdunit.client() as c:
        assert c.get("/v1/model").json()["rate_floor_fps"] == 42.0
    extra, stutters = played(pdunit)
    # a 21-Hz player drains the buffer of 15-frames/s arrivals: it stalls
    assert stutters == 1 and extra["stalls"] > 0


def test_a_decode_older_than_the_field_is_played_at_21(start_lb, fake_unit):
    fake_unit.decode.frame_rate_hz = 0.0  # proto3's unset double
    r = start_lb()
    with r.client() as c:
        doc = c.get("/v1/model").json()
    assert (doc["frame_rate_hz"], doc["rate_floor_fps"]) == (21.0, 42.0)
    assert r.lb.registry.get_sample_value("pdunit_lb_frame_rate_hz") == 21.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -12.5])
def test_a_hello_with_an_impossible_frame_rate_leaves_the_lb_unready_naming_the_field(start_lb, fake_unit,
                                                                                       bad: float):
    """What a peer on D's socket that is not a sane D gets for a frame rate no codec has
    (NaN, infinite, negative): no playback judged at it, the LB unready
    with the field named, never a rate that divides the player's clock into nonsense."""
    fake_unit.decode.frame_rate_hz = bad
    r = start_lb(wait_ready=False)
    with r.client() as c:
        wait_until(lambda: "frame_rate_hz" in r.lb.config_error, what="the LB's refusal of the Hello")
        assert c.get("/readyz").status_code != 200
    assert r.lb.frame_rate_hz is None
    extra: dict[str, Any] = {}
    r.lb._observe_playback(stream_at(ARRIVAL_FPS), extra)
    assert extra == {}
