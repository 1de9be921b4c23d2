"""D's page pool: the state machine of PROTOCOL.md section 2, its counters, capacity
rules, fragmentation and thread safety."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from pdunit.engine.kv.pool import IllegalTransition, NoCapacity, PagePool, PageState, Proof

# How to bring a fresh request 7 into each state.
SETUP: dict[PageState | None, list[str]] = {
    None: [],
    PageState.RESERVED: ["reserve"],
    PageState.FILLED: ["reserve", "mark_filled"],
    PageState.DECODING: ["reserve", "mark_filled", "start_decoding"],
    PageState.HELD: ["reserve", "hold"],
}


def act(pool: PagePool, name: str, rid: int = 7) -> None:
    actions: dict[str, Callable[[], object]] = {
        "reserve": lambda: pool.reserve(rid, 3, 5),
        "mark_filled": lambda: pool.mark_filled(rid),
        "start_decoding": lambda: pool.start_decoding(rid),
        "finish": lambda: pool.finish(rid),
        "hold": lambda: pool.hold(rid),
        "release_held": lambda: pool.release_held(rid, Proof.ABORT_ACK),
    }
    actions[name]()


LEGAL = {
    (None, "reserve"),
    (PageState.RESERVED, "mark_filled"),
    (PageState.FILLED, "start_decoding"),
    (PageState.DECODING, "finish"),
    (PageState.RESERVED, "hold"),
    (PageState.FILLED, "hold"),
    (PageState.HELD, "release_held"),
}
ACTIONS = ["reserve", "mark_filled", "start_decoding", "finish", "hold", "release_held"]
ILLEGAL = [(s, a) for s in SETUP for a in ACTIONS if (s, a) not in LEGAL]


def in_state(state: PageState | None, n_pages: int = 10) -> PagePool:
    pool = PagePool(n_pages)
    for name in SETUP[state]:
        act(pool, name)
    return pool


def test_stream_life_cycle_moves_pages_through_every_state_and_back_to_free() -> None:
    pool = PagePool(10)
    slots = pool.reserve(1, 3, 5)
    assert slots.dtype == np.int64 and len(slots) == 3
    assert pool.state_of(1) is PageState.RESERVED
    assert pool.counts() == {"free": 5, "reserved": 5, "filled": 0, "decoding": 0, "held": 0}
    pool.mark_filled(1)
    assert pool.counts()["filled"] == 5
    pool.start_decoding(1)
    assert pool.counts()["decoding"] == 5 and pool.used_pages == 5
    pool.finish(1)
    assert pool.state_of(1) is None
    assert pool.free_pages == 10 and pool.used_pages == 0
    stats = pool.stats()
    for name in ("reserve", "mark_filled", "start_decoding", "finish"):
        assert stats[f"{name}_total"] == 1


@pytest.mark.parametrize("state", [PageState.RESERVED, PageState.FILLED])
@pytest.mark.parametrize("proof", list(Proof))
def test_failed_transfer_holds_pages_until_a_proof_releases_them(
    state: PageState, proof: Proof
) -> None:
    pool = in_state(state)
    pool.hold(7)
    assert pool.state_of(7) is PageState.HELD
    assert pool.held_pages == 5 and pool.free_pages == 5
    pool.release_held(7, proof)
    assert pool.state_of(7) is None and pool.free_pages == 10 and pool.held_pages == 0
    stats = pool.stats()
    assert stats[f"released_by_proof_{proof.value}"] == 1
    assert sum(stats[f"released_by_proof_{p.value}"] for p in Proof) == 1
    assert stats["hold_total"] == 1 and stats["release_held_total"] == 1


@pytest.mark.parametrize(
    ("state", "action"), ILLEGAL, ids=[f"{s.name if s else 'ABSENT'}-{a}" for s, a in ILLEGAL]
)
def test_every_other_transition_raises_and_changes_nothing(
    state: PageState | None, action: str
) -> None:
    pool = in_state(state)
    before_counts, before_state = pool.counts(), pool.state_of(7)
    with pytest.raises(IllegalTransition) as err:
        act(pool, action)
    msg = str(err.value)
    assert "request 7" in msg and action in msg
    assert (state.name if state else "absent") in msg
    assert pool.counts() == before_counts and pool.state_of(7) is before_state
    assert pool.stats()["illegal_transition_total"] == 1


def test_finish_of_a_reserved_request_is_refused_because_a_writer_may_still_hit_it() -> None:
    pool = in_state(PageState.RESERVED)
    with pytest.raises(IllegalTransition, match="RESERVED"):
        pool.finish(7)
    assert pool.free_pages == 5


def test_release_held_requires_a_proof() -> None:
    pool = in_state(PageState.HELD)
    for not_a_proof in (None, "abort_ack", True):
        with pytest.raises(TypeError, match="Proof"):
            pool.release_held(7, not_a_proof)  # type: ignore[arg-type]
    assert pool.state_of(7) is PageState.HELD and pool.held_pages == 5


def test_no_capacity_allocates_nothing() -> None:
    pool = PagePool(8, page_size=2)
    pool.reserve(1, 4, 10)  # 5 pages
    with pytest.raises(NoCapacity) as err:
        pool.reserve(2, 4, 7)  # needs 4 pages, 3 free
    assert (err.value.free, err.value.needed) == (3, 4)
    assert pool.state_of(2) is None
    assert pool.free_pages == 3 and pool.requests() == [1]
    assert pool.stats()["no_capacity_total"] == 1
    pool.reserve(2, 4, 6)  # exactly 3 pages still fit
    assert pool.free_pages == 0


def test_held_pages_are_never_allocatable() -> None:
    pool = PagePool(10)
    held_slots = set(pool.reserve(1, 6, 6).tolist())
    pool.hold(1)
    with pytest.raises(NoCapacity):
        pool.reserve(2, 5, 5)
    live = pool.reserve(3, 4, 4)
    assert not held_slots & set(live.tolist())
    pool.release_held(1, Proof.NEW_INSTANCE)
    assert set(pool.reserve(2, 6, 6).tolist()) == held_slots


def test_held_pages_return_only_after_a_proof_not_after_finish_of_others() -> None:
    pool = PagePool(4)
    pool.reserve(1, 2, 2)
    pool.hold(1)
    pool.reserve(2, 2, 2)
    pool.mark_filled(2)
    pool.start_decoding(2)
    pool.finish(2)
    assert pool.held_pages == 2 and pool.free_pages == 2
    assert pool.requests(PageState.HELD) == [1]


def test_pages_of_size_four_map_tokens_to_slots() -> None:
    pool = PagePool(6, page_size=4)
    pool.reserve(1, 1, 1)  # takes page 0
    slots = pool.reserve(2, 6, 9)  # 3 pages: 1, 2, 3
    assert pool.pages_of(2).tolist() == [1, 2, 3]
    assert slots.tolist() == [4, 5, 6, 7, 8, 9]
    assert pool.slot_of(2, 8) == 12
    assert pool.slots(2, 9).tolist() == [pool.slot_of(2, i) for i in range(9)]
    with pytest.raises(IndexError, match="total_tokens=9"):
        pool.slot_of(2, 9)
    with pytest.raises(KeyError, match="request 5"):
        pool.slot_of(5, 0)


def test_pool_fragments_after_churn_and_slots_stay_consistent() -> None:
    rng = np.random.default_rng(0)
    pool = PagePool(512)
    live: list[int] = []
    for rid in range(400):
        n = int(rng.integers(1, 40))
        while live and (pool.free_pages < n or rng.random() < 0.45):
            victim = live.pop(int(rng.integers(len(live))))
            pool.mark_filled(victim)
            pool.start_decoding(victim)
            pool.finish(victim)
        pool.reserve(rid, n, n)
        live.append(rid)
    for rid in live:
        pool.hold(rid)
        pool.release_held(rid, Proof.ABORT_ACK)
    assert pool.free_pages == 512
    pool.reserve(10_000, 300, 300)
    pages = pool.pages_of(10_000)
    runs = 1 + int(np.count_nonzero(np.diff(pages) != 1))
    assert runs > 20, f"a 300-page request after churn is in only {runs} contiguous runs"
    assert len(set(pages.tolist())) == 300
    assert pool.slots(10_000, 300).tolist() == pages.tolist()


def test_concurrent_reserve_and_finish_never_give_a_page_to_two_requests() -> None:
    pool = PagePool(64)
    owner = np.full(64, -1)
    owner_lock = threading.Lock()
    errors: list[str] = []

    def worker(tid: int) -> None:
        rng = np.random.default_rng(tid)
        for i in range(300):
            rid = tid * 1000 + i
            n = int(rng.integers(1, 6))
            try:
                pool.reserve(rid, n, n)
            except NoCapacity:
                continue
            pages = pool.pages_of(rid)
            with owner_lock:
                if (owner[pages] != -1).any():
                    errors.append(f"pages {pages} already owned: {owner[pages]}")
                owner[pages] = rid
            pool.mark_filled(rid)
            if rng.random() < 0.3:
                pool.hold(rid)
                with owner_lock:
                    owner[pages] = -1
                pool.release_held(rid, Proof.ABORT_ACK)
            else:
                pool.start_decoding(rid)
                with owner_lock:
                    owner[pages] = -1
                pool.finish(rid)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert pool.free_pages == 64 and pool.requests() == []
    s = pool.stats()
    assert s["reserve_total"] == s["finish_total"] + s["release_held_total"]
    assert s["reserve_total"] + s["no_capacity_total"] == 8 * 300


def test_reserve_validates_token_counts() -> None:
    pool = PagePool(4)
    with pytest.raises(ValueError, match="n_tokens"):
        pool.reserve(1, 5, 3)
    assert pool.free_pages == 4
