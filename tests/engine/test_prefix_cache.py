"""P's hash-chained prefix cache: hits on reused voices, partial hits on shared prefixes,
LRU eviction that never touches pinned blocks, and cached prefill == full prefill."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdunit.engine.kv.pool import NoCapacity
from pdunit.engine.kv.prefix_cache import PrefixCache, block_hashes
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.transformer import ForwardBatch

B = 16


def prompt(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, (rows, 11)).astype(np.int64)


def serve(cache: PrefixCache, p: np.ndarray) -> int:
    """One request's life in P: acquire, (prefill), publish, release. -> cached rows."""
    lease = cache.acquire(p)
    cache.publish(lease, p)
    cache.release(lease)
    return lease.cached_tokens


def test_the_same_prompt_hits_every_full_block_but_the_last_row() -> None:
    cache = PrefixCache(256, block_tokens=B)
    p = prompt(50, 0)
    first = cache.acquire(p)
    assert first.cached_tokens == 0
    assert len(set(first.slots.tolist())) == 50
    cache.publish(first, p)
    cache.release(first)
    second = cache.acquire(p)
    assert second.cached_tokens == 48
    assert second.slots[:48].tolist() == first.slots[:48].tolist()
    assert not set(second.slots[48:].tolist()) & set(second.slots[:48].tolist())
    cache.release(second)
    s = cache.stats()
    assert s["lookups_total"] == 2
    assert s["hit_tokens_total"] == 48 and s["miss_tokens_total"] == 50 + 2
    assert s["cached_blocks"] == 3


def test_a_fully_cached_prompt_recomputes_its_last_block() -> None:
    cache = PrefixCache(128, block_tokens=B)
    p = prompt(32, 1)
    serve(cache, p)
    free_before = cache.stats()["free_slots"]
    lease = cache.acquire(p)
    assert lease.cached_tokens == 16  # the last row's logits must be computed
    cache.publish(lease, p)  # block 2 is cached already: its fresh rows stay fresh
    cache.release(lease)
    assert cache.stats()["free_slots"] == free_before
    assert cache.stats()["cached_blocks"] == 2


def test_a_shared_prefix_gives_a_partial_hit() -> None:
    cache = PrefixCache(256, block_tokens=B)
    voice = prompt(40, 2)
    serve(cache, np.concatenate([voice, prompt(20, 3)]))
    other = np.concatenate([voice, prompt(30, 4)])  # same voice, other text
    assert serve(cache, other) == 32  # blocks 0 and 1 lie inside the shared 40 rows
    changed = other.copy()
    changed[5, 3] += 1  # one id differs in block 0: nothing after it may match
    assert serve(cache, changed) == 0


def test_lru_eviction_drops_the_least_recently_used_blocks() -> None:
    cache = PrefixCache(66, block_tokens=B)
    a, b, c = prompt(33, 5), prompt(33, 6), prompt(33, 7)  # 2 blocks + 1 row each
    serve(cache, a)
    serve(cache, b)  # 4 cached blocks, 2 free slots
    assert cache.stats()["free_slots"] == 2 and cache.stats()["evicted_blocks_total"] == 0
    assert serve(cache, a) == 32  # a is now more recent than b
    serve(cache, c)  # needs 33 slots: evicts b's 2 blocks, not a's
    assert cache.stats()["evicted_blocks_total"] == 2
    assert serve(cache, a) == 32
    assert serve(cache, b) == 0


def test_a_chain_is_evicted_from_its_tail() -> None:
    cache = PrefixCache(64, block_tokens=B)
    a = prompt(49, 8)  # 3 full blocks + 1 row
    serve(cache, a)  # 48 cached + 16 free
    serve(cache, prompt(17, 9))  # needs 17: evicts exactly one block of a, its deepest
    lease = cache.acquire(a)
    assert lease.cached_tokens == 32
    cache.release(lease)


def test_pinned_blocks_are_never_evicted() -> None:
    cache = PrefixCache(64, block_tokens=B)
    a = prompt(33, 10)
    serve(cache, a)
    pinned = cache.acquire(a)  # pins a's 2 blocks while "prefill" runs
    assert pinned.cached_tokens == 32
    before = cache.stats()
    with pytest.raises(NoCapacity) as err:
        cache.acquire(prompt(40, 11))  # 31 free, nothing unpinned to evict
    assert err.value.needed == 40
    after = cache.stats()
    assert after["free_slots"] == before["free_slots"]
    assert after["evicted_blocks_total"] == 0 and after["cached_blocks"] == 2
    cache.release(pinned)
    assert serve(cache, prompt(40, 11)) == 0
    assert cache.stats()["evicted_blocks_total"] >= 1


