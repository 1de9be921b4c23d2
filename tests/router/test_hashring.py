"""Consistent hashing with bounded load, as pure functions (no network)."""

from __future__ import annotations

import collections
import math

import pytest

from pdunit.engine.router.hashring import HashRing, key_hash, load_bound

KEYS = [f"voice-{i}" for i in range(20_000)]


def ring_of(n: int, vnodes: int = 160) -> HashRing:
    ring = HashRing(vnodes)
    for i in range(n):
        ring.add(f"unit-{i}")
    return ring


def test_key_hash_is_stable_across_runs() -> None:
    # blake2b, not Python's salted hash(): every router replica must agree on owners.
    assert key_hash("voice-1") == key_hash("voice-1")
    assert key_hash("voice-1") != key_hash("voice-2")
    assert 0 <= key_hash("x") < 2**64


@pytest.mark.parametrize(
    ("total", "n", "c", "expected"),
    [(0, 4, 1.25, 1), (7, 4, 1.25, 3), (11, 4, 1.25, 4), (9, 10, 1.1, 2), (99, 100, 1.25, 2)],
)
def test_load_bound_is_ceil_c_times_average_including_the_new_stream(
    total: int, n: int, c: float, expected: int
) -> None:
    assert load_bound(total, n, c) == expected
    assert load_bound(total, n, c) == math.ceil(round(c * (total + 1) / n, 9))


def test_walk_visits_every_unit_once_starting_at_the_owner() -> None:
    ring = ring_of(7)
    order = list(ring.walk("voice-42"))
    assert sorted(order) == sorted(ring.members)
    assert order[0] == ring.owner("voice-42")


def test_keys_spread_evenly_over_units() -> None:
    ring = ring_of(10)
    shares = collections.Counter(ring.owner(k) for k in KEYS)
    expected = len(KEYS) / 10
    # 160 points per unit keep every share within +-25% of fair.
    assert all(0.75 * expected < shares[u] < 1.25 * expected for u in ring.members), shares


def test_removing_a_unit_moves_only_the_keys_it_owned() -> None:
    ring = ring_of(10)
    before = {k: ring.owner(k) for k in KEYS}
    ring.remove("unit-3")
    after = {k: ring.owner(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == "unit-3" for k in moved)
    assert len(moved) == sum(1 for k in KEYS if before[k] == "unit-3")


def test_adding_a_unit_moves_about_one_nth_of_keys_all_to_the_new_unit() -> None:
    ring = ring_of(10)
    before = {k: ring.owner(k) for k in KEYS}
    ring.add("unit-new")
    after = {k: ring.owner(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "unit-new" for k in moved)
    fraction = len(moved) / len(KEYS)
    assert 0.5 / 11 < fraction < 1.5 / 11, fraction


def test_choose_returns_the_owner_while_it_is_under_the_bound() -> None:
    ring = ring_of(5)
    owner = ring.owner("voice-7")
    got = ring.choose("voice-7", load=lambda u: 0, eligible=lambda u: True, bound=1)
    assert got == owner


def test_choose_walks_past_units_at_the_bound_and_ineligible_units() -> None:
    ring = ring_of(5)
    order = list(ring.walk("voice-7"))
    loads = {u: 0 for u in order}
    loads[order[0]] = 3  # owner full
    got = ring.choose("voice-7", load=loads.__getitem__, eligible=lambda u: u != order[1], bound=3)
    assert got == order[2]
    assert ring.choose("voice-7", load=lambda u: 9, eligible=lambda u: True, bound=3) is None


def test_a_hot_key_never_puts_any_unit_over_the_bound() -> None:
    """Mirrokni et al.: placing m streams of one key one by one, every unit stays at or
    below ceil(c * m / n) at every step, and the key spills over several units."""
    n, c = 8, 1.25
    ring = ring_of(n)
    loads = dict.fromkeys(ring.members, 0)
    for placed in range(200):
        bound = load_bound(placed, n, c)
        unit = ring.choose("hot-voice", loads.__getitem__, lambda u: True, bound)
        assert unit is not None
        loads[unit] += 1
        assert max(loads.values()) <= load_bound(placed, n, c)
    final_bound = math.ceil(c * 200 / n)
    assert max(loads.values()) <= final_bound
    # The key fills units in its walk order: as many as the bound forces, no fewer.
    assert sum(1 for v in loads.values() if v) >= math.ceil(200 / final_bound) > 1


def test_bounded_load_keeps_most_keys_on_their_owner_under_uniform_load() -> None:
    n, c = 10, 1.25
    ring = ring_of(n)
    loads = dict.fromkeys(ring.members, 0)
    at_owner = 0
    for placed, key in enumerate(KEYS[:2000]):
        unit = ring.choose(key, loads.__getitem__, lambda u: True, load_bound(placed, n, c))
        assert unit is not None
        loads[unit] += 1
        at_owner += unit == ring.owner(key)
    assert at_owner / 2000 > 0.8
    assert max(loads.values()) <= math.ceil(c * 2000 / n)


def test_vnodes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="vnodes must be >= 1"):
        HashRing(0)
