"""PCM, WAV and SSE bytes as clients read them (`wave`, base64, JSON)."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path

import numpy as np
import pytest

from pdunit.engine.audio.pcm import (
    WavStream,
    float_to_pcm16,
    pcm16_to_float,
    sse_audio_delta,
    sse_audio_done,
    wav_header,
    write_wav,
)


def test_float_to_pcm16_is_little_endian_and_clips_out_of_range_samples() -> None:
    pcm = float_to_pcm16(np.array([0.0, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0, np.nan]))
    assert len(pcm) == 16
    assert np.frombuffer(pcm, "<i2").tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767, 0]
    assert pcm[2:4] == b"\x00\x40"  # 16384, low byte first


def test_pcm16_round_trips_within_one_step() -> None:
    x = np.linspace(-1, 1, 101, dtype=np.float32)
    assert np.abs(pcm16_to_float(float_to_pcm16(x)) - x).max() <= 0.5 / 32767 + 1e-7
    assert pcm16_to_float(b"\x00\x80").tolist() == [-1.0]  # -32768
    with pytest.raises(ValueError, match="even byte count"):
        pcm16_to_float(b"\x00\x01\x02")


def samples(n: int) -> np.ndarray:
    return np.sin(np.arange(n) / 7.0).astype(np.float32) * 0.8


def test_a_streamed_wav_of_unknown_length_parses_with_wave_to_its_end() -> None:
    stream = WavStream(24000)
    body = stream.header() + b"".join(stream.encode(samples(n)) for n in (1920, 3840, 3840))
    with wave.open(io.BytesIO(body)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        data = w.readframes(10**9)
    assert data == float_to_pcm16(np.concatenate([samples(1920), samples(3840), samples(3840)]))
    assert len(data) == 2 * 9600


def test_a_wav_of_known_length_has_the_exact_sizes_and_refuses_more_samples() -> None:
    stream = WavStream(800, n_samples=64)
    body = stream.header() + stream.encode(samples(64))
    with wave.open(io.BytesIO(body)) as w:
        assert w.getnframes() == 64
    assert body[4:8] == (36 + 128).to_bytes(4, "little")
    with pytest.raises(ValueError, match="declared 64 samples; 65 were written"):
        stream.encode(samples(1))


def test_write_wav_streams_then_patches_the_exact_length(tmp_path: Path) -> None:
    path = tmp_path / "out.wav"
    assert write_wav(path, 800, iter([samples(32), samples(64)])) == 96
    with wave.open(str(path)) as w:
        assert (w.getnframes(), w.getframerate()) == (96, 800)
    assert path.read_bytes()[:44] == wav_header(800, 96)


def test_sse_events_carry_base64_audio_and_the_done_usage() -> None:
    pcm = float_to_pcm16(samples(32))
    delta = sse_audio_delta(pcm)
    assert delta.startswith(b"data: ") and delta.endswith(b"\n\n")
    event = json.loads(delta[6:])
    assert event["type"] == "speech.audio.delta" and base64.b64decode(event["audio"]) == pcm
    done = json.loads(sse_audio_done(12, 30)[6:])
    assert done == {
        "type": "speech.audio.done",
        "usage": {"input_tokens": 12, "output_tokens": 30, "total_tokens": 42},
    }
