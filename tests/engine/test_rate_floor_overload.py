"""The overload of issue 24, on CPU with the tiny model: many closed-loop streams on one
unit. Without admission every stream is admitted and all of them fall under the
floor; with rate-floor admission the unit refuses instead (503 + Retry-After,
`rate_floor`), every admitted stream keeps the floor without a stall, nothing stays
held, and the frames/s of the streams that met the floor (goodput) is higher than
without admission. The best fixed concurrency's goodput (a sweep without admission) is
printed beside it, not judged: with the margin this machine needs, admission holds
fewer streams than the best fixed concurrency (issue 24 asks for parity; not met yet). The unit is the monolith (prefill-first, whose prefill
steps stall its decoding streams: the projection carries its recent prompt rows per
step), and its admission shrinks the budget by the model's typical error
(--floor-error-quantile 0.5) and keeps a quarter of it free (--floor-margin 0.25): a
shared CPU's steps jitter (their p90 would refuse nearly everything), and the load
generator and the LB take the same two cores as the steps.

The floor is this machine's, measured first (a slow or loaded machine must not fail
the test, only a stream that admission let fall under the floor can): the overload's
p50 rate without admission and the rate a few streams reach, and the floor between
them (their geometric mean, at most 1.25 x the overload's: the tiny model's CPU step
is mostly fixed cost, and a floor near what two streams reach leaves no room). Playback is judged at half the floor (the floor is twice
the codec's frame rate). The admission unit warms up on two streams first, so that it
judges by a step model fitted from its own steps, not by its cold-start limit.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from pdunit.bench.capacity import run_capacity
from pdunit.engine.lb.load import LoadDocument
from pdunit.engine.local import LocalConfig, LocalUnit
from tests.engine.unit_client import load, wait_empty

OVERLOAD = 48  # closed-loop streams: the issue's `pdunit local --load-streams 48`
FEW = 2  # streams a floor must be sustainable for
SWEEP = (4, 8, 16, 32)  # fixed concurrencies without admission, below the overload
FRAMES = 100  # short streams, but long enough that one hiccup of a shared machine is not a stream's rate
LEVEL_S = 4.0
UNIT = dict(mode="monolith", model="random:tiny:0", extra_monolith_args=["--floor-error-quantile", "0.5",
                                                                         "--floor-margin", "0.25"],
            pool_tokens=32768, cache_tokens=16384, lb_port=0, guard=False, log_level="warning")


def level(url: str, concurrency: int, floor: float, duration: float = LEVEL_S) -> dict[str, Any]:
    """One closed-loop level judged against `floor`: its capacity row."""
    doc = run_capacity(dict(url=url, concurrency=[concurrency], duration=duration, prompt_rows=(40, 80),
                            frames=(FRAMES, FRAMES), voices=4, progress=False, min_rate=floor, fps=floor / 2,
                            ttfa_p95_ms=60_000, mode_label="monolith", gpus=0, drain_timeout=60), keep_streams=True)
    row = {**doc["rows"][0], "streams": doc["streams"]}
    print(f"c={concurrency} floor={floor:.1f}: " + ", ".join(
        f"{k}={row[k]:.3g}" if isinstance(row[k], float) else f"{k}={row[k]}"
        for k in ("ok", "refused", "errors", "stutter_share", "min_rate", "p50_rate", "goodput_fps",
                  "refusal_p99_ms", "ttft_p50_ms", "ttfa_p95_ms", "passed", "error_kinds")), flush=True)
    return row


def met_floor(row: dict[str, Any]) -> bool:
    """Every served stream at or above the floor, no stall, no error."""
    return bool(row["ok"] and row["errors"] == 0 and row["stutter_share"] == 0 and row["min_rate"] is not None
                and row["passed"])


def empty(url: str) -> LoadDocument:
    wait_empty(url, timeout=60, what="the unit empty")
    return load(url)


@pytest.fixture(scope="module")
def without_admission():
    """The floor this machine sets, the overload without admission, and the fixed-concurrency sweep."""
    with LocalUnit(LocalConfig(rate_floor=0, **UNIT)) as unit:
        level(unit.url, FEW, 1.0, duration=2.0)  # warm: the first steps of a fresh unit are slow
        few = level(unit.url, FEW, 1.0)
        over = level(unit.url, OVERLOAD, 1.0)
        floor = min(math.sqrt(few["min_rate"] * over["p50_rate"]), 1.25 * over["p50_rate"])
        # the overload's goodput judged at that floor: its frames/s of streams at or above it
        over["goodput_at_floor"] = sum(s["frames"] for s in over["streams"] if s["rate"] is not None
                                       and s["rate"] >= floor and not s["stalls"]) / over["elapsed_s"]
        print(f"floor {floor:.1f} frames/s: {FEW} streams reach {few['min_rate']:.1f}, "
              f"{OVERLOAD} streams {over['p50_rate']:.1f} at p50", flush=True)
        sweep = {}
        for c in SWEEP:
            sweep[c] = level(unit.url, c, floor)
            if not met_floor(sweep[c]):
                break
        empty(unit.url)
    return floor, over, sweep


# Not in `make test` yet: on the shared 2-core machine it passed 1 of 2 runs in this form
# (and 1 of 4 in earlier ones); each failure was an admitted stream 5-25% under the floor
# while other work took the cores mid-level (their speed moved 2-3x between this test's
# own levels).
@pytest.mark.slow
def test_overload_refuses_instead_of_letting_every_stream_fall_under_the_floor(without_admission) -> None:
    floor, over, sweep = without_admission
    over_goodput = over["goodput_at_floor"]
    # without admission: all admitted, none refused, and the overload breaks the floor
    assert over["refused"] == 0 and over["errors"] == 0, over
    assert over["min_rate"] < floor, (over, floor)
    passing = {c: row for c, row in sweep.items() if met_floor(row)}
    best = max(passing.values(), key=lambda r: r["goodput_fps"]) if passing else None
    # refused clients come back after 3 s, not 1: on two cores, 40 refusals a second (the
    # LB's and the monolith's share of each) slowed the admitted streams by half
    with LocalUnit(LocalConfig(rate_floor=round(floor, 1), extra_lb_args=["--retry-after-s", "3"], **UNIT)) as unit:
        level(unit.url, FEW, floor, duration=2.0)  # the step model fits D's own steps
        row = level(unit.url, OVERLOAD, floor)
        # every admitted stream at or above the floor, and not one stall
        assert row["ok"] > 0 and row["errors"] == 0 and row["error_kinds"] == {}, row
        assert row["stutter_share"] == 0 and row["min_rate"] >= floor, row
        # the rest refused: each a 503 rate_floor (the reason) with a Retry-After
        assert row["refused"] > 0 and row["refused_without_retry_after"] == 0, row
        # how fast refusals came back (a benchmark's figure, not judged here: see bench compare)
        print(f"refusals answered in {row['refusal_p99_ms']:.0f} ms at p99", flush=True)
        # nothing held once the streams ended, and the unit admits again
        doc = empty(unit.url)
        assert doc.held_pages == 0 and doc.headroom_streams > 0, doc
    # goodput: refusing beats letting everyone in, at the same overload
    assert row["goodput_fps"] > over_goodput, (row["goodput_fps"], over_goodput)
    # against the best fixed concurrency that kept the floor: reported, not judged (see the module docstring)
    if best is not None:
        print(f"goodput {row['goodput_fps']:.0f} frames/s with admission, {best['goodput_fps']:.0f} at the best "
              f"fixed concurrency {best['concurrency']}", flush=True)
