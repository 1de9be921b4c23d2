"""The playback model and per-stream timing, checked against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from pdunit.engine.playback import play, stream_rate, stream_timing, worst_window


def test_stalls_are_counted_each_time_the_buffer_runs_dry():
    # 2 frames/s (0.5 s per frame). Start after 2 frames: at t=0.
    # Frames 0,1,2 play at 0, 0.5, 1.0; frame 3 is due at 1.5, arrives 2.0: stall 0.5 s.
    # Frame 4 is due at 2.5 (arrived 2.1): on time. Frame 5 due at 3.0, arrives 5.0: stall 2.0 s.
    pb = play(np.array([0.0, 0.0, 0.0, 2.0, 2.1, 5.0]), start_frames=2, fps=2.0)
    assert pb.start_s == 0.0
    assert pb.stalls == 2
    assert pb.stall_s == pytest.approx(2.5)
    assert pb.stutter


def test_a_stream_that_keeps_ahead_of_the_player_never_stalls():
    arrivals = np.arange(100) / 50.0  # 50 frames/s into a 21 frames/s player
    pb = play(arrivals, start_frames=9, fps=21.0)
    assert (pb.start_s, pb.stalls, pb.stall_s, pb.stutter) == (8 / 50.0, 0, 0.0, False)


def test_exactly_realtime_arrivals_after_the_start_buffer_do_not_stall():
    # Frames arrive exactly when they are due: the buffer touches empty but never waits.
    fps = 21.0
    start = 0.4
    arrivals = np.concatenate([np.full(9, start), start + np.arange(1, 200) / fps + 8 / fps])
    arrivals = np.sort(arrivals)
    assert play(arrivals, 9, fps).stalls == 0


def test_slower_than_realtime_stalls_on_every_frame_once_the_start_buffer_is_spent():
    # 15 frames/s into a 21 frames/s player that starts at frame 8 (t = 8/15).
    # Without stalls frame k would play at 8/15 + k/21; it arrives at k/15, late once
    # k (1/15 - 1/21) > 8/15, i.e. from k = 29 on: frames 29..59 stall, 31 stalls.
    # After the last one the player is at 59/15 instead of 8/15 + 59/21.
    pb = play(np.arange(60) / 15.0, start_frames=9, fps=21.0)
    assert pb.start_s == pytest.approx(8 / 15)
    assert pb.stalls == 31
    assert pb.stall_s == pytest.approx(59 / 15 - 8 / 15 - 59 / 21)


def test_player_waits_for_all_frames_of_a_stream_shorter_than_the_start_buffer():
    pb = play(np.array([0.1, 0.2, 0.3]), start_frames=9, fps=21.0)
    assert pb.start_s == 0.3 and pb.stalls == 0


def test_rate_is_frames_per_second_from_first_to_last_frame():
    assert stream_rate(np.array([1.0, 1.5, 2.0, 3.0])) == pytest.approx(1.5)
    assert stream_rate(np.array([1.0])) is None


def test_worst_window_finds_the_gap():
    # 40 frames/s for 2 s, a 0.6 s gap, then 40 frames/s for 2 s.
    first = np.arange(80) / 40.0
    second = first[-1] + 0.6 + np.arange(80) / 40.0
    arr = np.concatenate([first, second])
    # Worst 1 s window: just before the first frame after the gap: 0.4 s of frames = 16 frames.
    assert worst_window(arr) == pytest.approx(16.0)
    assert worst_window(np.arange(10) / 40.0) is None  # shorter than a second


def test_stream_timing_collects_ttft_ttfa_and_playback():
    arrivals = 0.2 + np.arange(30) / 50.0
    t = stream_timing(arrivals, start_frames=9, fps=21.0)
    assert t.frames == 30
    assert t.ttft_s == pytest.approx(0.2)
    assert t.ttfa_s == pytest.approx(0.2 + 8 / 50.0)
    assert t.rate == pytest.approx(50.0)
    assert not t.playback.stutter


def test_no_frames_is_an_error_not_a_silent_zero():
    with pytest.raises(ValueError):
        play(np.array([]))
