"""The overload of issue 24, on CPU with the tiny model: many closed-loop streams on one
unit. Without admission every stream is admitted and all of them fall under the
floor; with rate-floor admission the unit refuses instead (503 + Retry-After,
`rate_floor`), every admitted stream keeps the floor without a stall, nothing stays
held, and the frames/s of the streams that met the floor (goodput) is higher than
without admission.

The steps cost what the test says: the monolith pads each step to a synthetic cost
(`--synthetic-step-ms`, engine/step_pad.py: BASE + PER_STREAM x streams + PER_ROW x
prompt rows ms), several times the tiny model's own CPU time at the batches admission
keeps (6-10 ms a decode step at 1-16 streams on the shared 2-core machine, moving 2-3x,
at worst 6x, as other work takes the cores; a prefill step of a few prompts as much as
the pad's base). A step's time is then a function of its batch whatever the machine's
load, the admission's step model learns it online from the engine's own steps (no fit
file; decode and prefill terms), and what this test judges is admission, not the
machine's weather. The unit is the monolith, prefill-first (the `pdunit local`
default): its prefill steps stall the decoding streams, which the projection charges
only by their rows (not a prefill step's base), so the margin keeps a fifth of the
budget free (--floor-margin 0.2).

The floor is measured, not assumed: the rate two streams reach and the overload's p50
rate without admission, and the floor between them (their geometric mean). Playback is
judged at half the floor (the floor is twice the codec's frame rate). The admission
unit warms up on a few staggered streams first, so that it judges by a step model
fitted from its own steps of several batch sizes; its cold-start limit is raised to the
overload (--cold-streams), so that the projection alone decides who is admitted: an
admission that admits too many fails here, not only one that is off. The best fixed
concurrency (the most streams whose step keeps the floor, on the line through the two
measured rates) is run too and its goodput printed beside admission's, not judged:
admission keeps its margin free and charges a prompt's rows to every step, a fixed
concurrency at the edge does neither (issue 24 asks for parity; not met).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import pytest

from pdunit.bench.capacity import run_capacity
from pdunit.engine.decode.main import DecodeConfig
from pdunit.engine.lb.load import LoadDocument
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.monolith.main import MonolithConfig
from pdunit.engine.settings import parse_config
from pdunit.engine.step_pad import SYNTHETIC_STEP_MS, StepPad, parse_step_pad
from tests.engine.unit_client import load, wait_empty, wait_for

OVERLOAD = 16  # closed-loop streams: three times and more what admission keeps at the floor below
FEW = 2  # streams a floor must be sustainable for
WARM = 4  # staggered streams the admission unit fits its step model on
FRAMES = 30  # short streams: a stream lives about one level
LEVEL_S = 3.0
STEP_PAD = "60,7.5,0.375"  # ms: 60 + 7.5 x streams + 0.375 x prompt rows (75 ms at 2 streams, 180 at 16)
UNIT = dict(mode="monolith", model="random:tiny:0",
            extra_monolith_args=["--synthetic-step-ms", STEP_PAD, "--floor-margin", "0.2", "--cold-streams",
                                 str(OVERLOAD)],
            pool_tokens=32768, cache_tokens=16384, lb_port=0, guard=False, log_level="warning")


def level(url: str, concurrency: int, floor: float, duration: float = LEVEL_S, ramp: float = 0.0) -> dict[str, Any]:
    """One closed-loop level judged against `floor`: its capacity row."""
    doc = run_capacity(dict(url=url, concurrency=[concurrency], duration=duration, prompt_rows=(40, 80),
                            frames=(FRAMES, FRAMES), voices=4, progress=False, min_rate=floor, fps=floor / 2,
                            ttfa_p95_ms=60_000, mode_label="monolith", gpus=0, drain_timeout=60, ramp=ramp),
                       keep_streams=True)
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


def best_fixed_concurrency(few: float, over: float, floor: float) -> int:
    """The most streams whose step keeps `floor`, on the line through the two measured
    step times (1 / rate at FEW and at OVERLOAD streams)."""
    per_stream = (1 / over - 1 / few) / (OVERLOAD - FEW)
    return max(FEW, FEW + math.floor((1 / floor - 1 / few) / per_stream))


@pytest.fixture(scope="module")
def without_admission():
    """The floor this machine sets, the overload without admission, and the best fixed concurrency."""
    with LocalUnit(LocalConfig(rate_floor=0, **UNIT)) as unit:
        few = level(unit.url, FEW, 1.0)
        over = level(unit.url, OVERLOAD, 1.0)
        floor = round(math.sqrt(few["min_rate"] * over["p50_rate"]), 1)
        # the overload's goodput judged at that floor: its frames/s of streams at or above it
        over["goodput_at_floor"] = sum(s["frames"] for s in over["streams"] if s["rate"] is not None
                                       and s["rate"] >= floor and not s["stalls"]) / over["elapsed_s"]
        print(f"floor {floor:.1f} frames/s: {FEW} streams reach {few['min_rate']:.1f}, "
              f"{OVERLOAD} streams {over['p50_rate']:.1f} at p50", flush=True)
        fixed = level(unit.url, best_fixed_concurrency(few["p50_rate"], over["p50_rate"], floor), floor)
        empty(unit.url)
    return floor, over, fixed


def test_overload_refuses_instead_of_letting_every_stream_fall_under_the_floor(without_admission) -> None:
    floor, over, fixed = without_admission
    over_goodput = over["goodput_at_floor"]
    # without admission: all admitted, none refused, and the overload breaks the floor
    assert over["refused"] == 0 and over["errors"] == 0, over
    assert over["min_rate"] < floor, (over, floor)
    # refused clients come back after 3 s, not 1: fewer refusals to answer on two cores
    with LocalUnit(LocalConfig(rate_floor=floor, extra_lb_args=["--retry-after-s", "3"], **UNIT)) as unit:
        # the step model fits the engine's own steps (64 of them, of two batch sizes at least):
        # then the projection, not the cold-start limit, bounds the headroom of an empty unit
        for _ in range(3):
            level(unit.url, WARM, floor, ramp=1.0)
            if empty(unit.url).headroom_streams < OVERLOAD:
                break
        doc = empty(unit.url)
        assert 0 < doc.headroom_streams < OVERLOAD, (
            f"an empty unit's headroom is {doc.headroom_streams}: admission off (-1), or a step model that has "
            f"not fitted the engine's steps or would admit the whole overload of {OVERLOAD} ({doc})")
        row = level(unit.url, OVERLOAD, floor)
        # every admitted stream at or above the floor, and not one stall
        assert row["ok"] > 0 and row["errors"] == 0 and row["error_kinds"] == {}, row
        assert row["stutter_share"] == 0 and row["min_rate"] >= floor, row
        # the rest refused: each a 503 rate_floor (the reason) with a Retry-After
        assert row["refused"] > 0 and row["refused_without_retry_after"] == 0, row
        # how fast refusals came back (a benchmark's figure, not judged here: see bench compare)
        print(f"refusals answered in {row['refusal_p99_ms']:.0f} ms at p99", flush=True)
        # nothing held once the streams ended, and the unit admits again (its headroom
        # comes back: read from the LB's probes, one may still carry a full unit's 0)
        doc = empty(unit.url)
        assert doc.held_pages == 0, doc
        wait_for(lambda: load(unit.url).headroom_streams > 0, timeout=10, what="headroom back above 0")
    # goodput: refusing beats letting everyone in, at the same overload
    assert row["goodput_fps"] > over_goodput, (row["goodput_fps"], over_goodput)
    # against the best fixed concurrency: reported, not judged (see the module docstring)
    print(f"goodput {row['goodput_fps']:.0f} frames/s with admission, {fixed['goodput_fps']:.0f} at the best "
          f"fixed concurrency {fixed['concurrency']} (floor kept: {met_floor(fixed)})", flush=True)


def test_synthetic_step_pad_sleeps_a_step_to_its_cost_and_never_shortens_one() -> None:
    pad = StepPad(30.0, 5.0)
    t0 = time.perf_counter()
    pad.wait(t0, 2)
    assert time.perf_counter() - t0 >= 0.040
    t0 = time.perf_counter()
    pad.wait(t0 - 1.0, 2)  # a step already longer than its pad
    StepPad().wait(t0, 100)  # off
    pad.wait(t0, 0)  # an idle iteration
    assert time.perf_counter() - t0 < 0.030


def test_synthetic_step_pad_parses_its_terms_and_exports_them() -> None:
    assert parse_step_pad("") == StepPad() and not StepPad().on
    assert parse_step_pad(STEP_PAD) == StepPad(60.0, 7.5, 0.375) and StepPad(60.0, 7.5).ms(16) == 180.0
    assert parse_step_pad("1,0,0.5").ms(2, rows=10) == 6.0
    for bad, says in (("20", "BASE,PER_STREAM"), ("20,x", "PER_STREAM of"), ("1,2,-1", "PER_ROW of"),
                      ("1,2,3,4", "4 terms"), ("nan,1", "BASE of")):
        with pytest.raises(ValueError, match=says):
            parse_step_pad(bad)
    for config in (DecodeConfig, MonolithConfig):  # both engines that decode take the flag; off by default
        assert parse_config(config, ["--synthetic-step-ms", STEP_PAD], "test").step_pad() == StepPad(60.0, 7.5, 0.375)
        assert not parse_config(config, [], "test").step_pad().on
    StepPad(20.0, 2.5).export(logging.getLogger("test"))
    assert SYNTHETIC_STEP_MS.labels(term="per_stream_ms")._value.get() == 2.5
    StepPad().export(logging.getLogger("test"))
    assert SYNTHETIC_STEP_MS.labels(term="base_ms")._value.get() == 0.0
