"""P's slot space and its hash-chained prefix cache: a reused voice prompt skips
recomputing the K/V of its cached leading blocks.

Owns which of P's storage slots are free, which hold a cached block, and which are leased
to a request being prefilled. Must never touch storage (slot numbers only) and never
evict a block that a request in flight uses (pinned): a block's K/V depend on every row
before it, so a block is keyed by the hash chain of its prompt (`block_hashes`).
Thread-safe (one lock).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pdunit.engine.kv.pool import NoCapacity


@dataclass
class PrefixLease:
    cached_tokens: int  # leading prompt rows whose K/V is already in P's storage
    slots: np.ndarray  # int64 [n_rows]: P-storage slots for every prompt row
    # Cache keys this lease pins (matched at acquire, added at publish).
    pinned: list[bytes] = field(default_factory=list)
    # Slots of `slots` that the cache does not own: returned to the free list at release.
    fresh: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    released: bool = False
    # The prompt's hash chain over its full blocks, taken once at acquire: publish reuses
    # it, so the thread that publishes (between forwards) hashes nothing.
    hashes: list[bytes] = field(default_factory=list)


@dataclass
class _Block:
    slots: np.ndarray  # int64 [block_tokens]
    pins: int = 0


# A prompt is cut into blocks of `block_tokens` rows. Block i's key is the hash chain
# `h_i = blake2b-128(h_{i-1} || bytes of block i)` (`h_{-1}` empty), so a block matches
# only when every row before it matches too. Only FULL blocks are cached. At least one
# row is always computed fresh, because prefill needs the last row's logits: a fully
# cached prompt recomputes its last block.
def block_hashes(prompt: np.ndarray, block_tokens: int) -> list[bytes]:
    """Hash chain over the prompt's full blocks."""
    rows = np.ascontiguousarray(prompt, dtype="<i8")
    out: list[bytes] = []
    prev = b""
    for i in range(rows.shape[0] // block_tokens):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(rows[i * block_tokens : (i + 1) * block_tokens].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


# Eviction is LRU over unpinned blocks; a chain's deeper blocks are kept more recently
# used than its shallower ones, so a chain is evicted from its tail and never leaves
# unreachable blocks behind a missing head.
class PrefixCache:
    def __init__(self, n_slots: int, block_tokens: int = 16) -> None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1 (got {n_slots})")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1 (got {block_tokens})")
        self.n_slots = n_slots
        self.block_tokens = block_tokens
        self._lock = threading.Lock()
        # A stack: a request takes the top run (one slice in C, not a pop per slot), and a
        # released request's run goes back on top in order, so runs stay contiguous.
        self._free: list[int] = list(range(n_slots))
        # LRU order: first = least recently used.
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        # Slots of unpinned blocks, kept as pins change: a full cache (every acquire at
        # steady state) would otherwise sum over all its blocks per acquire, ~1-2 ms of
        # Python holding the GIL that P's forward launches wait on (3750 blocks at 60k
        # slots; P's stack samples on the H200s, bench/results/capacity-20261130-h200x2-
        # 60s-c4.md).
        self._evictable = 0
        self._stats = {
            "lookups_total": 0,
            "hit_tokens_total": 0,
            "miss_tokens_total": 0,
            "evicted_blocks_total": 0,
        }

    def acquire(self, prompt: np.ndarray, chain: list[bytes] | None = None) -> PrefixLease:
        """Pin the prompt's cached leading blocks and allocate fresh slots for the rest
        (evicting unpinned LRU blocks if needed). Raises NoCapacity, holding nothing.
        `chain`: `block_hashes(prompt, self.block_tokens)` when the caller took it
        already, off the thread that calls this."""
        if prompt.ndim != 2 or prompt.shape[0] < 1:
            raise ValueError(f"prompt has shape {prompt.shape}, expected [rows >= 1, C]")
        rows = prompt.shape[0]
        if chain is None:
            chain = block_hashes(prompt, self.block_tokens)
        elif len(chain) != rows // self.block_tokens:
            raise ValueError(f"a chain of {len(chain)} blocks for a prompt of {rows} rows "
                             f"({rows // self.block_tokens} blocks of {self.block_tokens})")
        # At most rows - 1 cached rows: the last row is always computed. A chain's first k
        # hashes are those of the first k blocks alone.
        hashes = chain[: (rows - 1) // self.block_tokens]
        with self._lock:
            matched: list[bytes] = []
            for h in hashes:
                if h not in self._blocks:
                    break
                matched.append(h)
            for h in matched:
                self._pin(self._blocks[h])
            cached = len(matched) * self.block_tokens
            need = rows - cached
            if need > len(self._free):
                if need > len(self._free) + self._evictable:
                    for h in matched:
                        self._unpin(self._blocks[h])
                    raise NoCapacity(len(self._free) + self._evictable, need, unit="slots")
                self._evict(need - len(self._free))
            fresh = np.array(self._free[len(self._free) - need:], dtype=np.int64)
            del self._free[len(self._free) - need:]
            self._touch(matched)
            self._stats["lookups_total"] += 1
            self._stats["hit_tokens_total"] += cached
            self._stats["miss_tokens_total"] += need
            slots = np.concatenate([self._blocks[h].slots for h in matched] + [fresh])
            return PrefixLease(cached_tokens=cached, slots=slots, pinned=matched, fresh=fresh, hashes=chain)

    def publish(self, lease: PrefixLease, prompt: np.ndarray) -> None:
        """After prefill wrote the fresh rows: every full block of the prompt becomes a
        cache entry (pinned by this lease until release)."""
        if lease.released:
            raise ValueError("publish of a released lease: its fresh slots may be reused")
        if prompt.shape[0] != lease.slots.shape[0]:
            raise ValueError(
                f"prompt has {prompt.shape[0]} rows, the lease {lease.slots.shape[0]} slots"
            )
        hashes = lease.hashes
        b = self.block_tokens
        with self._lock:
            published: list[np.ndarray] = []
            for i, h in enumerate(hashes):
                if h in self._blocks:
                    continue  # already cached (matched, or published by another request)
                block_slots = lease.slots[i * b : (i + 1) * b].copy()
                self._blocks[h] = _Block(block_slots, pins=1)
                lease.pinned.append(h)
                published.append(block_slots)
            if published:  # the cache owns those slots now: they leave the lease's fresh ones
                lease.fresh = lease.fresh[~np.isin(lease.fresh, np.concatenate(published))]
            self._touch(hashes)

    def release(self, lease: PrefixLease) -> None:
        """Unpin; fresh slots not published return to the free list; published blocks
        stay cached (LRU)."""
        with self._lock:
            if lease.released:
                raise ValueError("lease released twice")
            lease.released = True
            for h in lease.pinned:
                self._unpin(self._blocks[h])
            self._free.extend(lease.fresh.tolist())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(
                self._stats,
                cached_blocks=len(self._blocks),
                pinned_blocks=sum(1 for blk in self._blocks.values() if blk.pins > 0),
                free_slots=len(self._free),
            )

    def _touch(self, chain: list[bytes]) -> None:
        # Deepest block first, so that the chain's head ends up most recently used.
        for h in reversed(chain):
            self._blocks.move_to_end(h)

    def _pin(self, blk: _Block) -> None:
        if not blk.pins:
            self._evictable -= blk.slots.shape[0]
        blk.pins += 1

    def _unpin(self, blk: _Block) -> None:
        blk.pins -= 1
        if not blk.pins:
            self._evictable += blk.slots.shape[0]

    def _evict(self, n_slots: int) -> None:
        """Evict unpinned blocks, least recently used first, until n_slots are freed.
        Walks from the LRU end only as far as it needs (pinned blocks are mostly recent,
        near the other end), never copying the whole key list."""
        freed = 0
        victims: list[bytes] = []
        for h, blk in self._blocks.items():
            if freed >= n_slots:
                break
            if not blk.pins:
                victims.append(h)
                freed += blk.slots.shape[0]
        for h in victims:
            blk = self._blocks.pop(h)
            self._evictable -= blk.slots.shape[0]
            self._free.extend(blk.slots.tolist())
            self._stats["evicted_blocks_total"] += 1
