"""What a listener hears: per-stream timing and the playback model of BENCHMARKS.md section 1.

Frames (`play`, `stream_timing`): each frame's arrival time (s since the request was
sent); the player starts once `start_frames` are in (TTFA) and plays `fps` a second.
Audio (`play_audio`): each chunk's arrival and its seconds of PCM (samples / rate); the
player starts once `start_s` seconds are in. Either way a stall is each time the buffer
runs empty before the stream ended (the player waits, then plays on); a stream that
stalls once "stutters". Also the rate and the worst 1-second window, and the frames'
real-time rate a unit plays at (`real_time_fps`). Pure; no I/O. Never assumes a frame
rate: every caller passes the model's, so a 12.5-Hz codec is not judged at 21.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Frames a second of real-time audio when neither the codec nor the model's config names
# a rate: the `pdunit` family's 21 Hz.
DEFAULT_FPS = 21.0
# The rate floor is this many times real time (BENCHMARKS.md's capacity rule): the
# margin that absorbs a burst.
FLOOR_X_REAL_TIME = 2.0
# Arrival times come from one clock; a frame on time to within a microsecond is on time.
_EPS = 1e-6


@dataclass(frozen=True)
class Playback:
    start_s: float  # when the player starts (TTFA)
    stalls: int
    stall_s: float  # total time the player waited on an empty buffer

    @property
    def stutter(self) -> bool:
        return self.stalls > 0


def real_time_fps(codec_hz: float | None, model_hz: float | None) -> float:
    """The frames' real-time rate: the loaded codec's frame rate, else the one the model's
    config names (CSM's codec_config), else DEFAULT_FPS."""
    return float(codec_hz or model_hz or DEFAULT_FPS)


def play(arrivals: np.ndarray, start_frames: int, fps: float) -> Playback:
    """Replay a stream through the player.

    Frame k starts playing at T_k = max(T_{k-1} + 1/fps, arrival_k), T_0 = start. So
    T_k - k/fps = max(start, max_{j<=k}(arrival_j - j/fps)), and frame k stalls exactly
    when arrival_k - k/fps exceeds that running maximum over j < k.
    """
    arr = np.asarray(arrivals, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("a stream without frames has no playback")
    start = float(arr[min(start_frames, arr.size) - 1])
    lateness = arr - np.arange(arr.size) / fps
    running = np.maximum.accumulate(np.concatenate(([start], lateness)))[:-1]
    late = lateness - running
    stalled = late > _EPS
    return Playback(start_s=start, stalls=int(stalled.sum()), stall_s=float(late[stalled].sum()))


def play_audio(arrivals: np.ndarray, seconds: np.ndarray, start_s: float = 0.0) -> Playback:
    """Replay a stream of audio chunks: chunk k arrives at `arrivals[k]` holding
    `seconds[k]` of audio. The player starts when `start_s` seconds of audio are in (the
    last arrival when the stream holds less) and plays in real time; chunk k plays at
    T_k = max(T_{k-1} + seconds_{k-1}, arrival_k): with D_k the audio before chunk k,
    T_k - D_k = max(start, max_{j<=k}(arrival_j - D_j)), and chunk k stalls (the buffer of
    received audio ran empty) exactly when arrival_k - D_k exceeds that maximum over j < k.
    """
    arr = np.asarray(arrivals, dtype=np.float64)
    dur = np.asarray(seconds, dtype=np.float64)
    if arr.size == 0 or arr.shape != dur.shape:
        raise ValueError(f"{arr.size} arrivals for {dur.size} chunk durations: need one each, at least one")
    if (dur < 0).any():
        raise ValueError("a chunk cannot hold negative seconds of audio")
    if (dur > 0).any():  # an empty chunk holds nothing to wait for
        arr, dur = arr[dur > 0], dur[dur > 0]
    before = np.concatenate(([0.0], np.cumsum(dur)[:-1]))  # audio received before chunk k
    # the first chunk after which `start_s` seconds are in (a tolerance for float sums)
    ready = int(np.searchsorted(before + dur, start_s - _EPS, side="left"))
    start = float(arr[min(ready, arr.size - 1)])
    lateness = arr - before
    running = np.maximum.accumulate(np.concatenate(([start], lateness)))[:-1]
    late = lateness - running
    stalled = late > _EPS
    return Playback(start_s=start, stalls=int(stalled.sum()), stall_s=float(late[stalled].sum()))


def stream_rate(arrivals: np.ndarray) -> float | None:
    """Frames per second from the first to the last frame; None below 2 frames."""
    arr = np.asarray(arrivals, dtype=np.float64)
    if arr.size < 2:
        return None
    span = float(arr[-1] - arr[0])
    return float("inf") if span <= 0 else (arr.size - 1) / span


def worst_window(arrivals: np.ndarray, window_s: float = 1.0) -> float | None:
    """Fewest frames received in any `window_s` window inside the stream, per second.

    The count of frames in [t - window, t) over t in [first + window, last] is lowest
    just before an arrival, so only those instants are checked. None when the stream
    is shorter than one window.
    """
    arr = np.asarray(arrivals, dtype=np.float64)
    if arr.size < 2 or arr[-1] - arr[0] < window_s:
        return None
    ends = arr[arr >= arr[0] + window_s]
    counts = np.searchsorted(arr, ends, side="left") - np.searchsorted(
        arr, ends - window_s, side="left"
    )
    return float(counts.min()) / window_s


@dataclass(frozen=True)
class StreamTiming:
    frames: int
    ttft_s: float
    ttfa_s: float
    rate: float | None
    worst_window: float | None
    playback: Playback


def stream_timing(arrivals: np.ndarray, start_frames: int, fps: float) -> StreamTiming:
    arr = np.asarray(arrivals, dtype=np.float64)
    pb = play(arr, start_frames, fps)
    return StreamTiming(
        frames=int(arr.size),
        ttft_s=float(arr[0]),
        ttfa_s=pb.start_s,
        rate=stream_rate(arr),
        worst_window=worst_window(arr),
        playback=pb,
    )
