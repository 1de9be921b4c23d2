"""Sampling: greedy by default, seeded draws independent of the batch, EOS rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdunit.engine.model.sampling import (
    SamplingParams,
    is_eos,
    sample_frames,
    sample_frames_device,
    sample_frames_static,
    sampling_batch,
)

EOS = 1023
C, V = 11, 1024


def random_logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, C, V, generator=g) * 3


def test_greedy_is_the_first_argmax_of_each_column() -> None:
    logits = random_logits(4, 0)
    logits[1, 3, 10] = logits[1, 3, 20] = 100.0  # a tie: the lower id wins
    frames = sample_frames(logits, [SamplingParams()] * 4, [5] * 4, EOS)
    assert frames.dtype == np.int32 and frames.shape == (4, C)
    assert (frames == logits.argmax(-1).numpy()).all()
    assert frames[1, 3] == 10


def test_seeded_draw_depends_only_on_seed_and_frame_index() -> None:
    logits = random_logits(1, 1)
    p = SamplingParams(temperature=1.0, seed=42)
    a = sample_frames(logits, [p], [7], EOS)
    b = sample_frames(logits.clone(), [p], [7], EOS)
    assert (a == b).all()
    later = [sample_frames(logits, [p], [k], EOS) for k in range(8, 16)]
    assert any((x != a).any() for x in later), "frame index does not change the draw"
    other_seed = sample_frames(logits, [SamplingParams(temperature=1.0, seed=43)], [7], EOS)
    assert (other_seed != a).any()


def test_seeded_row_is_the_same_alone_and_in_any_batch_position() -> None:
    logits = random_logits(5, 2)
    params = [
        SamplingParams(temperature=0.8, seed=s, top_k=k) for s, k in [(1, 0), (2, 50), (3, 0)]
    ] + [SamplingParams(), SamplingParams(temperature=1.2, seed=2**64 - 1)]
    index = [0, 3, 9, 4, 100]
    batch = sample_frames(logits, params, index, EOS)
    for i in range(5):
        alone = sample_frames(logits[i : i + 1], [params[i]], [index[i]], EOS)
        assert (alone[0] == batch[i]).all()
    order = [4, 2, 0, 3, 1]
    shuffled = sample_frames(
        logits[order], [params[i] for i in order], [index[i] for i in order], EOS
    )
    assert (shuffled == batch[order]).all()


def test_sampled_frequencies_follow_the_softmax() -> None:
    logits = torch.full((1, C, V), float("-inf"))
    logits[0, :, 0] = np.log(3.0)
    logits[0, :, 1] = 0.0  # p(0) = 0.75, p(1) = 0.25
    draws = np.stack(
        [
            sample_frames(logits, [SamplingParams(temperature=1.0, seed=s)], [0], EOS)[0]
            for s in range(400)
        ]
    )
    assert set(np.unique(draws)) == {0, 1}
    assert abs((draws == 0).mean() - 0.75) < 0.03


def test_top_k_draws_only_among_the_k_largest_logits() -> None:
    logits = random_logits(1, 3)
    top5 = torch.topk(logits[0], 5, dim=-1).indices.numpy()
    seen = np.stack(
        [
            sample_frames(logits, [SamplingParams(temperature=5.0, top_k=5, seed=s)], [0], EOS)[0]
            for s in range(60)
        ]
    )
    for col in range(C):
        assert set(seen[:, col]) <= set(top5[col])
        assert len(set(seen[:, col])) > 1
    one = sample_frames(logits, [SamplingParams(temperature=5.0, top_k=1, seed=9)], [0], EOS)
    assert (one == logits.argmax(-1).numpy()).all()


def test_padded_vocabulary_entries_are_never_drawn() -> None:
    logits = random_logits(1, 4)
    logits[0, 5, 700:] = float("-inf")
    for s in range(50):
        f = sample_frames(logits, [SamplingParams(temperature=50.0, seed=s)], [0], EOS)
        assert f[0, 5] < 700


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_is_suppressed_while_frame_index_is_below_min_frames(temperature: float) -> None:
    logits = random_logits(1, 5)
    logits[0, 0, EOS] = 1e4  # EOS is overwhelmingly likely
    p = SamplingParams(temperature=temperature, seed=1, min_frames=3)
    frames = [sample_frames(logits, [p], [k], EOS)[0] for k in range(5)]
    assert [is_eos(f, EOS) for f in frames] == [False, False, False, True, True]


def test_eos_suppression_applies_per_row_in_a_batch() -> None:
    logits = random_logits(2, 6)
    logits[:, 0, EOS] = 1e4
    params = [SamplingParams(min_frames=10), SamplingParams(min_frames=0)]
    frames = sample_frames(logits, params, [2, 2], EOS)
    assert not is_eos(frames[0], EOS) and is_eos(frames[1], EOS)
    assert logits[0, 0, EOS] == 1e4, "the caller's logits were modified"


def test_is_eos_looks_at_column_zero_only() -> None:
    frame = np.zeros(C, dtype=np.int32)
    frame[3] = EOS
    assert not is_eos(frame, EOS)
    frame[0] = EOS
    assert is_eos(frame, EOS)


def test_invalid_sampling_params_name_the_field() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="min_frames"):
        SamplingParams(max_frames=5, min_frames=6)
    with pytest.raises(ValueError, match="3 logit rows but 2"):
        sample_frames(random_logits(3, 0), [SamplingParams()] * 2, [0, 0, 0], EOS)


def mixed_batch(n: int, seed: int) -> tuple[list[SamplingParams], list[int]]:
    """Greedy and seeded rows, top-k off/small/large/over the vocabulary, EOS suppressed
    on some rows."""
    temps = [0.0, 0.7, 1.0, 1.3, 5.0]
    ks = [0, 1, 5, 50, V - 1, V + 10]
    params = [SamplingParams(temperature=temps[i % 5], top_k=ks[(i + seed) % 6], seed=seed * 1000 + i,
                             min_frames=i % 3, max_frames=50) for i in range(n)]
    return params, [(i + seed) % 4 for i in range(n)]


def device_frames(logits: torch.Tensor, params, index) -> np.ndarray:
    sb = sampling_batch(params, index, logits.shape[1], logits.device)
    out = sample_frames_device(logits, sb, EOS)
    assert out.dtype == torch.int32 and out.device == logits.device
    return out.cpu().numpy()


def test_device_sampling_returns_the_host_samplers_frames() -> None:
    for seed in range(12):
        logits = random_logits(16, seed) * (seed % 4 + 0.5)
        logits[seed % 16, 0, EOS] = 1e4  # an EOS-favouring row, suppressed or not
        params, index = mixed_batch(16, seed)
        assert np.array_equal(device_frames(logits, params, index), sample_frames(logits, params, index, EOS))


def test_device_sampling_leaves_the_logits_untouched_and_greedy_rows_skip_the_draw() -> None:
    logits = random_logits(3, 8)
    logits[:, 0, EOS] = 1e4
    keep = logits.clone()
    params = [SamplingParams(min_frames=5), SamplingParams(), SamplingParams(temperature=1.0, seed=2, min_frames=5)]
    frames = device_frames(logits, params, [0, 0, 0])
    assert torch.equal(logits, keep)
    assert [is_eos(f, EOS) for f in frames] == [False, True, False]
    sb = sampling_batch(params, [0, 0, 0], C, logits.device)
    assert sb.sampled_rows == [2] and sb.uniforms is not None and tuple(sb.uniforms.shape) == (1, C)


@pytest.mark.gpu
def test_device_sampling_on_cuda_returns_the_host_samplers_frames() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for seed in range(12):
        logits = random_logits(64, seed) * (seed % 4 + 0.5)
        params, index = mixed_batch(64, seed)
        got = device_frames(logits.cuda(), params, index)
        assert np.array_equal(got, sample_frames(logits, params, index, EOS))


@pytest.mark.gpu
def test_static_sampler_on_cuda_is_one_launch_with_the_host_samplers_frames() -> None:
    """`sample_frames_static` on CUDA (the frame graphs' sampler) is one kernel launch a
    call whatever the cap, and gives the host sampler's frames for the mixed batches."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch.profiler import ProfilerActivity, profile

    for seed in range(6):
        logits = random_logits(64, seed) * (seed % 4 + 0.5)
        params, index = mixed_batch(64, seed)
        sb = sampling_batch(params, index, C, torch.device("cuda"))
        assert sb.packed is not None
        rows, dev = torch.from_numpy(sb.packed).cuda(), logits.cuda()
        want = sample_frames(logits, params, index, EOS)
        for cap in (None, V + 10):  # every row's k is covered
            assert np.array_equal(sample_frames_static(dev, rows, EOS, 0, cap).cpu().numpy(), want), (seed, cap)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                sample_frames_static(dev, rows, EOS, 0, cap)
                torch.cuda.synchronize()
            kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            assert len(kernels) == 1, kernels


def test_uniforms_are_a_function_of_seed_frame_and_column_only() -> None:
    from pdunit.engine.model.sampling import draw_uniforms

    batch = draw_uniforms([7, 7, 8, 2**64 - 1], [0, 1, 0, 5], 11)
    assert batch.shape == (4, 11) and batch.dtype == np.float64
    assert ((batch >= 0) & (batch < 1)).all()
    for i, (seed, frame) in enumerate([(7, 0), (7, 1), (8, 0), (2**64 - 1, 5)]):
        assert np.array_equal(draw_uniforms([seed], [frame], 11)[0], batch[i])  # alone == in a batch
    assert len({tuple(r) for r in batch}) == 4 and len(set(batch[0])) == 11  # rows and columns differ
    many = draw_uniforms(list(range(2000)), [3] * 2000, 11)
    assert abs(many.mean() - 0.5) < 0.01 and abs((many < 0.1).mean() - 0.1) < 0.01  # uniform enough
