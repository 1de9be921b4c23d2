"""The codec on a GPU: the CUDA-graph push equals the eager push (engine/audio/mimi_graphs.py)
for the tiny codec through buckets, padding, mixed ages and slot growth (recapture), and
for Mimi's real shape past its 250-position window; the Triton ring attention
(engine/audio/mimi_mask.py) equals the torch one and transformers' one-shot decode at the
real shape; the codec stage captures its graphs at start, sized to the engine's batch.
fp32 compared with TF32 off (the paths may pick different cuDNN/cuBLAS algorithms for a
padded batch)."""

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


def test_real_mimi_shape_ring_kernel_equals_torch_attention_and_the_one_shot_decode():
    """One stream of 140 frames (280 positions, past the 250 window): eager calls of 16
    frames then graph calls of 1 and 2, on the Triton kernel and on the torch attention,
    each against transformers' `MimiModel.decode` of all the frames."""
    from pdunit.bench.codec import build_codec

    codec = build_codec("real", torch.float32, "cuda", 0)
    rng = np.random.default_rng(4)
    c = rng.integers(0, 2048, size=(32, 140))
    with torch.inference_mode():
        reference = codec.model.decode(torch.as_tensor(c, device="cuda")[None]).audio_values[0, 0].float().cpu().numpy()
    kernel = MimiStreamDecoder(codec, graphs=True, buckets=(1,))
    plain = MimiStreamDecoder(codec, attention="torch")
    assert kernel.attention == "triton"
    cuts = [16] * 7 + [1, 2] * 9 + [1]
    assert sum(cuts) == 140
    audio: dict[str, list[np.ndarray]] = {"kernel": [], "torch": []}
    for name, d in (("kernel", kernel), ("torch", plain)):
        d.open("a")
        done = 0
        for n in cuts:
            audio[name].append(d.push("a", c[:, done : done + n]))
            done += n
    got, want = np.concatenate(audio["kernel"]), np.concatenate(audio["torch"])
    peak = float(np.abs(reference).max())
    vs_torch, vs_ref = float(np.abs(got - want).max()), float(np.abs(got - reference).max())
    print(f"real fp32: max |kernel - torch| {vs_torch:.3g}, |kernel - one-shot| {vs_ref:.3g}, "
          f"|torch - one-shot| {float(np.abs(want - reference).max()):.3g}, peak {peak:.3g}")
    assert peak > 0 and kernel.graphs.captures == 2
    assert vs_torch <= 1e-4 * max(1.0, peak)
    assert vs_ref <= 1e-3 * max(1.0, peak)


def test_the_codec_stage_on_cuda_captures_its_graphs_at_start_sized_to_the_batch():
    from types import SimpleNamespace

    from pdunit.engine.audio.codec_stage import CodecStage

    codec = lively(tiny_mimi())
    codec.model.to("cuda")
    model = SimpleNamespace(codec_codes=lambda frames: np.asarray(frames).T)
    stage = CodecStage.for_model(codec, model, 1, 2, max_batch=6)  # type: ignore[arg-type]
    d = stage.decoder
    assert d.use_graphs and d.attention == "triton" and d.slots == 7
    assert d.graphs.buckets == (1, 2, 4, 6) and d.graphs.captures == 8  # 4 buckets x 1 and 2 frames
    for s in range(6):
        d.open(str(s))
    d.push_many({str(s): np.zeros((4, 2), dtype=np.int64) for s in range(6)})
    assert d.graphs.captures == 8 and d.state_version == 0  # replayed, no growth
