"""The synthetic workload: seeded, voices reused at the asked share, bodies the LB accepts."""

from __future__ import annotations

import numpy as np
import pytest

from pdunit.engine.lb.validate import Limits, parse_request
from pdunit.engine.loadgen.workload import (
    Workload,
    WorkloadConfig,
    arrival_times,
    parse_list,
    parse_range,
    shares,
)

VOCAB = (1024,) * 10 + (50,)


def config(**kw) -> WorkloadConfig:
    base = {
        "n_codebooks": 11,
        "vocab_sizes": VOCAB,
        "prompt_rows": (100, 200),
        "frames": (105, 630),
        "voices": 4,
        "voice_reuse": 0.5,
        "seed": 3,
    }
    base.update(kw)
    return WorkloadConfig(**base)


def test_same_seed_same_requests_and_another_seed_differs():
    w1, w2, other = Workload(config()), Workload(config()), Workload(config(seed=4))
    differs = 0
    for i in range(50):
        s1, s2, s3 = w1.next(), w2.next(), other.next()
        assert s1.index == s2.index == i
        assert (s1.voice, s1.frames, s1.seed) == (s2.voice, s2.frames, s2.seed)
        assert np.array_equal(s1.prompt, s2.prompt)
        differs += s1.seed != s3.seed
    assert differs == 50


def test_rows_frames_and_ids_stay_in_their_ranges():
    w = Workload(config())
    for _ in range(300):
        s = w.next()
        assert 100 <= s.rows <= 200 and 105 <= s.frames <= 630
        assert s.prompt.dtype == np.int32 and s.prompt.shape[1] == 11
        assert (s.prompt >= 0).all() and (s.prompt < np.array(VOCAB)).all()


@pytest.mark.parametrize("reuse", [0.0, 0.3, 0.8, 1.0])
def test_the_share_of_warm_voice_requests_matches_voice_reuse(reuse):
    w = Workload(config(voice_reuse=reuse))
    specs = [w.next() for _ in range(2000)]
    got = shares(specs)["reused"]
    assert abs(got - reuse) < 0.04
    warm = {s.voice for s in specs if s.reused}
    assert warm <= {f"voice-{i}" for i in range(4)}
    assert len({s.voice for s in specs if not s.reused}) == sum(
        not s.reused for s in specs
    )  # cold = unique


def test_a_warm_voice_always_starts_with_the_same_reference_rows():
    cfg = config(voice_reuse=1.0, voices=2)
    w = Workload(cfg)
    ref_rows = cfg.reference_rows
    by_voice: dict[str, list[np.ndarray]] = {}
    for _ in range(40):
        s = w.next()
        by_voice.setdefault(s.voice, []).append(s.prompt)
    assert ref_rows == 75
    for prompts in by_voice.values():
        first = prompts[0][:ref_rows]
        assert all(np.array_equal(p[:ref_rows], first) for p in prompts)
        assert not all(
            np.array_equal(p[ref_rows : ref_rows + 5], prompts[0][ref_rows : ref_rows + 5])
            for p in prompts
        )


@pytest.mark.parametrize("fmt", ["json", "binary"])
def test_bodies_are_valid_requests_for_the_lb(fmt):
    spec = Workload(config()).next()
    body, headers = spec.body(fmt)
    lower = {k.lower(): v for k, v in headers.items()}
    packed = parse_request(lower["content-type"], lower, body, Limits(11, VOCAB))
    assert packed.prompt.tolist() == spec.prompt.tolist()
    assert packed.sampling.max_frames == packed.sampling.min_frames == spec.frames
    assert packed.sampling.seed == spec.seed
    assert headers["X-Session-Id"] == spec.voice


def test_poisson_arrivals_keep_the_rate_and_the_burst_share():
    events = arrival_times(rate=20.0, duration_s=500.0, burst_share=0.3, burst_size=5, seed=1)
    requests = sum(n for _, n in events)
    assert abs(requests / 500.0 - 20.0) < 1.0
    in_bursts = sum(n for _, n in events if n == 5)
    assert abs(in_bursts / requests - 0.3) < 0.04
    times = [t for t, _ in events]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 500.0
    assert all(n == 1 for _, n in arrival_times(5.0, 50.0, seed=1))


def test_range_and_list_arguments_name_the_flag_when_wrong():
    assert parse_range("1000-2000", "--prompt-rows") == (1000, 2000)
    assert parse_range("7", "--frames") == (7, 7)
    with pytest.raises(ValueError, match="--frames '9-3'"):
        parse_range("9-3", "--frames")
    assert parse_list("4,8, 16", "--concurrency") == [4, 8, 16]
    with pytest.raises(ValueError, match="--concurrency"):
        parse_list("4,x", "--concurrency")
