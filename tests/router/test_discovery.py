"""Discovery: the static list's parsing, PDUnit status -> unit, and the list+watch loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pdunit.engine.router.config import RouterConfig, check_discovery
from pdunit.engine.router.discovery import (
    KubernetesDiscovery,
    WatchExpired,
    parse_static_units,
    unit_from_pdunit,
)
from pdunit.engine.router.table import RoutingTable


def test_static_list_parses_names_and_urls() -> None:
    units = parse_static_units(["a=http://127.0.0.1:8001", " b = http://[::1]:8002/ "])
    assert [(u.name, u.url, u.ready, u.draining) for u in units] == [
        ("a", "http://127.0.0.1:8001", True, False),
        ("b", "http://[::1]:8002", True, False),
    ]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("http://127.0.0.1:8001", "must be name=http://host:port"),
        ("a=127.0.0.1:8001", "expected http://host:port"),
        ("a=http://127.0.0.1", "without a port"),
        ("a=http://127.0.0.1:8001/v1", "with a path"),
        ("a=http://127.0.0.1:99999", "bad port"),
    ],
)
def test_bad_static_unit_names_the_item_and_the_fix(item: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_static_units([item])


def test_duplicate_static_unit_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="'a' appears twice"):
        parse_static_units(["a=http://h:1", "a=http://h:2"])


def test_discovery_flags_must_agree() -> None:
    assert "--units" in (check_discovery(RouterConfig()) or "")
    assert "--unit-set" in (check_discovery(RouterConfig(discovery="kubernetes")) or "")
    assert check_discovery(RouterConfig(units=["a=http://h:1"])) is None
    assert check_discovery(RouterConfig(discovery="kubernetes", unit_set="tts")) is None


def pdunit(name: str, **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pdunit.dev/v1alpha1",
        "kind": "PDUnit",
        "metadata": {"name": name, "labels": {"pdunit.dev/set": "tts"}, "resourceVersion": "1"},
        "status": status,
    }


def test_pdunit_status_becomes_url_and_state() -> None:
    unit = unit_from_pdunit(
        pdunit("tts-0", phase="Running", podIP="10.1.2.3", lbPort=8000, ready=True, draining=False)
    )
    assert (unit.name, unit.url, unit.ready, unit.draining, unit.phase) == (
        "tts-0",
        "http://10.1.2.3:8000",
        True,
        False,
        "Running",
    )
    assert (
        unit_from_pdunit(pdunit("v6", podIP="fd00::5", lbPort=8000)).url == "http://[fd00::5]:8000"
    )


def test_pdunit_without_address_or_being_deleted_is_not_routable() -> None:
    pending = unit_from_pdunit(pdunit("tts-1", phase="Pending"))
    assert pending.url == "" and not pending.ready
    deleting = pdunit("tts-2", podIP="10.0.0.2", lbPort=8000, ready=True)
    deleting["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    assert unit_from_pdunit(deleting).draining


class FakeKubernetes(KubernetesDiscovery):
    """The list+watch loop against scripted API answers instead of an API server."""

    def __init__(self, lists: list[list[dict[str, Any]]], watches: list[list[tuple[str, Any]]]):
        super().__init__("ns", "tts", logging.getLogger("test"), retry_s=0.0)
        self._api = object()  # never used: the two API calls are replaced below
        self.lists = lists
        self.watches = watches
        self.listed = 0

    async def list_units(self) -> tuple[list[dict[str, Any]], str]:
        self.listed += 1
        if not self.lists:
            await asyncio.Event().wait()  # the test ends the loop by cancelling
        return self.lists.pop(0), str(self.listed)

    async def watch_units(self, resource_version: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        for event in self.watches.pop(0) if self.watches else []:
            if isinstance(event, Exception):
                raise event
            yield event


@pytest.mark.anyio
async def test_list_then_watch_keeps_the_table_equal_to_the_cluster() -> None:
    a = pdunit("a", podIP="10.0.0.1", lbPort=8000, ready=True)
    b = pdunit("b", podIP="10.0.0.2", lbPort=8000, ready=True)
    b_draining = pdunit("b", podIP="10.0.0.2", lbPort=8000, ready=True, draining=True)
    c = pdunit("c", podIP="10.0.0.3", lbPort=8000, ready=False)
    discovery = FakeKubernetes(
        lists=[[a, b], [a, c]],
        watches=[
            [("MODIFIED", b_draining), ("ADDED", c), ("DELETED", a), ("ERROR", {"code": 410})],
            [],
        ],
    )
    table = RoutingTable()
    task = asyncio.create_task(discovery.run(table))
    for _ in range(200):
        if discovery.listed >= 3:
            break
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # After the watch expired (410) the relist replaced the table: a, c; b gone.
    assert set(table.units) == {"a", "c"}
    assert table.units["c"].discovered_ready is False


def test_watch_error_event_means_relist() -> None:
    discovery = FakeKubernetes([], [])
    with pytest.raises(WatchExpired, match="410"):
        discovery.apply_event(RoutingTable(), "ERROR", {"code": 410, "message": "too old"})


@pytest.mark.anyio
async def test_watch_events_apply_in_order() -> None:
    a = pdunit("a", podIP="10.0.0.1", lbPort=8000, ready=True)
    a_draining = pdunit("a", podIP="10.0.0.1", lbPort=8000, ready=True, draining=True)
    discovery = FakeKubernetes(lists=[[]], watches=[[("ADDED", a), ("MODIFIED", a_draining)]])
    table = RoutingTable()
    await discovery.sync_once(table)
    assert table.units["a"].discovered_draining is True


@pytest.mark.anyio
async def test_api_failure_keeps_known_units_and_retries(caplog: pytest.LogCaptureFixture) -> None:
    a = pdunit("a", podIP="10.0.0.1", lbPort=8000, ready=True)
    discovery = FakeKubernetes(
        lists=[[a], [a]], watches=[[ConnectionResetError("api server went away")], []]
    )
    table = RoutingTable()
    with caplog.at_level(logging.WARNING):
        task = asyncio.create_task(discovery.run(table))
        for _ in range(200):
            if discovery.listed >= 3:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert "a" in table.units
    assert any("list/watch failed" in r.getMessage() for r in caplog.records)
