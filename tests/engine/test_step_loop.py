"""StepLoop: sleeps between idle iterations unless its stage blocks on its own queue
(P's three stages: a second sleep there held each request up to 50 ms per stage)."""

from __future__ import annotations

import threading
import time

from pdunit.engine.step_loop import StepLoop
from tests.engine.test_prefill_pipeline import engine  # noqa: F401  (the fixture)


def calls_within(loop_kw: dict, seconds: float) -> int:
    calls: list[float] = []
    enough = threading.Event()

    def idle_step() -> bool:
        calls.append(time.monotonic())
        if len(calls) >= 200:
            enough.set()
        return False

    loop = StepLoop("test", idle_step, "cpu", **loop_kw)
    loop.start()
    enough.wait(seconds)
    loop.stop()
    return len(calls)


def test_an_idle_loop_sleeps_between_iterations():
    assert 1 <= calls_within({}, 0.3) <= 8  # one 50-ms sleep per idle iteration


def test_a_loop_whose_stage_waits_on_its_own_queue_does_not_sleep_again():
    assert calls_within({"idle_wait": False}, 2.0) >= 200  # 200 iterations would take 10 s with the sleep


def test_ps_stages_never_sleep_in_their_loop(engine):  # noqa: F811
    e, _, _ = engine
    assert e.pipeline.loops and all(not loop._idle_wait for loop in e.pipeline.loops)
