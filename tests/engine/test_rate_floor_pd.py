"""The overload of issue 24 through a PD unit on CPU: D refuses at RESERVE, so a refusal
crosses LB -> P -> D and back. D's steps and P's forwards are padded to synthetic costs
(`--synthetic-step-ms`, `--synthetic-forward-ms`: engine/step_pad.py), P forwards one
prompt at a time, so a refusal that waited behind P's forward would take up to 250 ms.
Asserted: every admitted stream at or above the floor, 0 stutter, refusals 503
`rate_floor` with Retry-After, 90% answered within 50 ms at the LB
(`pdunit_lb_refusal_seconds`) and as many not held in P, nothing held after.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest

from pdunit.engine.local import LocalConfig, LocalUnit
from tests.engine.test_rate_floor_overload import WARM_S, level, refusal_seconds, share_within
from tests.engine.unit_client import load, wait_empty, wait_for

OVERLOAD = 16  # closed-loop streams: twice what D admits at the floor below
WARM = 4  # streams D fits its step model on before the overload
FLOOR = 8.0  # frames/s: a D step of 60 + 7.5 x streams ms keeps it up to 8 streams
STEP_PAD = "60,7.5"  # D: ms per step, + per decoding stream
# D keeps its default --floor-margin (10%: a budget of 112.5 ms, 7 streams by the pad): the
# pad is a floor under a step, not a ceiling, and beside a busy suite D's own CPU time
# takes steps past it. At margin 0 (the whole budget) the slowest admitted stream fell to
# 7.45-7.97 frames/s beside two CPU burners: no step model sees another process take the
# cores, and the delivered-rate feedback (an epoch of 8 streams' lives, ~2.5 s) corrects
# at most twice in the 6-s level.
FORWARD_PAD = "250,0"  # P: ms per forward (one prompt each: --max-batch-prompts 1): busy ~90%
REFUSAL_S = 0.050  # the bound on a refusal's answer; a wait behind one P forward is 0-250 ms
# P's RESERVE concurrency: with 8 a refusal waits for room only behind 8 granted requests
# that do; with 1 (P's default) behind the one (docs/admission.md; the variable measures it)
RESERVE_CONCURRENCY = os.environ.get("PDUNIT_TEST_RESERVE_CONCURRENCY", "8")


def unit_config() -> LocalConfig:
    return LocalConfig(
        mode="pd", model="random:tiny:0", rate_floor=FLOOR, pool_tokens=32768, cache_tokens=16384, lb_port=0,
        guard=False, log_level="info",
        extra_decode_args=["--synthetic-step-ms", STEP_PAD, "--cold-streams", str(OVERLOAD)],
        extra_prefill_args=["--synthetic-forward-ms", FORWARD_PAD, "--max-batch-prompts", "1",
                            "--reserve-concurrency", RESERVE_CONCURRENCY],
        extra_lb_args=["--retry-after-s", "1"])


def refusal_stages(unit: LocalUnit) -> list[dict[str, float]]:
    """The stage gaps (ms) of each rate-floor refusal, from the LB's 'stream failed' lines."""
    out = []
    for line in (unit.logs_dir / "lb.log").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("outcome") == "rate_floor" and "stages_ms" in rec:
            out.append(rec["stages_ms"])
    return out


def print_stages(stages: list[dict[str, float]]) -> None:
    names = sorted({k for s in stages for k in s})
    for name in names:
        gaps = sorted(s[name] for s in stages if name in s)
        p90 = gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))]
        print(f"  {name}: p50 {statistics.median(gaps):.1f} ms, p90 {p90:.1f}, max {gaps[-1]:.1f} "
              f"({len(gaps)} refusals)", flush=True)


@pytest.mark.timeout(180)
def test_a_pd_unit_refuses_at_reserve_fast_and_keeps_every_admitted_stream_at_the_floor() -> None:
    with LocalUnit(unit_config()) as unit:
        # D's step model fits its own steps (64, of two batch sizes at least) before the
        # overload: one warm level of WARM_S holds them (one of 3 s did not: a second ran)
        for _ in range(3):
            level(unit.url, WARM, FLOOR, duration=WARM_S, ramp=1.0)
            if wait_empty(unit.url, timeout=60).headroom_streams < OVERLOAD:
                break
        doc = wait_empty(unit.url, timeout=60)
        assert 0 < doc.headroom_streams < OVERLOAD, doc
        row = level(unit.url, OVERLOAD, FLOOR, duration=6.0)
        # every admitted stream at or above the floor, not one stall, no error
        assert row["ok"] > 0 and row["errors"] == 0 and row["error_kinds"] == {}, row
        assert row["stutter_share"] == 0 and row["sent_min_rate"] >= FLOOR, row
        # the rest refused: 503 rate_floor with a Retry-After each
        assert row["refused"] > 0 and row["refused_without_retry_after"] == 0, row
        refusals = refusal_seconds(unit.url)
        within = share_within(refusals, REFUSAL_S)
        stages = refusal_stages(unit)
        print(f"PD refusals (--reserve-concurrency {RESERVE_CONCURRENCY}): {within:.1%} answered within "
              f"{REFUSAL_S * 1000:.0f} ms at the LB ({refusals}); the client's p99 {row['refusal_p99_ms']:.0f} ms; "
              "stage gaps:", flush=True)
        print_stages(stages)
        assert stages, "no refusal logged its stages_ms"
        # 90%, not every one: a 2-core machine under a parallel suite lags now and then
        # (docs/admission.md); refusals behind P's 250-ms forwards miss it (before issue
        # 24's fix, 74% and 81% with these settings)
        assert within >= 0.9, (refusals, row["refusal_p99_ms"])
        # P's part: queued (-> p_taken) and waiting for room (-> p_reserve_sent) before its RESERVE
        in_p = [s.get("p_taken", 0.0) + s.get("p_reserve_sent", 0.0) for s in stages]
        assert sum(ms < REFUSAL_S * 1000 for ms in in_p) >= 0.9 * len(in_p), sorted(in_p)
        # nothing held once the streams ended, and the unit admits again
        doc = wait_empty(unit.url, timeout=60)
        assert doc.held_pages == 0, doc
        wait_for(lambda: load(unit.url).headroom_streams > 0, timeout=10, what="headroom back above 0")


def test_p_takes_a_synthetic_forward_cost_off_by_default() -> None:
    from pdunit.engine.prefill.main import PrefillConfig
    from pdunit.engine.settings import ConfigError, parse_config
    from pdunit.engine.step_pad import StepPad

    assert parse_config(PrefillConfig, ["--synthetic-forward-ms", FORWARD_PAD], "test").forward_pad() == StepPad(250.0)
    assert not parse_config(PrefillConfig, [], "test").forward_pad().on
    with pytest.raises(ConfigError, match="PER_STREAM of"):
        parse_config(PrefillConfig, ["--synthetic-forward-ms", "1,x"], "test")
