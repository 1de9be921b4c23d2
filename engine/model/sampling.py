"""Turning logits into frames: greedy, or seeded sampling that is the same in every mode.

Owns the sampling rules of a request (temperature, top-k, seed, EOS suppression). Must
never depend on which other requests share the batch, the batch order or the device:
PD and monolith must produce identical frames for identical inputs.

Rules, precisely:
- `frame_index` counts a stream's frames from 0 (the first frame, computed by prefill).
- EOS (column 0 == `eos_id`) is suppressed while `frame_index < min_frames`: a stream
  has at least `min_frames` frames before the frame that ends it.
- `max_frames` bounds the frames a stream produces (the first included); the worker
  stops the stream after frame `max_frames - 1`. The sampler never forces EOS.
- Greedy when `temperature == 0`: per column, the first index of the largest logit.
- Otherwise, per column: logits / temperature, top-k filter (`top_k == 0`: the whole
  vocabulary; ties with the k-th value are kept), softmax weights in float64, then
  inverse-CDF with one uniform per column. The uniforms of (seed, frame_index) come from numpy's
  PCG64 seeded by SplitMix64(seed, frame_index): integer arithmetic only, so the draw
  is identical on every machine and for every batch composition.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    max_frames: int = 210
    min_frames: int = 0

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature >= 0.0:
            problems.append(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, 0 = whole vocabulary (got {self.top_k})")
        if not 0 <= self.seed <= _MASK64:
            problems.append(f"seed must be in [0, 2**64) (got {self.seed})")
        if self.max_frames < 1:
            problems.append(f"max_frames must be >= 1 (got {self.max_frames})")
        if not 0 <= self.min_frames <= self.max_frames:
            problems.append(
                f"min_frames must be in [0, max_frames={self.max_frames}] (got {self.min_frames})"
            )
        if problems:
            raise ValueError("invalid sampling params: " + "; ".join(problems))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_uniforms(seed: int, frame_index: int, n_columns: int) -> np.ndarray:
    """The uniforms in [0, 1) of frame `frame_index` of a stream seeded `seed`."""
    key = _splitmix64(_splitmix64(seed) ^ (frame_index & _MASK64))
    return np.random.Generator(np.random.PCG64(key)).random(n_columns)


def sample_frames(
    logits: torch.Tensor, params: list[SamplingParams], frame_index: list[int], eos_id: int
) -> np.ndarray:
    """logits [n, C, V] -> int32 frames [n, C]. Row i follows params[i] at frame_index[i]."""
    if logits.dim() != 3:
        raise ValueError(f"logits has shape {tuple(logits.shape)}, expected [n, C, V]")
    n, n_cols, _ = logits.shape
    if len(params) != n or len(frame_index) != n:
        raise ValueError(
            f"{n} logit rows but {len(params)} sampling params and {len(frame_index)} frame indices"
        )
    logits = logits.float()
    suppress = [i for i in range(n) if frame_index[i] < params[i].min_frames]
    if suppress:
        logits = logits.clone()
        logits[suppress, 0, eos_id] = float("-inf")
    out = np.empty((n, n_cols), dtype=np.int32)
    greedy = [i for i in range(n) if params[i].temperature == 0.0]
    if greedy:
        out[greedy] = logits[greedy].argmax(dim=-1).to(torch.int32).cpu().numpy()
    sampled = [i for i in range(n) if params[i].temperature != 0.0]
    if sampled:
        rows = logits[sampled].to("cpu", torch.float64).numpy()
        temps = np.array([params[i].temperature for i in sampled], dtype=np.float64)
        u = np.stack([draw_uniforms(params[i].seed, frame_index[i], n_cols) for i in sampled])
        out[sampled] = _sample_rows(rows, temps, [params[i].top_k for i in sampled], u)
    return out


def _sample_rows(
    logits: np.ndarray, temperature: np.ndarray, top_k: list[int], u: np.ndarray
) -> np.ndarray:
    """Frames from logits [m, C, V] (float64), one temperature and top-k per row and
    uniforms [m, C]. Every operation is elementwise or along the vocabulary axis of one
    (row, column), so a row's result does not depend on the other rows."""
    scaled = logits / temperature[:, None, None]
    vocab = scaled.shape[-1]
    for k in sorted(set(top_k)):
        if not 0 < k < vocab:
            continue
        rows = [r for r, kr in enumerate(top_k) if kr == k]
        part = scaled[rows]
        kth = -np.partition(-part, k - 1, axis=-1)[..., k - 1 : k]
        scaled[rows] = np.where(part < kth, -np.inf, part)
    weights = np.exp(scaled - scaled.max(axis=-1, keepdims=True))  # -inf -> 0
    cdf = np.cumsum(weights, axis=-1)
    # First index whose cumulative mass exceeds u * total: never a zero-weight id, because
    # the cdf is flat across those.
    target = u[..., None] * cdf[..., -1:]
    idx = (cdf <= target).sum(axis=-1)
    # u * total can round up to total: fall back to the last id with mass, never to a
    # padded or filtered one.
    last = vocab - 1 - np.argmax(weights[..., ::-1] > 0, axis=-1)
    return np.minimum(idx, last).astype(np.int32)


def is_eos(frame: np.ndarray, eos_id: int) -> bool:
    """True iff the frame ends its stream (column 0 is the EOS id)."""
    return int(frame[0]) == eos_id
