"""The graph path's static push equals the eager push (engine/audio/mimi_graphs.py).

On a CPU the static-shape path runs uncaptured: the same tensor ops a CUDA graph records
(tests/gpu/test_codec_graphs.py replays them on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdunit.engine.audio.mimi_stream import MimiCodec, MimiStreamDecoder
from tests.audio.tiny import tiny_mimi

BOUND = 1e-4  # of full scale, fp32


def lively(codec: MimiCodec, seed: int = 0) -> MimiCodec:
    """A tiny random codec whose output depends on every part: transformers' random init
    leaves the codebooks at zero (every code decodes alike) and the layer scales at 0.01."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in codec.model.named_buffers():
            if name.endswith("embed_sum"):
                buf.copy_(torch.randn(buf.shape, generator=g))
        for name, param in codec.model.named_parameters():
            if name.endswith("layer_scale.scale"):
                param.fill_(0.7)
    return codec


@pytest.fixture(scope="module")
def codec() -> MimiCodec:
    return lively(tiny_mimi())


def codes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 32, size=(4, n))


def test_static_push_equals_eager_across_buckets_ages_and_the_window(codec: MimiCodec) -> None:
    """Streams opened at different times (their pasts differ, some past the 6-position
    window), batches padded to buckets 4 and 8, a batch over the largest bucket (split),
    calls of 3 frames run eagerly by the graph decoder (over its graph_frames), a slot
    freed and reused, and slot growth under running streams (the graphs recaptured)."""
    rng = np.random.default_rng(1)
    eager = MimiStreamDecoder(codec, slots=2)
    graphs = MimiStreamDecoder(codec, slots=2, graphs=True, buckets=(1, 4, 8), graph_frames=2)
    names = [f"s{i}" for i in range(11)]
    live: list[str] = []
    worst = 0.0
    for step in range(16):
        if step < len(names):  # one new stream a step: every call mixes ages
            for d in (eager, graphs):
                d.open(names[step])
            live.append(names[step])
        if step == 9:  # a stream ends, its slot goes to the next one opened
            for d in (eager, graphs):
                d.close(live[0])
            live.pop(0)
        n = (1, 2, 3)[step % 3]
        batch = {s: codes(rng, n) for s in live if rng.random() < 0.9 or s == live[-1]}
        want = eager.push_many(batch)
        got = graphs.push_many(batch)
        assert set(got) == set(want) == set(batch)
        for s in batch:
            assert got[s].shape == want[s].shape == (n * codec.samples_per_frame,)
            worst = max(worst, float(np.abs(got[s] - want[s]).max()))
    assert worst <= BOUND
    g = graphs.graphs
    assert g is not None and g.replays > 0 and g.captures == 0  # no capture on a CPU
    assert graphs.scratch_slot not in graphs._slot.values()
    assert graphs.state_version > 0  # the slots grew: entries were dropped and rebuilt


def test_static_push_alone_equals_the_one_shot_decode(codec: MimiCodec) -> None:
    c = torch.as_tensor(codes(np.random.default_rng(2), 14))
    with torch.inference_mode():
        reference = codec.model.decode(c[None]).audio_values[0, 0].numpy()
    d = MimiStreamDecoder(codec, graphs=True, buckets=(2,), graph_frames=2)
    d.open("a")
    audio = np.concatenate([d.push("a", c[:, i : i + 2]) for i in range(0, 14, 2)])
    assert np.abs(reference).max() > 0.1
    assert np.abs(audio - reference).max() <= 1e-3


def test_eager_and_static_agree_with_codes_that_matter(codec: MimiCodec) -> None:
    """The control for the bound: different codes give audio far apart (the codebooks
    are not the zeros of transformers' init)."""
    d = MimiStreamDecoder(codec, graphs=True, buckets=(2,))
    d.open("a")
    d.open("b")
    out = d.push_many({"a": np.zeros((4, 2), dtype=np.int64), "b": np.full((4, 2), 7)})
    assert np.abs(out["a"] - out["b"]).max() > 100 * BOUND


def test_graph_options_are_checked(codec: MimiCodec) -> None:
    with pytest.raises(ValueError, match="2 slots"):
        MimiStreamDecoder(codec, slots=1, graphs=True)
    with pytest.raises(ValueError, match="buckets"):
        MimiStreamDecoder(codec, graphs=True, buckets=(0, 4))
    d = MimiStreamDecoder(codec, graphs=True, buckets=(4, 16))
    assert d.graphs.bucket(1) == 4 and d.graphs.bucket(5) == 16 and d.graphs.bucket(40) == 16


def test_prepare_builds_every_bucket_up_to_the_batch_before_any_push(codec: MimiCodec) -> None:
    d = codec.stream_decoder(graphs=True, slots=16)
    assert d.graphs.prepare(frames=(1, 2), max_batch=5) == 8  # buckets 1, 2, 4, 8 x 2 frame counts
    assert d.graphs.prepare(frames=(1, 2), max_batch=5) == 0  # already there
    assert d.graphs.prepare(frames=(9,)) == 0  # over graph_frames: eager
    d.open("a")
    before = d.graphs.replays
    d.push("a", np.zeros((4, 2), dtype=np.int64))
    assert d.graphs.replays == before + 1