def test_concurrent_leases_never_share_fresh_slots() -> None:
    cache = PrefixCache(200, block_tokens=B)
    leases = [cache.acquire(prompt(37, 20 + i)) for i in range(5)]
    every = np.concatenate([lease.slots for lease in leases])
    assert len(set(every.tolist())) == len(every) == 185
    assert every.min() >= 0 and every.max() < 200
    for lease in leases:
        cache.release(lease)
    assert cache.stats()["free_slots"] == 200
    with pytest.raises(ValueError, match="twice"):
        cache.release(leases[0])


def _check_counts(cache: PrefixCache) -> None:
    """The cache's running count of evictable slots against a count from scratch."""
    unpinned = sum(b.slots.shape[0] for b in cache._blocks.values() if not b.pins)
    assert cache._evictable == unpinned


def test_a_busy_cache_keeps_its_evictable_count_and_its_refusals_exact() -> None:
    """Random voices, shared prefixes, leases held across other requests, refusals and
    evictions: after every step the running count of unpinned slots equals a full count,
    and a request is refused exactly when free plus unpinned slots cannot hold it."""
    rng = np.random.default_rng(7)
    cache = PrefixCache(400, block_tokens=B)
    voices = [prompt(96, 100 + v) for v in range(6)]
    held: list[tuple] = []
    refused = 0
    for step in range(600):
        if held and rng.random() < 0.45:
            lease, p = held.pop(int(rng.integers(len(held))))
            cache.publish(lease, p)
            cache.release(lease)
        else:
            head = voices[int(rng.integers(len(voices)))][: int(rng.integers(16, 97))]
            p = np.concatenate([head, prompt(int(rng.integers(1, 80)), 1000 + step)])
            free = cache.stats()["free_slots"]
            matched = []
            for h in block_hashes(p, B)[: (p.shape[0] - 1) // B]:
                if h not in cache._blocks:
                    break
                matched.append(h)
            need = p.shape[0] - B * len(matched)
            # what eviction may take: unpinned blocks other than the ones this prompt hits
            room = free + sum(b.slots.shape[0] for h, b in cache._blocks.items() if not b.pins and h not in matched)
            try:
                lease = cache.acquire(p)
            except NoCapacity:
                refused += 1
                assert need > room, (step, need, room)
                assert cache.stats()["free_slots"] == free
            else:
                assert need <= room, (step, need, room)
                assert lease.cached_tokens == B * len(matched)
                held.append((lease, p))
        _check_counts(cache)
    assert refused > 0  # the pool was small enough to refuse some
    for lease, _ in held:
        cache.release(lease)
    _check_counts(cache)
    assert cache.stats()["pinned_blocks"] == 0
    assert cache._evictable + cache.stats()["free_slots"] == 400


def test_prefill_of_a_cached_voice_equals_prefill_from_scratch() -> None:
    """What P does with a lease: compute only the fresh rows, attending to the cached
    slots; the first frame's logits equal a full prefill's."""
    torch.set_num_threads(1)
    model = load_model("random:tiny:0")
    cache = PrefixCache(128, block_tokens=B)
    kv = model.new_kv_storage(128)
    voice = prompt(40, 30)
    first = np.concatenate([voice, prompt(9, 31)])
    lease = cache.acquire(first)
    model(ForwardBatch.from_sequences([first], [lease.slots]), kv)
    cache.publish(lease, first)
    cache.release(lease)

    second = np.concatenate([voice, prompt(12, 32)])
    lease = cache.acquire(second)
    assert lease.cached_tokens == 32
    cached = model(ForwardBatch.from_sequences([second[lease.cached_tokens :]], [lease.slots]), kv)
    cache.release(lease)
    scratch = model(
        ForwardBatch.from_sequences([second], [np.arange(len(second))]),
        model.new_kv_storage(len(second)),
    )
    torch.testing.assert_close(cached, scratch, rtol=1e-10, atol=1e-10)


def test_a_chain_taken_ahead_gives_the_same_lease_and_a_wrong_one_is_refused() -> None:
    from pdunit.engine.kv.prefix_cache import block_hashes

    p = prompt(100, seed=3)
    ahead, inline = PrefixCache(1024, B), PrefixCache(1024, B)
    chain = block_hashes(p, B)
    for _ in range(2):  # a miss, then a hit: both caches answer alike
        a, b = ahead.acquire(p, chain), inline.acquire(p)
        assert (a.cached_tokens, a.slots.tolist(), a.hashes) == (b.cached_tokens, b.slots.tolist(), b.hashes)
        for cache, lease in ((ahead, a), (inline, b)):
            cache.publish(lease, p)
            cache.release(lease)
    assert a.cached_tokens == (99 // B) * B
    with pytest.raises(ValueError, match="chain of 5 blocks"):
        ahead.acquire(p, chain[:5])
