"""What one headroom computation of the prefill-first monolith costs on this CPU
(`AdmissionControl.headroom` over `PendingPrefills`: the worst-step search, then the
whole-life search), at several held sets: streams decoding at random points of their
lives, some near the floor, with prompts in a prefill step now and queued. A timing
probe, not a test: it prints the first call's ms, the median of the calls after it
(wall, and this process's CPU) and the headroom found.
  python -m pdunit.bench.headroom_cost [STREAMS ...]  (default 60 150 300)"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from pdunit.engine.decode.admission import AdmissionControl, RateFloorAdmission
from pdunit.engine.decode.step_model import StepCoefficients, StepModel
from pdunit.engine.decode.stream_lives import HeldStream, PendingPrefills

# An H100-like step (base, per stream, per context token, per prompt row), a 42-frame/s
# floor, typical prompts of 1500 rows and 420 frames, 8192-row prefill steps.
COEF = StepCoefficients(3.23, 0.0061, 0.000016, 0.01)
FLOOR_FPS, TYPICAL, STEP_ROWS = 42.0, HeldStream(1500, 420), 8192


def held_set(streams: int, pending: int, rng: np.random.Generator) -> PendingPrefills:
    """`streams` decoding, each at a random frame of 420 and delivered at 0.9-1.6x the
    floor so far; `pending` prompts, a third in a prefill step now, the rest queued."""
    decoding = []
    for _ in range(streams):
        out = int(rng.integers(1, 420))
        elapsed = (out - 1) / (FLOOR_FPS * float(rng.uniform(0.9, 1.6))) * 1000
        decoding.append(HeldStream(1500 + out, 420 - out, frames_out=out, elapsed_ms=elapsed))
    in_step = tuple(TYPICAL for _ in range(pending // 3))
    unplanned = tuple(TYPICAL for _ in range(pending - len(in_step)))
    return PendingPrefills(tuple(decoding), in_step, unplanned, 1500 * len(in_step), 1500 * len(unplanned),
                           STEP_ROWS)


def probe(streams: int, pending: int, calls: int = 100) -> tuple[float, float, float, int, int]:
    """(the first call's ms, the median ms of `calls` more and their median CPU ms of this
    process, the headroom, the worst step's count alone). The first call starts cold; the
    others start from the count before (`AdmissionControl`'s hint), as an engine's do
    while its held set changes little."""
    ctl = AdmissionControl(RateFloorAdmission(StepModel(COEF, fixed=True), FLOOR_FPS), TYPICAL)
    pending_prefills = held_set(streams, pending, np.random.default_rng(streams))
    t0 = time.perf_counter()
    room = ctl.headroom(pending_prefills)
    first = (time.perf_counter() - t0) * 1000
    times, cpu = [], []
    for _ in range(calls):
        t0, c0 = time.perf_counter(), time.process_time()
        assert ctl.headroom(pending_prefills) == room
        times.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    held = [*pending_prefills.waiting_all, *pending_prefills.in_step, *pending_prefills.unplanned]
    steps_room = ctl.admission.headroom(held, TYPICAL)
    return first, statistics.median(times), statistics.median(cpu), room, steps_room


def main(argv: list[str]) -> None:
    for streams in [int(a) for a in argv] or [60, 150, 300]:
        for pending in (0, 4, 10, 20):
            first, med, cpu, room, steps_room = probe(streams, pending)
            print(f"{streams:4d} decoding, {pending:2d} prompts pending: first {first:5.2f} ms, then {med:5.2f} ms "
                  f"median ({cpu:.2f} CPU); "
                  f"headroom {room} (the worst step alone: {steps_room})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
