"""The routing table and decision, fed by hand (no network)."""

from __future__ import annotations

import logging
import random

import pytest

from pdunit.bench.scaler_bench import fake_load_document
from pdunit.engine.router.table import DiscoveredUnit, RoutingTable
from tests.router.routerkit import poll_answer


def table_of(n: int, in_flight: int = 0, c: float = 1.25) -> RoutingTable:
    table = RoutingTable(load_bound_factor=c)
    for i in range(n):
        table.upsert(DiscoveredUnit(f"u{i}", f"http://10.0.0.{i}:8000"))
        table.apply_load(f"u{i}", ready=True, draining=False, streams_in_flight=in_flight)
    return table


def test_a_unit_is_pending_until_its_first_poll_answers() -> None:
    table = RoutingTable()
    table.upsert(DiscoveredUnit("a", "http://10.0.0.1:8000"))
    assert table.units["a"].state == "pending"
    assert table.pick("voice") is None
    table.apply_load("a", ready=True, draining=False, streams_in_flight=0)
    assert table.units["a"].state == "routable"
    decision = table.pick("voice")
    assert decision is not None and decision.unit.name == "a"


@pytest.mark.parametrize(
    ("change", "state"),
    [
        (
            lambda t: t.apply_load("u0", ready=True, draining=True, streams_in_flight=1),
            "draining",
        ),
        (
            lambda t: t.apply_load(
                "u0", ready=False, draining=False, streams_in_flight=0
            ),
            "unready",
        ),
        (lambda t: t.apply_poll_error("u0", "poll failed: refused"), "unreachable"),
        (lambda t: t.mark_rejected("u0", 503, "draining"), "unready"),
        (lambda t: t.mark_rejected("u0", 429, "D has no capacity"), "full"),
        (
            lambda t: t.upsert(DiscoveredUnit("u0", "http://10.0.0.0:8000", draining=True)),
            "draining",
        ),
        (lambda t: t.upsert(DiscoveredUnit("u0", "http://10.0.0.0:8000", ready=False)), "unready"),
    ],
)
def test_units_that_are_draining_unready_unreachable_or_full_get_no_stream(change, state) -> None:
    table = table_of(3)
    change(table)
    assert table.units["u0"].state == state
    picked = {table.pick(f"voice-{i}").unit.name for i in range(300)}  # type: ignore[union-attr]
    picked |= {table.pick(None).unit.name for _ in range(30)}  # type: ignore[union-attr]
    assert picked == {"u1", "u2"}


def test_the_next_good_poll_makes_a_rejecting_unit_routable_again() -> None:
    table = table_of(2)
    table.mark_rejected("u0", 429, "full")
    assert not table.units["u0"].routable
    table.apply_load("u0", ready=True, draining=False, streams_in_flight=2)
    assert table.units["u0"].routable


@pytest.mark.anyio
async def test_a_load_answer_missing_a_field_is_a_poll_error_naming_it() -> None:
    table = table_of(2)
    await poll_answer(table, "u0", fake_load_document("u0", draining=None))
    assert table.units["u0"].state == "unreachable"
    assert table.units["u0"].last_error == (
        "poll http://10.0.0.0:8000/v1/load: not a load document: field draining is missing"
    )
    await poll_answer(table, "u0", fake_load_document("u0", streams_in_flight=2))
    assert table.units["u0"].state == "routable" and table.units["u0"].load == 2


def test_unreachable_unit_is_logged_with_its_error(caplog: pytest.LogCaptureFixture) -> None:
    table = table_of(2)
    with caplog.at_level(logging.WARNING):
        # table_of's own transitions (pending -> routable, at info) are captured too when an
        # earlier test of this worker left the router's logger at info: only this call counts
        caplog.clear()
        table.apply_poll_error("u1", "poll http://10.0.0.1:8000/v1/load failed: refused")
    record = next(r for r in caplog.records if r.getMessage() == "unit state changed")
    assert record.unit == "u1" and record.to_state == "unreachable"  # type: ignore[attr-defined]
    assert "refused" in record.error  # type: ignore[attr-defined]
    assert table.snapshot()["units"][1]["last_error"].endswith("refused")


def test_keyless_requests_go_to_the_least_loaded_unit() -> None:
    table = table_of(3)
    for name, n in (("u0", 5), ("u1", 1), ("u2", 3)):
        table.apply_load(name, ready=True, draining=False, streams_in_flight=n)
    decision = table.pick(None)
    assert decision is not None and decision.unit.name == "u1" and decision.how == "least_loaded"


