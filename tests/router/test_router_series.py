"""The router's `unit`-labelled series leave with the unit (issue 28): unit names change
at every scale event and rollout, so series of departed units must not pile up."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pdunit.engine.router.app import create_app
from pdunit.engine.router.config import RouterConfig
from pdunit.engine.router.table import DiscoveredUnit, RoutingTable
from tests.router.routerkit import FakeUnit, key_owned_by, read_stream, run_units, serve

pytestmark = pytest.mark.anyio


class ScalingDiscovery:
    """Discovery whose unit list the test changes, as the PDUnit watch does at a scale event."""

    def __init__(self, units: dict[str, str]) -> None:
        self.units = units
        self.changed = asyncio.Event()

    def scale_to(self, units: dict[str, str]) -> None:
        self.units = units
        self.changed.set()

    async def run(self, table: RoutingTable) -> None:
        while True:
            self.changed.clear()
            table.replace_all([DiscoveredUnit(n, u) for n, u in self.units.items()])
            await self.changed.wait()


def units_in_series(text: str) -> set[str]:
    return set(re.findall(r'unit="([^"]+)"', text)) - {""}


async def wait_for(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    assert predicate(), "condition not reached in time"


async def test_scraping_through_a_scale_event_shows_no_series_of_departed_units() -> None:
    old = [FakeUnit(f"set-{s}", frames=1, frame_delay_s=0) for s in ("a1", "b2")]
    new = [FakeUnit(f"set-{s}", frames=1, frame_delay_s=0) for s in ("c3", "d4")]
    lingering = FakeUnit("set-e5", frames=2, frame_delay_s=0)
    old[1].refuse_with = 429  # a retry series for a departing unit too
    async with run_units(*old, *new, lingering) as served:
        urls = {n: s.url for n, s in served.items()}
        discovery = ScalingDiscovery({n: urls[n] for n in ("set-a1", "set-b2", "set-e5")})
        config = RouterConfig(units=[], poll_interval_s=0.05, poll_timeout_s=0.5)
        app = create_app(config, discovery, registry=CollectorRegistry())
        async with serve(app, limits=config) as router, httpx.AsyncClient() as client:
            table: RoutingTable = app.state.router.table
            await wait_for(lambda: table.routable_count() == 3)
            for i in range(6):
                await read_stream(client, router.url, session=f"s{i}")
            # A stream to set-e5 stays open across the scale event.
            key = key_owned_by(table, "set-e5")
            await read_stream(client, router.url, session=key)  # one finished: a series
            release = lingering.hold = asyncio.Event()
            held = asyncio.create_task(read_stream(client, router.url, session=key))
            await wait_for(lambda: lingering.in_flight == 1)
            before = units_in_series((await client.get(router.url + "/metrics")).text)
            assert {"set-a1", "set-b2"} <= before

            discovery.scale_to({n: urls[n] for n in ("set-c3", "set-d4")})
            await wait_for(lambda: set(table.units) == {"set-c3", "set-d4"})
            await wait_for(lambda: table.routable_count() == 2)
            for i in range(6):
                status, _, _ = await read_stream(client, router.url, session=f"s{i}")
                assert status == 200
            during = units_in_series((await client.get(router.url + "/metrics")).text)
            assert during & {"set-a1", "set-b2"} == set()
            # set-e5's stream is still open: its series stay until it ends, then leave.
            assert "set-e5" in during
            release.set()
            status, _, headers = await held
            assert status == 200 and headers["x-pdunit-unit"] == "set-e5"
            after = units_in_series((await client.get(router.url + "/metrics")).text)
    assert after == {"set-c3", "set-d4"}, after
