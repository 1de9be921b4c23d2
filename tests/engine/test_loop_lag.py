"""The event-loop lag watch: a loop blocked by a task shows as lag, an idle one does not."""

from __future__ import annotations

import asyncio
import time

from pdunit.engine.loop_lag import watch_loop_lag


def test_a_blocked_loop_shows_its_delay_and_an_idle_one_little():
    async def main() -> tuple[list[float], list[float]]:
        idle: list[float] = []
        watch = asyncio.ensure_future(watch_loop_lag(idle.append, period=0.005))
        await asyncio.sleep(0.1)
        watch.cancel()
        blocked: list[float] = []
        watch = asyncio.ensure_future(watch_loop_lag(blocked.append, period=0.005))
        await asyncio.sleep(0.02)
        time.sleep(0.08)  # a task that holds the loop: everything waiting on it is late
        await asyncio.sleep(0.02)
        watch.cancel()
        return idle, blocked

    idle, blocked = asyncio.run(main())
    assert len(idle) >= 5 and all(x >= 0 for x in idle)
    assert max(blocked) >= 0.06 > sorted(idle)[len(idle) // 2]
