"""The codec's CUDA-graph push equals the eager push on a GPU (engine/audio/mimi_graphs.py):
the tiny codec through buckets, padding, mixed ages and slot growth (recapture), and
Mimi's real shape past its 250-position window. fp32 compared with TF32 off (the two
paths may pick different cuDNN/cuBLAS algorithms for a padded batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdunit.engine.audio.mimi_stream import MimiCodec, MimiStreamDecoder
from tests.audio.test_mimi_graphs import lively
from tests.audio.tiny import tiny_mimi

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def lockstep(codec: MimiCodec, steps: int, names: int, frames: tuple[int, ...], rng: np.random.Generator,
             **graph_args) -> tuple[float, float, MimiStreamDecoder]:
    """Both decoders get the same opens, closes and pushes; returns the largest
    difference, the largest sample and the graph decoder."""
    eager = MimiStreamDecoder(codec, slots=2)
    graphs = MimiStreamDecoder(codec, slots=2, graphs=True, **graph_args)
    live: list[str] = []
    worst = peak = 0.0
    k, size = codec.num_codebooks, codec.codebook_size
    for step in range(steps):
        if step < names:
            for d in (eager, graphs):
                d.open(f"s{step}")
            live.append(f"s{step}")
        if step == names - 2:
            for d in (eager, graphs):
                d.close(live[0])
            live.pop(0)
        n = frames[step % len(frames)]
        batch = {s: rng.integers(0, size, size=(k, n)) for s in live if rng.random() < 0.85 or s == live[-1]}
        want, got = eager.push_many(batch), graphs.push_many(batch)
        for s in batch:
            assert got[s].shape == want[s].shape
            worst = max(worst, float(np.abs(got[s] - want[s]).max()))
            peak = max(peak, float(np.abs(want[s]).max()))
    return worst, peak, graphs


def test_tiny_graphs_equal_eager_through_buckets_padding_ages_and_growth():
    codec = lively(tiny_mimi())
    codec.model.to("cuda")
    worst, peak, d = lockstep(codec, 18, 11, (1, 2, 3), np.random.default_rng(0),
                              buckets=(1, 4, 8), graph_frames=2)
    print(f"tiny fp32: max |graph - eager| {worst:.3g}, peak {peak:.3g}, captures {d.graphs.captures}")
    assert d.graphs.captures > 0 and d.graphs.replays > d.graphs.captures
    assert d.state_version > 0  # slots grew: the graphs were recaptured
    assert worst <= 1e-4 * max(1.0, peak)


def test_tiny_graphs_in_bf16_capture_and_stay_close():
    codec = lively(tiny_mimi())
    codec.model.to("cuda", torch.bfloat16)
    worst, peak, d = lockstep(codec, 12, 6, (1, 2), np.random.default_rng(1), buckets=(2, 8))
    print(f"tiny bf16: max |graph - eager| {worst:.3g}, peak {peak:.3g}")
    assert d.graphs.captures > 0 and np.isfinite(worst)
    assert worst <= 0.05 * max(1.0, peak)


def test_real_mimi_shape_graphs_equal_eager_past_the_window():
    from pdunit.bench.codec import build_codec

    codec = build_codec("real", torch.float32, "cuda", 0)
    eager = MimiStreamDecoder(codec)
    graphs = MimiStreamDecoder(codec, graphs=True, buckets=(4,))
    rng = np.random.default_rng(2)
    for d in (eager, graphs):
        for s in "abc":
            d.open(s)
    for _ in range(9):  # 144 frames, 288 transformer positions: past the 250 window (eager in both)
        chunk = {s: rng.integers(0, 2048, size=(32, 16)) for s in "abc"}
        eager.push_many(chunk)
        graphs.push_many(chunk)
    worst = peak = 0.0
    for i in range(4):
        batch = {s: rng.integers(0, 2048, size=(32, 1 + i % 2)) for s in "abc"[: 2 + i % 2]}
        want, got = eager.push_many(batch), graphs.push_many(batch)
        for s in batch:
            worst = max(worst, float(np.abs(got[s] - want[s]).max()))
            peak = max(peak, float(np.abs(want[s]).max()))
    print(f"real fp32: max |graph - eager| {worst:.3g}, peak {peak:.3g}, captures {graphs.graphs.captures}")
    assert graphs.graphs.captures == 2 and peak > 0
    assert worst <= 1e-4 * max(1.0, peak)


def test_prepare_captures_up_front_and_pushes_replay_without_capturing():
    codec = lively(tiny_mimi())
    codec.model.to("cuda")
    d = codec.stream_decoder(graphs=True, slots=16)
    assert d.graphs.prepare(frames=(1, 2), max_batch=8) == d.graphs.captures == 8  # buckets 1, 2, 4, 8
    eager = codec.stream_decoder()
    for s in ("a", "b", "c"):
        d.open(s)
        eager.open(s)
    rng = np.random.default_rng(3)
    for n in (1, 2, 2):
        batch = {s: rng.integers(0, 32, size=(4, n)) for s in ("a", "b", "c")}
        got, want = d.push_many(batch), eager.push_many(batch)
        peak = max(1.0, max(float(np.abs(want[s]).max()) for s in batch))
        assert max(float(np.abs(got[s] - want[s]).max()) for s in batch) <= 1e-4 * peak
    assert d.graphs.captures == 8 and d.graphs.replays == 3
