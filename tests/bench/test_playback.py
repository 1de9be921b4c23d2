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
        play(np.array([]), 9, 21.0)


# ------------------------------------------------------------------ audio: seconds, not frames


def test_audio_gap_longer_than_the_buffer_is_a_stall():
    from pdunit.engine.playback import play_audio

    # 0.2 s chunks; the player starts once 0.4 s are in (t=0.1). Chunks 0-1 play 0.1-0.5,
    # chunk 2 arrives at 0.3 (plays 0.5-0.7); chunk 3 arrives 1.0, the buffer ran out at
    # 0.7: a 0.3 s stall; chunk 4 arrives 1.1, due at 1.2: on time.
    pb = play_audio(np.array([0.0, 0.1, 0.3, 1.0, 1.1]), np.full(5, 0.2), start_s=0.4)
    assert pb.start_s == pytest.approx(0.1)
    assert pb.stalls == 1 and pb.stall_s == pytest.approx(0.3) and pb.stutter


def test_audio_gap_shorter_than_the_buffer_is_no_stall():
    from pdunit.engine.playback import play_audio

    # 1 s buffered at t=0 then a 0.9 s gap: the player still had 0.1 s left.
    pb = play_audio(np.array([0.0, 0.0, 0.9, 1.0]), np.array([0.5, 0.5, 0.2, 0.2]), start_s=1.0)
    assert (pb.start_s, pb.stalls, pb.stall_s) == (0.0, 0, 0.0)


def test_audio_chunks_of_unequal_length_are_judged_by_their_seconds():
    from pdunit.engine.playback import play_audio

    # same arrivals, same total audio: a first chunk long enough covers the gap, a short one does not
    arrivals = np.array([0.0, 0.5, 0.6])
    assert play_audio(arrivals, np.array([0.6, 0.1, 0.1])).stalls == 0
    short = play_audio(arrivals, np.array([0.1, 0.6, 0.1]))
    assert short.stalls == 1 and short.stall_s == pytest.approx(0.4)


def test_audio_stream_shorter_than_the_start_buffer_starts_at_its_end_and_empty_chunks_are_ignored():
    from pdunit.engine.playback import play_audio

    pb = play_audio(np.array([0.1, 0.2, 5.0, 0.3]), np.array([0.05, 0.05, 0.0, 0.05]), start_s=1.0)
    assert (pb.start_s, pb.stalls) == (0.3, 0)
    with pytest.raises(ValueError):
        play_audio(np.array([0.0]), np.array([0.1, 0.1]))


def test_audio_player_equals_the_frame_player_for_one_frame_per_chunk():
    from pdunit.engine.playback import play_audio

    rng = np.random.default_rng(0)
    arrivals = np.sort(rng.uniform(0, 5, 80))
    frames = play(arrivals, start_frames=9, fps=21.0)
    audio = play_audio(arrivals, np.full(80, 1 / 21.0), start_s=9 / 21.0)
    assert (audio.start_s, audio.stalls) == (frames.start_s, frames.stalls)
    assert audio.stall_s == pytest.approx(frames.stall_s)
