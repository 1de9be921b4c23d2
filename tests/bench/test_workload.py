"""The synthetic workload: seeded, voices reused at the asked share, bodies the LB accepts
(under a model's row rule too: csm's text and audio-frame rows)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import numpy as np
import pytest

from pdunit.engine.lb.validate import Limits, parse_request
from pdunit.engine.loadgen.workload import (
    Workload,
    WorkloadConfig,
    arrival_times,
    parse_list,
    parse_range,
    row_rule_of,
    shares,
)
from pdunit.engine.model.request_rules import RowRule

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


# Rows of the issue-23 rules: csm-tiny's and CSM-1B's (CsmFamily.row_rule of random:csm-tiny
# and random:csm-1b-shape), and one with a column the rule leaves free and no frame-end id.
CSM_TINY = (RowRule(marker_column=4, marker_id=62, frame_columns=4, code_limit=32, empty_ids=(0, 31),
                    frame_end_id=61, frame_end_code=0), (32,) * 4 + (64,))
CSM_1B = (RowRule(marker_column=32, marker_id=128002, frame_columns=32, code_limit=2048, empty_ids=(0, 2050),
                  frame_end_id=128003, frame_end_code=0), (2051,) * 32 + (128256,))
FREE_COLUMN = (RowRule(marker_column=4, marker_id=3, frame_columns=3, code_limit=20, empty_ids=(7,)), (24,) * 5)


def rule_config(rule: RowRule, vocab: tuple[int, ...], **kw) -> WorkloadConfig:
    return config(n_codebooks=len(vocab), vocab_sizes=vocab, row_rule=rule, **kw)


@pytest.mark.parametrize("rule,vocab", [CSM_TINY, CSM_1B, FREE_COLUMN], ids=["csm-tiny", "csm-1b", "free-column"])
@pytest.mark.parametrize("prompt_rows", [(2, 4), (20, 60)])
def test_under_a_row_rule_every_prompt_passes_the_lbs_check(rule, vocab, prompt_rows):
    """Every prompt passes the rule's check and the LB's parser with the rule, laid out as
    CSM's: the voice's transcript (text rows), its clip (audio-frame rows, the last its
    end frame where the rule has one), then the text to speak (text rows)."""
    cfg = rule_config(rule, vocab, prompt_rows=prompt_rows)
    w = Workload(cfg)
    limits = Limits(len(vocab), vocab, row_rule=rule)
    for _ in range(60):
        s = w.next()
        assert rule.check(s.prompt) is None, (s.index, rule.check(s.prompt))
        for fmt in ("json", "binary"):
            body, headers = s.body(fmt)
            lower = {k.lower(): v for k, v in headers.items()}
            assert parse_request(lower["content-type"], lower, body, limits).prompt.tolist() == s.prompt.tolist()
        frame = s.prompt[:, rule.marker_column] == rule.marker_id
        ref = cfg.reference_rows
        frames = np.flatnonzero(frame).tolist()
        assert frames and frames == list(range(ref - len(frames), ref)) and frames[0] >= 1
        assert (s.prompt[~frame, : rule.frame_columns] == rule.empty_ids[0]).all()
        assert (s.prompt[ref - 1, : rule.frame_columns] == rule.frame_end_code).all() == (rule.frame_end_id >= 0)


def test_a_model_documents_row_rule_is_the_rule_the_lb_checks_with():
    rule, _ = CSM_TINY
    doc = {"n_codebooks": 5, "row_rule": {"width": rule.width, **asdict(rule), "description": rule.describe()}}
    assert row_rule_of(json.loads(json.dumps(doc))) == rule  # as GET /v1/model sends it
    assert row_rule_of({"n_codebooks": 11, "row_rule": None}) is None
    with pytest.raises(ValueError, match="the row rule reads rows of 5 ids, the model has 11 codebooks"):
        config(row_rule=rule)


def test_without_a_row_rule_the_rows_are_the_same_as_before_it():
    """The rows of seed 3 as the workload drew them before row rules (issue 23): the
    null-rule draws are unchanged, so earlier runs' seeds still mean the same prompts."""
    w = Workload(config())
    h = hashlib.sha256()
    for _ in range(20):
        s = w.next()
        h.update(s.prompt.tobytes())
        h.update(f"{s.voice}/{s.frames}/{s.seed}/{s.reused}".encode())
    assert h.hexdigest() == "3cadfb40474d449912d248bb12cb44debf7670b5d82f7428da9314484fd1064d"
