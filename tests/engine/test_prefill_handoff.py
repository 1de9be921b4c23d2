"""The handoffs between P's pipeline stages (engine/prefill/handoff.py): bounds, order,
and stopping."""

from __future__ import annotations

import threading
import time

import pytest

from pdunit.engine.prefill.handoff import Handoff, OpenBatch


def test_open_batch_bounds_items_and_rows_but_takes_an_oversized_item_alone():
    b: OpenBatch[str] = OpenBatch(max_items=3, max_rows=100)
    stop = threading.Event()
    assert b.wait_for_room(500, 0, stop)  # empty: an item larger than the bound still fits
    b.add("huge", 500)
    assert not b.wait_for_room(1, 0.01, stop)
    assert b.take(0) == ["huge"] and b.take(0) == []
    for name, rows in (("a", 40), ("b", 40)):
        assert b.wait_for_room(rows, 0, stop)
        b.add(name, rows)
    assert not b.wait_for_room(30, 0.01, stop)  # 110 rows > 100
    assert b.wait_for_room(20, 0, stop)
    b.add("c", 20)
    assert not b.wait_for_room(1, 0.01, stop)  # 3 items
    assert b.take(0) == ["a", "b", "c"]


def test_waiting_for_room_ends_when_stopping_and_says_so():
    b: OpenBatch[str] = OpenBatch(max_items=1, max_rows=10)
    b.add("x", 1)
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    t0 = time.monotonic()
    assert b.wait_for_room(1, 30.0, stop) is False
    assert time.monotonic() - t0 < 10.0  # woken by the stop, not by the 30 s timeout


def test_handoff_keeps_order_and_room_for_a_whole_group():
    h: Handoff[int] = Handoff(capacity=4)
    stop = threading.Event()
    assert h.wait_for_room(3, 0, stop)
    for i in range(3):
        h.put(i)
    assert not h.wait_for_room(2, 0.01, stop)  # 3 + 2 > 4
    assert h.get(0) == 0
    assert h.wait_for_room(2, 0, stop)
    assert [h.get(0), h.get(0)] == [1, 2] and h.get(0.01) is None
    h.put(7)
    assert h.take_all() == [7] and h.take_all() == []


@pytest.mark.parametrize("bad", [0, -1])
def test_bounds_must_be_positive(bad):
    with pytest.raises(ValueError):
        Handoff(bad)
    with pytest.raises(ValueError):
        OpenBatch(bad, 10)


def test_add_fitting_adds_a_group_in_order_while_it_fits_and_returns_how_many():
    b: OpenBatch[str] = OpenBatch(max_items=3, max_rows=100)
    assert b.add_fitting([("a", 40), ("b", 40), ("c", 40), ("d", 10)]) == 2  # c would make 120 rows: d waits too
    assert b.add_fitting([("c", 40)]) == 0
    assert b.take(0) == ["a", "b"]
    assert b.add_fitting([("c", 400)]) == 1  # alone, an oversized item fits
