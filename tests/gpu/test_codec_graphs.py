"""The codec on a GPU: the CUDA-graph push equals the eager push (engine/audio/mimi_graphs.py)
for the tiny codec through buckets, padding, mixed ages and slot growth (recapture), and
for Mimi's real shape past its 250-position window; the Triton ring attention
(engine/audio/mimi_mask.py) equals the torch one and transformers' one-shot decode at the
real shape; the fused kernels (kernels/codec_fused.py, the default on CUDA) equal the torch
reference per convolution, per PCM sample and for whole decoders at the real shape in fp32
and bf16, on the hand conv tiles and on tiles `--tune-conv` chose (every candidate checked),
in a fraction of its launches; the codec stage captures its graphs at start,
sized to the engine's batch. fp32 compared with TF32 off (the paths may pick different
cuDNN/cuBLAS algorithms for a padded batch)."""

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
    frames then graph calls of 1 and 2, on the Triton kernel and fused kernels and on the
    torch attention and kernels, each against transformers' `MimiModel.decode` of all the
    frames."""
    from pdunit.bench.codec import build_codec

    codec = build_codec("real", torch.float32, "cuda", 0)
    rng = np.random.default_rng(4)
    c = rng.integers(0, 2048, size=(32, 140))
    with torch.inference_mode():
        reference = codec.model.decode(torch.as_tensor(c, device="cuda")[None]).audio_values[0, 0].float().cpu().numpy()
    kernel = MimiStreamDecoder(codec, graphs=True, buckets=(1,))
    plain = MimiStreamDecoder(codec, attention="torch", kernels="torch")
    assert kernel.attention == "triton" and kernel.kernels == "fused"
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
    assert d.use_graphs and d.attention == "triton" and d.kernels == "fused" and d.slots == 7
    assert d.graphs.buckets == (1, 2, 4, 6) and d.graphs.captures == 8  # 4 buckets x 1 and 2 frames
    for s in range(6):
        d.open(str(s))
    d.push_many({str(s): np.zeros((4, 2), dtype=np.int64) for s in range(6)})
    assert d.graphs.captures == 8 and d.state_version == 0  # replayed, no growth


def test_every_real_shape_convolution_fused_equals_its_torch_form_in_bf16():
    """The real decoder's convolutions at the rows of a 1- and a 2-frame call of 8 streams
    (the residual blocks' last ones with their residual): fused rounds once where torch
    rounds the GEMM, the bias and the residual apart, so a few bf16 ulps; the next context
    equal to an ulp."""
    from pdunit.bench.codec import build_codec
    from pdunit.engine.audio.mimi_stream import _Residual

    codec = build_codec("real", torch.bfloat16, "cuda", 0)
    d = MimiStreamDecoder(codec)
    steps = [d._upsample, *d._seanet]
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for frames in (1, 2):
        t = frames
        for step in steps:
            convs = [(c, c is step.block[-1]) for c in step.block] if isinstance(step, _Residual) else [(step, False)]
            for conv, last in convs:
                c = conv.conv
                x = torch.randn(8, t, c.in_channels, device="cuda", generator=gen).to(torch.bfloat16)
                state = torch.randn(8, c.state_values, device="cuda", generator=gen).to(torch.bfloat16)
                res = (torch.randn(8, t * c.frames, c.out_channels, device="cuda", generator=gen).to(torch.bfloat16)
                       if last else None)
                held = c.state_values > 0
                want_next, got_next = state.clone(), torch.empty_like(state)
                with torch.inference_mode():
                    want = c(x, state if held else None, want_next if held else None, conv.elu, res)
                    got = c(x, state if held else None, got_next if held else None, conv.elu, res, fused=True)
                scale = max(1.0, float(want.abs().max()))
                worst = max(worst, float((got.float() - want.float()).abs().max()) / scale)
                # the ELU in float32 rounds to bf16 alike but for a rare ulp (exp(x) - 1 vs expm1)
                assert not held or torch.allclose(got_next.float(), want_next.float(), rtol=1e-2, atol=1e-3)
                t = t * c.frames if not isinstance(step, _Residual) else t
    print(f"real bf16 convs: max |fused - torch| / scale {worst:.3g}")
    assert worst <= 3e-2


def test_int16_pcm_on_cuda_is_bit_for_bit_the_torch_conversion():
    from pdunit.engine.audio.mimi_stream import to_pcm16
    from pdunit.kernels.codec_fused import pcm16

    x = torch.randn(64, 1920, device="cuda") * 1.3
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[1, :600] = (torch.arange(600, device="cuda") - 300.5) / 32767
    for t in (x, x.bfloat16(), x[:, ::2]):
        assert torch.equal(pcm16(t), to_pcm16(t))


def fused_against_torch(codec: MimiCodec) -> tuple[float, float, float, int]:
    """Six streams warmed past the window in 16-frame calls (eager, 4 transformer passes),
    then calls of 1 and 2 frames on the fused path's graphs (buckets 4 and 8) against the
    torch kernels eager: (max difference, peak, relative RMS, captures)."""
    ref = MimiStreamDecoder(codec, slots=8, kernels="torch")
    fused = MimiStreamDecoder(codec, slots=9, graphs=True, buckets=(4, 8), kernels="fused")
    rng = np.random.default_rng(5)
    names = [f"s{i}" for i in range(6)]
    for d in (ref, fused):
        for s in names:
            d.open(s)
    worst = peak = err2 = sig2 = 0.0
    calls = [{s: 16 for s in names}] * 9 + [{s: 1 + (i + j) % 2 for j, s in enumerate(names[: 3 + i % 4])}
                                            for i in range(6)]
    for call in calls:
        batch = {s: rng.integers(0, 2048, size=(32, n)) for s, n in call.items()}
        want, got = ref.push_many(batch), fused.push_many(batch)
        for s in batch:
            worst = max(worst, float(np.abs(got[s] - want[s]).max()))
            peak = max(peak, float(np.abs(want[s]).max()))
            err2 += float(((got[s] - want[s]) ** 2).sum())
            sig2 += float((want[s] ** 2).sum())
    return worst, peak, (err2 / max(sig2, 1e-30)) ** 0.5, fused.graphs.captures


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_mimi_shape_fused_decoder_equals_the_torch_decoder(dtype):
    """`fused_against_torch` on the hand tiles: fp32 to 1e-4 of the peak, bf16 to its
    rounding (max and RMS)."""
    from pdunit.bench.codec import build_codec

    codec = build_codec("real", dtype, "cuda", 0)
    worst, peak, rms, captures = fused_against_torch(codec)
    print(f"real {dtype}: max |fused - torch| {worst:.3g}, peak {peak:.3g}, relative RMS {rms:.3g}, "
          f"captures {captures}")
    assert peak > 0 and captures > 0
    if dtype == torch.float32:
        assert worst <= 1e-4 * max(1.0, peak)
    else:
        assert worst <= 0.05 * max(1.0, peak) and rms <= 0.02


def test_real_mimi_shape_conv_tuning_checks_every_candidate_and_the_tuned_decoder_equals_torch():
    """`pdunit bench codec --tune-conv`'s path in bf16 at 8 streams x 1 frame: every tile
    candidate of the decoder's 15 convolutions launched, checked against the torch form
    and timed; none wrong (one the card cannot hold may fail to launch, and is never
    chosen); a decoder on the fastest tiles (graphs) equals the torch decoder."""
    from pdunit.bench.codec import CodecConfig, build_codec, tune_conv
    from pdunit.kernels import codec_fused as cf

    codec = build_codec("real", torch.bfloat16, "cuda", 0)
    rows, best = tune_conv(codec, CodecConfig(batches=[8], frames=[1], dtypes=["bf16"], seed=1), "bf16")
    failed = [(r["conv"], r["tiles"], r.get("failed", r.get("error"))) for r in rows if not r["ok"]]
    print(f"real bf16 conv tuning at 8 streams: {len(rows)} candidates, {len(best)} shapes, not passed {failed}, "
          f"chosen {[(b['conv'], b['tiles']) for b in best]}")
    assert len(best) == 15 and all(0 < b["ms"] and b["hand_ms"] for b in best)
    assert not [r for r in rows if not r["ok"] and "failed" not in r]  # launched and wrong: never
    cf.use_conv_table(cf.ConvTable.from_dict({"device": torch.cuda.get_device_name(), "entries": best}))
    try:
        worst, peak, rms, captures = fused_against_torch(codec)
    finally:
        cf.use_conv_table(None)
    print(f"real bf16 tuned: max |fused - torch| {worst:.3g}, peak {peak:.3g}, relative RMS {rms:.3g}")
    assert peak > 0 and captures > 0
    assert worst <= 0.05 * max(1.0, peak) and rms <= 0.02


def test_the_fused_push_launches_a_fraction_of_the_torch_kernels():
    """One eager 1-frame push + int16 at the real shape, 4 streams, counted by torch's
    profiler (every GPU kernel and copy)."""
    from torch.profiler import ProfilerActivity, profile

    from pdunit.bench.codec import build_codec

    codec = build_codec("real", torch.bfloat16, "cuda", 0)
    counts = {}
    for kernels in ("torch", "fused"):
        d = MimiStreamDecoder(codec, slots=4, kernels=kernels)
        slots = np.array([d.open(f"s{i}") for i in range(4)])
        codes = np.random.default_rng(6).integers(0, 2048, size=(4, 32, 1))
        d.decode(slots, codes, pcm16=True)  # compiles, warms
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            d.decode(slots, codes, pcm16=True)
            torch.cuda.synchronize()
        counts[kernels] = sum(e.count for e in prof.key_averages()
                              if (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) > 0)
    print(f"GPU kernels of one 1-frame push: {counts}")
    assert counts["fused"] <= 0.5 * counts["torch"]
