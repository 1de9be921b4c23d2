"""The prefill computation shared by P and the monolith: prompt rows -> KV + first frame.

Owns no queue and no transport: callers pass prompts with their storage slots (cached
rows first) and get first frames back. The first frame is sampled with frame index 0,
so it is the same frame in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdunit.engine.batching import SeqEntry, make_batch, prefill_entry
from pdunit.engine.model.sampling import SamplingParams, sample_frames
from pdunit.engine.model.transformer import TTSModel


@dataclass
class PrefillChunk:
    prompt: np.ndarray       # int64 [rows, C]
    slots: np.ndarray        # int64 [rows]: storage slot of every row
    start: int               # first row computed now (rows before are in storage)
    end: int                 # one past the last row computed now
    params: SamplingParams

    @property
    def is_last(self) -> bool:
        return self.end == len(self.prompt)


def run_forward(
    model: TTSModel, storage: torch.Tensor, entries: list[SeqEntry]
) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward(make_batch(entries), storage)


def run_prefill(
    model: TTSModel, storage: torch.Tensor, chunks: list[PrefillChunk]
) -> list[np.ndarray | None]:
    """Computes the chunks in one forward; returns each prompt's first frame (int32 [C])
    when its last row was computed, else None."""
    logits = run_forward(model, storage, [prefill_entry(c.prompt, c.slots, c.start, c.end) for c in chunks])
    return first_frames(model, logits, chunks)


def first_frames(model: TTSModel, logits: torch.Tensor, chunks: list[PrefillChunk]) -> list[np.ndarray | None]:
    done = [i for i, c in enumerate(chunks) if c.is_last]
    out: list[np.ndarray | None] = [None] * len(chunks)
    if done:
        frames = sample_frames(
            logits[done], [chunks[i].params for i in done], [0] * len(done), model.config.eos_id
        )
        for row, i in enumerate(done):
            out[i] = frames[row]
    return out
