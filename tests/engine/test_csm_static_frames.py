"""The capture-safe frame step (issue 23): `sample_frames_static` gives
`sample_frames_device`'s frames (greedy, seeded temperature and top-k, EOS suppression,
the depth decoder's own params) in one static shape; csm's `DepthDecoder.frames_static` (its K/V in preallocated
buffers) gives `frames_device`'s frames for a padded batch, the padding rows touching
nothing; `FrameGraphRunner(capture=False)` stages what its graphs replay, through
`TTSModel.frames`. On the CPU; tests/kernels/test_csm_gpu_path.py replays the graphs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pdunit.engine.model.frame_graphs import TOP_K_CAPS, FrameGraphRunner, frame_graphs_supported
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import (
    SamplingParams,
    sample_frames_device,
    sample_frames_static,
    sampling_batch,
)
from pdunit.engine.model.transformer import TTSModel

CPU = torch.device("cpu")
EOS = 0
# greedy; greedy with EOS suppressed; temperature only; top-k of 1, 5, V - 1, V and more
# than V (no filter); temperature + top-k with EOS suppressed
PARAMS = [
    SamplingParams(),
    SamplingParams(min_frames=50),
    SamplingParams(temperature=1.0, seed=9),
    SamplingParams(temperature=0.7, top_k=1, seed=3),
    SamplingParams(temperature=0.9, top_k=5, seed=5),
    SamplingParams(temperature=1.3, top_k=31, seed=11),
    SamplingParams(temperature=1.1, top_k=32, seed=12),
    SamplingParams(temperature=0.8, top_k=1000, seed=13),
    SamplingParams(temperature=1.2, top_k=6, seed=21, min_frames=50),
]
# the depth decoder's own params (codebooks 1..): sampled under a greedy codebook 0; greedy
# under a sampled one; its own top-k only; its top-k past the 64 cap; both with EOS suppressed
DEPTH_PARAMS = [
    SamplingParams(depth_decoder_temperature=0.9, seed=4),
    SamplingParams(temperature=1.0, seed=6, depth_decoder_temperature=0.0),
    SamplingParams(temperature=0.8, top_k=3, seed=8, depth_decoder_top_k=20),
    SamplingParams(temperature=0.9, seed=10, depth_decoder_temperature=1.2, depth_decoder_top_k=100),
    SamplingParams(temperature=1.1, top_k=6, seed=21, min_frames=50, depth_decoder_temperature=0.5,
                   depth_decoder_top_k=2),
]


def packed(params: list[SamplingParams], index: int, columns: int, pad: int = 0) -> torch.Tensor:
    """The rows `sample_frames_static` reads, `pad` zero (padding) rows after them."""
    sb = sampling_batch(params, [index] * len(params), columns, CPU)
    assert sb.packed is not None
    return torch.cat([torch.from_numpy(sb.packed), torch.zeros(pad, sb.packed.shape[1], dtype=torch.float64)])


def test_the_static_sampler_gives_the_device_samplers_frames() -> None:
    """Random float32 logits [n, 3, 32] with ties and EOS favoured in column 0: every
    row's frame equals `sample_frames_device`'s, for every cap covering the rows' top-k,
    per column (column j's uniforms; suppression in column 0 only) and row by row."""
    rng = np.random.default_rng(0)
    n, c, v = len(PARAMS), 3, 32
    logits = torch.from_numpy(rng.normal(size=(n, c, v)).astype(np.float32))
    logits[:, :, 10] = logits[:, :, 3]  # ties: greedy takes the first, top-k keeps both
    logits[:, 0, EOS] += 4.0  # EOS would win column 0 where not suppressed
    for index in (0, 60):
        sb = sampling_batch(PARAMS, [index] * n, c, CPU)
        want = sample_frames_device(logits, sb, EOS)
        rows = packed(PARAMS, index, c)
        assert (want[:, 0] == EOS).any() and (index == 60 or (want[[1, 8], 0] != EOS).all())
        for cap in (None, 31, 64):
            assert torch.equal(sample_frames_static(logits, rows, EOS, 0, cap), want), (index, cap)
        for j in range(1, c):  # one column at a time, as the depth decoder samples
            assert torch.equal(sample_frames_static(logits[:, j : j + 1], rows, EOS, j), want[:, j : j + 1])
        for i in range(n):  # alone in a padded batch of 4
            pad = torch.cat([logits[i : i + 1], torch.from_numpy(rng.normal(size=(3, c, v)).astype(np.float32))])
            got = sample_frames_static(pad, torch.cat([rows[i : i + 1], torch.zeros(3, rows.shape[1],
                                                                                    dtype=torch.float64)]), EOS)
            assert torch.equal(got[0], want[i]), (index, i)
    # a padded vocabulary (the pdunit family's -inf columns) is never drawn
    logits[:, 1, 20:] = float("-inf")
    sb = sampling_batch(PARAMS, [60] * n, c, CPU)
    got = sample_frames_static(logits, packed(PARAMS, 60, c), EOS)
    assert torch.equal(got, sample_frames_device(logits, sb, EOS)) and (got[:, 1] < 20).all()


def test_the_packed_rows_hold_each_rows_sampling() -> None:
    sb = sampling_batch(PARAMS, [0] * len(PARAMS), 3, CPU)
    assert sb.packed is not None and sb.packed.shape == (len(PARAMS), 8) and sb.depth is None
    assert sb.packed[:, 0].tolist() == [p.temperature for p in PARAMS]
    assert sb.packed[:, 1].tolist() == [p.top_k for p in PARAMS]
    assert sb.packed[:, 2].tolist() == [float(p.min_frames > 0) for p in PARAMS]
    assert (sb.packed[:, 3:5] == sb.packed[:, 0:2]).all()  # no depth params: the main ones
    assert (sb.packed[:2, 5:] == 0).all() and (sb.packed[2:, 5:] > 0).all()
    assert sb.max_top_k == 1000 and sampling_batch(PARAMS[:3], [0] * 3, 3, CPU).max_top_k == 0
    mixed = PARAMS[:1] + DEPTH_PARAMS
    sb = sampling_batch(mixed, [0] * len(mixed), 3, CPU)
    assert sb.packed is not None and sb.depth is not None
    assert sb.packed[:, 3].tolist() == [0.0, 0.9, 0.0, 0.8, 1.2, 0.5]
    assert sb.packed[:, 4].tolist() == [0, 0, 0, 20, 100, 2]
    assert (sb.packed[0, 5:] == 0).all() and (sb.packed[1:, 5:] > 0).all()  # row 1 draws in the depth decoder
    assert sb.max_top_k == 100


def test_the_static_sampler_takes_the_depth_decoders_params_for_its_columns() -> None:
    """`depth=True` reads the rows' depth-decoder temperature and top-k: columns 1.. equal
    `sample_frames_device`'s with the depth batch (`SamplingBatch.depth`), for every cap
    covering them; `depth=False` keeps the main ones."""
    rng = np.random.default_rng(4)
    params = PARAMS + DEPTH_PARAMS
    n, c, v = len(params), 3, 32
    logits = torch.from_numpy(rng.normal(size=(n, c, v)).astype(np.float32))
    for index in (0, 60):
        sb = sampling_batch(params, [index] * n, c, CPU)
        assert sb.depth is not None
        main, depth = sample_frames_device(logits, sb, EOS), sample_frames_device(logits, sb.depth, EOS)
        assert not torch.equal(main[:, 1:], depth[:, 1:])
        rows = packed(params, index, c)
        for j in range(1, c):
            for cap in (None, 100, 1000):
                got = sample_frames_static(logits[:, j : j + 1], rows, EOS, j, cap, depth=True)
                assert torch.equal(got, depth[:, j : j + 1]), (index, j, cap)
            assert torch.equal(sample_frames_static(logits[:, j : j + 1], rows, EOS, j), main[:, j : j + 1])


def eos_prone(m: TTSModel, n: int, rng: np.random.Generator) -> torch.Tensor:
    """n random final-norm states of float64 csm-tiny whose codebook-0 logit of EOS is
    raised by 8 (the suppression then decides frames)."""
    w = m.head.weight[EOS].detach()
    return torch.from_numpy(rng.normal(size=(n, m.config.hidden))) + 8 * w / w.norm() ** 2


def test_depth_decoder_frames_static_gives_frames_device_for_a_padded_batch() -> None:
    """float64 csm-tiny on the CPU: the capture-safe step in a batch of 12 (3 padding rows
    of random hidden states and zero sampling rows), its K/V in reused buffers full of
    noise, gives `frames_device`'s frames for every cap covering the rows' top-k; EOS
    suppression shows (frame 0 vs 60)."""
    m = load_model("random:csm-tiny:0")
    fg = m.frame_generator
    assert fg is not None and fg.capture_safe and frame_graphs_supported(m)
    rng = np.random.default_rng(1)
    n, c = len(PARAMS), m.config.n_codebooks
    hidden = eos_prone(m, n, rng)
    padded = torch.cat([hidden, torch.from_numpy(rng.normal(size=(3, m.config.hidden)) * 5)])
    work = fg.static_work(16, CPU)
    assert work.shape == (2, 2, 16, 4, 1, 16)  # layers, K/V, rows, the frame's K positions, heads, dim
    eos_at = {}
    for index in (0, 60):
        sb = sampling_batch(PARAMS, [index] * n, c, CPU)
        want = fg.frames_device(m, hidden, sb)
        eos_at[index] = (want[:, 0] == EOS).tolist()
        for cap in (None, 64):
            work.normal_()
            got = fg.frames_static(m, padded, packed(PARAMS, index, c, pad=3), work, cap)
            assert got.dtype == torch.int32 and got.shape == (n + 3, c)
            assert torch.equal(got[:n], want), (index, cap)
            assert (got[n:, -1] == fg.audio_token_id).all()
    # the depth decoder's own params (codebooks 1..), beside rows without them
    mixed = PARAMS[:4] + DEPTH_PARAMS
    hidden = eos_prone(m, len(mixed), rng)
    padded = torch.cat([hidden, torch.from_numpy(rng.normal(size=(3, m.config.hidden)) * 5)])
    for index in (0, 60):
        sb = sampling_batch(mixed, [index] * len(mixed), c, CPU)
        want = fg.frames_device(m, hidden, sb)
        for cap in (None, 100):
            work.normal_()
            got = fg.frames_static(m, padded, packed(mixed, index, c, pad=3), work, cap)
            assert torch.equal(got[: len(mixed)], want), (index, cap)
    # min_frames=50 suppresses EOS at frame 0 only (rows 1 and 8); greedy picks it where
    # nothing suppresses it
    assert [eos_at[0][i] for i in (0, 1, 8)] == [True, False, False] and eos_at[60][0] and eos_at[60][1]


def test_the_frame_graph_runner_stages_what_its_graphs_replay() -> None:
    """FrameGraphRunner(capture=False) on the CPU, attached as `model.frame_graphs`:
    `frames` and `frames_device` go through its staged buffers for batches it covers
    (padding rows zero), pick the smallest cap covering the rows' top-k, and give the
    eager frames; a batch larger than its largest bucket runs eagerly."""
    m = load_model("random:csm-tiny:0")
    rng = np.random.default_rng(2)
    runner = FrameGraphRunner(m, buckets=(2, 4, 16), capture=False)
    params = (PARAMS + DEPTH_PARAMS) * 2
    for n in (1, 3, 9, 14, 16, 28):
        hidden = eos_prone(m, n, rng)
        ps, index = params[:n], [0, 60] * n
        m.frame_graphs = None
        want = m.frames(hidden, ps, index[:n])
        m.frame_graphs = runner
        before = dict(runner.stats)
        got = m.frames(hidden, ps, index[:n])
        assert np.array_equal(got, want), n
        replayed = runner.stats["replays"] - before["replays"]
        assert replayed == (1 if n <= 16 else 0) and runner.stats["eager"] - before["eager"] == 1 - replayed
        sb = sampling_batch(ps, index[:n], m.config.n_codebooks, CPU)
        assert torch.equal(m.frames_device(hidden, sb), torch.from_numpy(want))
    caps = [runner.cap_for(sampling_batch(p, [0] * len(p), 5, CPU)) for p in
            (PARAMS[:3], PARAMS[:5], PARAMS[:6], PARAMS, PARAMS[:4] + DEPTH_PARAMS)]
    assert caps == [0, 64, 64, None, None] and runner.caps == TOP_K_CAPS == (0, 64, None)
    with pytest.raises(ValueError, match="need a CUDA model"):
        FrameGraphRunner(m, buckets=(2,))
    pdunit = load_model("random:tiny:0")
    assert not frame_graphs_supported(pdunit)
    with pytest.raises(ValueError, match="no capture-safe form"):
        FrameGraphRunner(pdunit, buckets=(2,), capture=False)


def test_seeded_frames_do_not_depend_on_the_cap_or_the_bucket() -> None:
    """A seeded top-k row sampled in buckets of 1, 4 and 16 rows with every cap that
    covers it: one frame."""
    m = load_model("random:csm-tiny:0")
    fg = m.frame_generator
    assert fg is not None
    row = dataclasses.replace(PARAMS[4])
    hidden = torch.from_numpy(np.random.default_rng(3).normal(size=(1, m.config.hidden)))
    frames = set()
    for size in (1, 4, 16):
        padded = torch.cat([hidden, torch.zeros(size - 1, m.config.hidden, dtype=hidden.dtype)])
        rows = packed([row], 7, m.config.n_codebooks, pad=size - 1)
        for cap in TOP_K_CAPS[1:]:
            frames.add(tuple(fg.frames_static(m, padded, rows, fg.static_work(size, CPU), cap)[0].tolist()))
    assert len(frames) == 1


def test_the_torch_sampler_captures_each_bucket_per_cap_and_the_fused_one_once(monkeypatch) -> None:
    """The torch form's cost grows with its cap: a runner on a plain CPU records every
    bucket at each of TOP_K_CAPS. Where `sample_frames_static` runs the fused sampler
    (faked here: `sampling_fused.available`; tests/kernels/test_frame_graph_caps.py runs
    it under Triton's interpreter) it records each bucket once, at the cap covering every
    row, which every request and `replay_staged`'s cap map to."""
    from pdunit.engine.model import frame_graphs
    from pdunit.kernels import sampling_fused

    m = load_model("random:csm-tiny:0")
    torch_form = FrameGraphRunner(m, buckets=(2, 8, 4), capture=False)
    assert frame_graphs.captured_caps(CPU) == TOP_K_CAPS == torch_form.caps
    assert torch_form.keys == [(size, cap) for size in (8, 4, 2) for cap in (0, 64, None)]
    assert [torch_form._cover(k) for k in (0, 1, 64, 65, None)] == [0, 64, 64, None, None]
    monkeypatch.setattr(sampling_fused, "available", lambda device: True)
    assert frame_graphs.captured_caps(CPU) == (None,)
    fused = FrameGraphRunner(m, buckets=(2, 8, 4), capture=False)
    assert fused.caps == (None,) and fused.keys == [(8, None), (4, None), (2, None)]
    for params in (PARAMS[:3], PARAMS[:5], PARAMS, DEPTH_PARAMS):
        assert fused.cap_for(sampling_batch(params, [0] * len(params), 5, CPU)) is None
    assert [fused._cover(k) for k in (0, 64, None)] == [None, None, None]


def test_depth_decoder_params_sample_codebooks_1_on_and_leave_codebook_0() -> None:
    """Codebook 0 keeps the main params whatever the depth decoder's; a greedy depth
    decoder (depth_decoder_temperature 0, transformers' depth_decoder_do_sample=False)
    under a sampled codebook 0 takes the argmax of its teacher-forced logits, codebook
    by codebook; a sampled one under a greedy codebook 0 samples (seeded: it repeats)."""
    m = load_model("random:csm-tiny:0")
    fg = m.frame_generator
    assert fg is not None and m.depth_sampling and not load_model("random:tiny:0").depth_sampling
    k = fg.n_codebooks
    hidden = torch.from_numpy(np.random.default_rng(5).normal(size=(6, m.config.hidden)))
    main = [SamplingParams(temperature=1.0, seed=s) for s in range(3)] + [SamplingParams()] * 3
    depth = [dataclasses.replace(p, depth_decoder_temperature=0.0) for p in main[:3]]
    depth += [SamplingParams(seed=s, depth_decoder_temperature=1.0, depth_decoder_top_k=8) for s in range(3)]
    plain, mixed = (m.frames(hidden, ps, [3] * 6) for ps in (main, depth))
    assert np.array_equal(plain[:, 0], mixed[:, 0])
    logits = fg.logits(hidden[:3], torch.from_numpy(mixed[:3, : k - 1].astype(np.int64)))
    assert np.array_equal(logits.argmax(dim=-1).numpy(), mixed[:3, 1:k])  # greedy depth decoder
    assert not np.array_equal(plain[3:, 1:k], mixed[3:, 1:k])  # the greedy rows' depth decoder samples
    assert np.array_equal(mixed, m.frames(hidden, depth, [3] * 6))
