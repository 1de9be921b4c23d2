"""Turns per-sequence work (prefill chunks, decode steps) into one model ForwardBatch.

P, D and the monolith all describe their work as `SeqEntry`s; this module is the one
place that concatenates them. It never decides what runs: schedulers do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdunit.engine.model.transformer import ForwardBatch


@dataclass
class SeqEntry:
    tokens: np.ndarray         # int64 [q, C]: the rows computed now
    positions: np.ndarray      # int64 [q]
    write_slots: np.ndarray    # int64 [q]
    context_slots: np.ndarray  # int64 [ctx]: every token so far, the new ones last


def make_batch(entries: list[SeqEntry]) -> ForwardBatch:
    return ForwardBatch(
        tokens=torch.from_numpy(np.concatenate([e.tokens for e in entries]).astype(np.int64)),
        positions=torch.from_numpy(np.concatenate([e.positions for e in entries]).astype(np.int64)),
        write_slots=torch.from_numpy(np.concatenate([e.write_slots for e in entries]).astype(np.int64)),
        query_lens=[len(e.tokens) for e in entries],
        context_slots=[torch.from_numpy(e.context_slots.astype(np.int64)) for e in entries],
    )


def prefill_entry(prompt: np.ndarray, slots: np.ndarray, start: int, end: int) -> SeqEntry:
    """Rows [start, end) of a prompt whose rows live at `slots` (rows < start already cached)."""
    return SeqEntry(
        tokens=prompt[start:end],
        positions=np.arange(start, end, dtype=np.int64),
        write_slots=slots[start:end],
        context_slots=slots[:end],
    )