def test_keyless_ties_rotate_over_units() -> None:
    table = table_of(4)
    assert {table.pick(None).unit.name for _ in range(4)} == {"u0", "u1", "u2", "u3"}  # type: ignore[union-attr]


def test_load_is_the_units_report_corrected_by_streams_opened_since() -> None:
    table = table_of(1)
    unit = table.units["u0"]
    table.apply_load("u0", ready=True, draining=False, streams_in_flight=10)
    assert unit.load == 10  # other routers' streams included
    table.acquire(unit)
    table.acquire(unit)
    assert unit.load == 12  # our two new streams, before the unit reports them
    table.apply_load("u0", ready=True, draining=False, streams_in_flight=12)
    assert unit.load == 12  # the report now includes them: not counted twice
    table.release(unit)
    assert unit.load == 11
    table.apply_load("u0", ready=True, draining=False, streams_in_flight=0)
    assert unit.load == 1  # never below what this router itself has open


def test_total_load_stays_exact_under_random_operations() -> None:
    rng = random.Random(7)
    table = table_of(6)
    open_streams = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            decision = table.pick(rng.choice([None, f"v{rng.randrange(50)}"]))
            if decision is not None:
                table.acquire(decision.unit)
                open_streams.append(decision.unit)
        elif op < 0.85 and open_streams:
            table.release(open_streams.pop(rng.randrange(len(open_streams))))
        elif op < 0.95:
            name = f"u{rng.randrange(6)}"
            table.apply_load(
                name,
                ready=rng.random() < 0.9,
                draining=rng.random() < 0.1,
                streams_in_flight=rng.randrange(20),
            )
        else:
            table.mark_rejected(f"u{rng.randrange(6)}", rng.choice([429, 503]), "x")
        expected = sum(u.load for u in table.units.values() if u.routable)
        assert table.total_load() == expected


def test_a_hot_session_spills_to_other_units_only_past_the_bound() -> None:
    table = table_of(4)
    owner = table.ring.owner("hot")
    placed = []
    for _ in range(12):
        decision = table.pick("hot")
        assert decision is not None
        assert decision.unit.load < decision.bound
        table.acquire(decision.unit)
        placed.append(decision.unit.name)
    assert placed[0] == owner
    assert placed.count(owner) == 4  # ceil(1.25 * 12 / 4): the bound at the end
    assert len(set(placed)) >= 3


def test_pick_skips_units_the_request_already_tried() -> None:
    table = table_of(3)
    first = table.pick("voice-1")
    assert first is not None
    second = table.pick("voice-1", exclude=frozenset({first.unit.name}))
    assert second is not None and second.unit.name != first.unit.name
    assert table.pick("voice-1", exclude=frozenset({"u0", "u1", "u2"})) is None


def test_session_moves_are_counted_and_sessions_per_unit_tracked() -> None:
    table = table_of(2)
    a, b = table.units["u0"], table.units["u1"]
    assert table.record_session("s1", a) is False
    assert table.record_session("s1", a) is False
    assert table.record_session("s1", b) is True
    assert (a.sessions, b.sessions) == (0, 1)


def test_tracked_sessions_are_bounded() -> None:
    table = RoutingTable(max_tracked_sessions=10)
    table.upsert(DiscoveredUnit("a", "http://10.0.0.1:8000"))
    for i in range(25):
        table.record_session(f"s{i}", table.units["a"])
    assert table.units["a"].sessions == 10
    assert table.snapshot()["tracked_sessions"] == 10


def test_discovery_removal_and_address_change() -> None:
    table = table_of(3)
    table.replace_all(
        [DiscoveredUnit("u0", "http://10.0.0.0:8000"), DiscoveredUnit("u1", "http://10.9.9.9:8000")]
    )
    assert set(table.units) == {"u0", "u1"} and "u2" not in table.ring
    # A new address means a new pod: nothing is known until it answers a poll.
    assert table.units["u1"].state == "pending"
    assert table.units["u0"].state == "routable"


def test_snapshot_lists_url_state_load_bound_and_sessions() -> None:
    table = table_of(2)
    table.acquire(table.units["u0"])
    table.record_session("s", table.units["u0"])
    snap = table.snapshot()
    u0 = snap["units"][0]
    assert u0["url"] == "http://10.0.0.0:8000"
    assert (u0["state"], u0["ready"], u0["draining"]) == ("routable", True, False)
    assert (u0["in_flight"], u0["router_in_flight"], u0["sessions"]) == (1, 1, 1)
    assert u0["load_bound"] == snap["load_bound"] == 2  # ceil(1.25 * (1 + 1) / 2)


def test_load_bound_factor_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="load_bound_factor must be > 1.0"):
        RoutingTable(load_bound_factor=1.0)
