"""A closed-loop client refused with Retry-After (engine/loadgen/driver.py `run_level`)
comes back after it, but never waits past its level's end: a level's wall time is its
duration plus the drain of streams in flight, not a refused client's last Retry-After."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdunit.engine.loadgen import driver
from pdunit.engine.loadgen.driver import LoadConfig, _Progress, run_level
from pdunit.engine.loadgen.workload import Workload, WorkloadConfig

RETRY_AFTER_S = 30


def refusing_lb(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503, headers={"retry-after": str(RETRY_AFTER_S)},
                          json={"error": {"code": "rate_floor", "message": "full"}})


def test_a_refused_client_sleeps_at_most_to_its_levels_end(monkeypatch: pytest.MonkeyPatch) -> None:
    real_sleep = asyncio.sleep
    slept: list[float] = []

    async def recorded(delay: float, *args: object) -> object:
        slept.append(delay)
        return await real_sleep(delay, *args)

    monkeypatch.setattr(driver.asyncio, "sleep", recorded)
    cfg = LoadConfig.model_validate(dict(url="http://lb.test", concurrency=[2], duration=0.6, warmup=0.0,
                                         progress=False, gpus=0))
    workload = Workload(WorkloadConfig(n_codebooks=2, vocab_sizes=(8, 8), prompt_rows=(2, 3), frames=(2, 2)))

    async def level() -> list[driver.StreamResult]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(refusing_lb)) as client:
            return await run_level(client, cfg, workload, _Progress(False, 1, cfg.duration, 0), concurrency=2)

    results = asyncio.run(level())
    refused = [r for r in results if r.refused]
    assert refused and all(r.retry_after == str(RETRY_AFTER_S) for r in refused)
    assert len(refused) == len(results)  # every request refused, none cut or errored
    # each client asked once, then slept to the level's end instead of the 30 s it was told
    assert max(slept) <= cfg.duration, slept
