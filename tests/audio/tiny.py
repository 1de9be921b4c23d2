"""Tiny random Mimi codecs built locally with transformers (never downloaded)."""

from __future__ import annotations

import torch

from pdunit.engine.audio.mimi_stream import MimiCodec


def tiny_mimi(
    sampling_rate: int = 800, ratios: tuple[int, ...] = (4, 4), window: int = 6, seed: int = 0
) -> MimiCodec:
    """Mimi's layout at toy width: 4 codebooks of 32, a 2-layer decoder transformer with a
    short sliding window (so streams outlive it), 32 samples a frame at 800 Hz by default;
    `ratios=(8, 6, 5, 4)` at 24 kHz gives the real conv stack (1920 samples a frame)."""
    from transformers import MimiConfig, MimiModel

    cfg = MimiConfig(
        sampling_rate=sampling_rate, hidden_size=16, num_filters=4, upsampling_ratios=list(ratios),
        num_hidden_layers=2, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
        codebook_size=32, codebook_dim=8, num_quantizers=4, num_semantic_quantizers=1,
        vector_quantization_hidden_dimension=8, upsample_groups=16, sliding_window=window,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return MimiCodec(MimiModel(cfg))
