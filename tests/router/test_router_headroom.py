"""Rate-floor headroom in the routing decision (issue 24): a unit whose `/v1/load` says it
would admit no more streams is skipped before the first byte while another has room."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pdunit.bench.scaler_bench import fake_load_document
from pdunit.engine.router.table import DiscoveredUnit, RoutingTable
from tests.router.routerkit import (
    FakeUnit,
    key_owned_by,
    poll_answer,
    read_stream,
    run_router,
    run_units,
)

pytestmark = pytest.mark.anyio


class HeadroomUnit(FakeUnit):
    """A fake unit whose load document carries `headroom_streams` (None: the field is absent,
    as from a unit without rate-floor admission)."""

    def __init__(self, name: str, headroom: int | None, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.headroom = headroom

    def load_doc(self) -> dict[str, Any]:
        doc = super().load_doc()
        if self.headroom is not None:
            doc["headroom_streams"] = self.headroom
        return doc


async def polled(table: RoutingTable, name: str, headroom: int | None, in_flight: int = 0) -> None:
    table.upsert(DiscoveredUnit(name, f"http://{name}:8000"))
    doc = fake_load_document(name, streams_in_flight=in_flight, headroom_streams=headroom)
    await poll_answer(table, name, doc)  # headroom None: the field is absent


async def test_a_unit_without_headroom_is_skipped_before_the_first_byte() -> None:
    full = HeadroomUnit("full", headroom=0, frames=1, frame_delay_s=0)
    roomy = HeadroomUnit("roomy", headroom=5, frames=1, frame_delay_s=0)
    async with run_units(full, roomy) as served:
        async with run_router({n: s.url for n, s in served.items()}) as router:
            key = key_owned_by(router.table, "full")  # the session's ring owner has no room
            async with httpx.AsyncClient() as client:
                for _ in range(3):
                    status, lines, headers = await read_stream(client, router.url, session=key)
                    assert status == 200 and lines[-1]["done"]
                    assert headers["x-pdunit-unit"] == "roomy"
                for _ in range(4):  # keyless streams too
                    status, _, headers = await read_stream(client, router.url)
                    assert status == 200 and headers["x-pdunit-unit"] == "roomy"
                doc = (await client.get(router.url + "/v1/units")).json()
    # Not refused and retried: the unit without room never saw a request.
    assert full.headers == [] and roomy.starts == 7
    by_name = {u["name"]: u for u in doc["units"]}
    assert by_name["full"]["headroom_streams"] == 0 and by_name["full"]["routable"]
    assert doc["units_with_headroom"] == 1


async def test_headroom_counts_the_streams_this_router_opened_since_the_poll() -> None:
    table = RoutingTable()
    await polled(table, "a", headroom=2)
    await polled(table, "b", headroom=-1, in_flight=50)  # admission off: no limit, but loaded
    a, b = table.units["a"], table.units["b"]
    picks = []
    for _ in range(2):
        decision = table.pick(None)
        assert decision is not None
        picks.append(decision.unit.name)
        table.acquire(decision.unit)
    assert picks == ["a", "a"] and a.headroom == 0
    # a's room is used up by our own streams: the next goes to b despite its load.
    decision = table.pick(None)
    assert decision is not None and decision.unit is b and decision.how == "least_loaded"
    table.release(a)
    assert a.headroom == 1
    decision = table.pick(None)
    assert decision is not None and decision.unit is a
    assert table.total_load() == sum(u.load for u in (a, b))  # kept exact across the moves


async def test_when_no_unit_has_headroom_the_least_loaded_is_tried_and_its_d_decides() -> None:
    table = RoutingTable()
    await polled(table, "a", headroom=0, in_flight=3)
    await polled(table, "b", headroom=0, in_flight=1)
    decision = table.pick("voice-1")
    assert decision is not None and decision.unit.name == "b" and decision.how == "no_headroom"
    assert table.pick("voice-1", exclude=frozenset({"a", "b"})) is None


async def test_a_load_document_without_headroom_means_no_limit() -> None:
    table = RoutingTable()
    await polled(table, "old", headroom=None)
    assert table.units["old"].headroom == -1
    table.acquire(table.units["old"])
    assert table.units["old"].headroom == -1
    decision = table.pick("voice")
    assert decision is not None and decision.unit.name == "old" and decision.how == "affinity"


async def test_a_bad_headroom_value_is_a_poll_error_naming_the_field() -> None:
    table = RoutingTable()
    table.upsert(DiscoveredUnit("a", "http://a:8000"))
    await poll_answer(table, "a", fake_load_document("a", headroom_streams="lots"))
    assert table.units["a"].state == "unreachable"
    assert "lots" in table.units["a"].last_error


async def test_headroom_is_exported_per_unit() -> None:
    unit = HeadroomUnit("a", headroom=7, frames=1, frame_delay_s=0)
    async with run_units(unit) as served, run_router({"a": served["a"].url}) as router:
        async with httpx.AsyncClient() as client:
            text = (await client.get(router.url + "/metrics")).text
    assert 'pdunit_router_unit_headroom_streams{unit="a"} 7.0' in text
