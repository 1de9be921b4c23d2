"""Audio bytes on the wire: 16-bit PCM, streamed WAV, and OpenAI's speech SSE events.

Owns the sample format (float in [-1, 1] <-> signed 16-bit little-endian mono), the WAV
header (exact lengths when known, the streaming convention 0xFFFFFFFF when not) and the
`speech.audio.delta` / `speech.audio.done` events. It must never resample or mix
(the codec's sample rate is the stream's) and never buffer a stream to learn its length.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

UNKNOWN = 0xFFFFFFFF  # a RIFF/data size that says "until the stream ends"
_HEADER_BYTES = 44


def float_to_pcm16(samples: np.ndarray) -> bytes:
    """Float samples -> 16-bit little-endian PCM; out-of-range values clip, NaN is silence."""
    x = np.nan_to_num(np.asarray(samples, dtype=np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
    return np.round(np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def pcm16_to_float(data: bytes) -> np.ndarray:
    """16-bit little-endian PCM -> float32 in [-1, 1] (the inverse scale of float_to_pcm16;
    -32768, which it never writes, reads as -1)."""
    if len(data) % 2:
        raise ValueError(f"16-bit PCM has an even byte count (got {len(data)} bytes)")
    return np.maximum(np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0, -1.0)


def wav_header(sample_rate: int, n_samples: int | None = None) -> bytes:
    """A 44-byte RIFF/WAVE header for 16-bit mono PCM; `n_samples=None` (streaming) writes
    the unknown-length sizes, which players and Python's `wave` read to the end of data."""
    if n_samples is None:
        riff, data = UNKNOWN, UNKNOWN
    else:
        data = 2 * n_samples
        if _HEADER_BYTES - 8 + data > UNKNOWN - 1:
            raise ValueError(f"{n_samples} samples do not fit a WAV file (4 GiB)")
        riff = _HEADER_BYTES - 8 + data
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", riff, b"WAVE",
        b"fmt ", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16,
        b"data", data,
    )  # fmt: skip


class WavStream:
    """One WAV stream's bytes: `header()` first, then `encode(samples)` per chunk.

    With `n_samples` known the header is exact and encoding past it is refused; without
    it the header says "unknown length" and `exact_header()` gives the one to patch in
    where the output can seek (a file)."""

    def __init__(self, sample_rate: int, n_samples: int | None = None) -> None:
        self.sample_rate, self.n_samples, self.samples = sample_rate, n_samples, 0

    def header(self) -> bytes:
        return wav_header(self.sample_rate, self.n_samples)

    def encode(self, samples: np.ndarray) -> bytes:
        n = int(np.asarray(samples).size)
        if self.n_samples is not None and self.samples + n > self.n_samples:
            raise ValueError(
                f"WAV stream declared {self.n_samples} samples; {self.samples + n} were written"
            )
        self.samples += n
        return float_to_pcm16(samples)

    def exact_header(self) -> bytes:
        return wav_header(self.sample_rate, self.samples)


def write_wav(path: Path, sample_rate: int, chunks: Iterable[np.ndarray]) -> int:
    """Stream chunks into a WAV file as they come, then patch in the exact lengths.
    Returns the number of samples written."""
    stream = WavStream(sample_rate)
    with path.open("wb") as out:
        out.write(stream.header())
        for chunk in chunks:
            out.write(stream.encode(chunk))
        out.seek(0)
        out.write(stream.exact_header())
    return stream.samples


def sse_audio_delta(pcm: bytes) -> bytes:
    """OpenAI's `speech.audio.delta` server-sent event carrying base64 audio bytes."""
    event = {"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode("ascii")}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def sse_audio_done(input_tokens: int, output_tokens: int) -> bytes:
    """OpenAI's closing `speech.audio.done` event with the request's token usage
    (input: prompt rows; output: frames generated)."""
    usage = {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
    }
    return b"data: " + json.dumps({"type": "speech.audio.done", "usage": usage}).encode() + b"\n\n"
