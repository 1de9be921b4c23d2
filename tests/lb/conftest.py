"""Fixtures: a background event loop, a fake unit (P + D), and an LB served by uvicorn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from pdunit.engine.lb.balancer import LoadBalancer
from pdunit.engine.lb.config import LBConfig
from pdunit.engine.lb.main import admin_token, build_servers
from tests.lb.fakes import FakeUnit, LoopThread


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def fake_unit(loop_thread: LoopThread, short_dir: str) -> Iterator[FakeUnit]:
    unit = FakeUnit(short_dir)
    loop_thread.run(unit.start())
    yield unit
    loop_thread.run(unit.stop())


@dataclass
class RunningLB:
    lb: LoadBalancer
    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]
    admin_url: str = ""
    admin_server: uvicorn.Server | None = None
    admin_task: asyncio.Task[None] | None = None

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 10.0), **kw)

    def admin(self, **kw: Any) -> httpx.Client:
        """A client of the admin port (POST /v1/admin/drain)."""
        return httpx.Client(base_url=self.admin_url, timeout=kw.pop("timeout", 10.0), **kw)


def wait_until(
    predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition"
) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def start_lb(loop_thread: LoopThread, fake_unit: FakeUnit) -> Iterator[Callable[..., RunningLB]]:
    running: list[RunningLB] = []

    def start(wait_ready: bool = True, **overrides: Any) -> RunningLB:
        fields = {
            "host": "127.0.0.1",
            "port": 0,
            "admin_port": 0,
            "prefill_socket": fake_unit.prefill_socket,
            "decode_socket": fake_unit.decode_socket,
            "unit_name": "test-unit",
            "probe_interval_s": 0.2,
            "load_cache_ms": 0,
        }
        fields.update(overrides)
        config = LBConfig(**fields)

        async def boot() -> RunningLB:
            # the servers `pdunit lb` runs: the stream and admin ports behind the edge's limits
            lb = LoadBalancer(config, registry=CollectorRegistry())
            servers = build_servers(config, lb, admin_token(config))
            task, admin_task = await servers.run()
            for t in (task, admin_task):
                if t.done():
                    t.result()
            return RunningLB(
                lb, f"http://127.0.0.1:{servers.port}", servers.stream, task,
                f"http://{config.admin_host}:{servers.admin_port}", servers.admin, admin_task,
            )

        r = loop_thread.run(boot())
        running.append(r)
        if wait_ready:
            with r.client() as c:
                wait_until(lambda: c.get("/readyz").status_code == 200, what="LB ready")
        return r

    yield start

    async def shutdown(r: RunningLB) -> None:
        if r.admin_server is not None and r.admin_task is not None:
            r.admin_server.should_exit = True
            await asyncio.wait_for(r.admin_task, 10)
        r.server.should_exit = True
        await asyncio.wait_for(r.task, 10)

    for r in running:
        loop_thread.run(shutdown(r))
