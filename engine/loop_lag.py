"""How late an asyncio event loop wakes up: the delay every task on it pays.

A process whose loop is saturated (the LB relaying thousands of frames a second, the
load generator reading them) adds that delay to every time it stamps, and nothing else
shows it. `watch_loop_lag` sleeps `period` seconds over and over and reports, each
time, how much later than asked it woke up. Owns no metric and no storage: the caller
observes (a histogram in the LB, a list in the load generator).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

PERIOD_S = 0.01


async def watch_loop_lag(observe: Callable[[float], None], period: float = PERIOD_S) -> None:
    """Runs until cancelled, calling observe(seconds late) once per `period`."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(period)
        observe(max(0.0, time.perf_counter() - t0 - period))
