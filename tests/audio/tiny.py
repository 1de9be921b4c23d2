"""Tiny random Mimi codecs built locally with transformers (never downloaded)."""

from __future__ import annotations

from pdunit.engine.audio.codec_spec import tiny_mimi_model
from pdunit.engine.audio.mimi_stream import MimiCodec


def tiny_mimi(
    sampling_rate: int = 800, ratios: tuple[int, ...] = (4, 4), window: int = 6, seed: int = 0
) -> MimiCodec:
    """Mimi's layout at toy width: 4 codebooks of 32 (the `random:csm-tiny` model's), a
    2-layer decoder transformer with a short sliding window (so streams outlive it), 32
    samples a frame at 800 Hz by default; `ratios=(8, 6, 5, 4)` at 24 kHz gives the real
    conv stack (1920 samples a frame). The builder is `--codec random:mimi-tiny:<seed>`'s."""
    return MimiCodec(tiny_mimi_model(4, 32, seed=seed, sampling_rate=sampling_rate, ratios=ratios, window=window))
