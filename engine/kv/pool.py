"""D's paged KV pool: which request owns which page, as the state machine of PROTOCOL.md 2.

    free -> reserved(req) -> filled(req) -> decoding(req) -> free
    reserved|filled -> held(req) -> free   (only with a proof that no write can land)

Owns page ownership and its counters. Must never touch KV storage (it hands out slot
numbers only), and must never free pages a writer may still hit: `finish` is legal only
from `decoding` (D owns those pages; no transfer writes them), and `held` pages return
to `free` only through `release_held` with a `Proof`. Timeouts are not proofs.
Thread-safe: D's gRPC handlers and its step loop call it concurrently.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np


class PageState(enum.IntEnum):
    FREE = 0
    RESERVED = 1
    FILLED = 2
    DECODING = 3
    HELD = 4


class Proof(enum.Enum):
    """Why held pages may be reused (PROTOCOL.md 2, proofs a-c)."""

    ABORT_ACK = "abort_ack"  # (a) P proved batch quiesce for the request
    NEW_INSTANCE = "new_instance"  # (b) P restarted: the old process cannot write any more
    RECEIVER_STATE = "receiver_state"  # (c) the transport drops late writes itself (TCP v3)


class NoCapacity(Exception):
    """Not enough free pages (or slots); nothing was allocated."""

    def __init__(self, free: int, needed: int, unit: str = "pages") -> None:
        super().__init__(f"no capacity: {needed} {unit} needed, {free} free")
        self.free = free
        self.needed = needed


class IllegalTransition(Exception):
    """A transition the state machine does not allow; names request, state and attempt."""


@dataclass
class _Request:
    pages: list[int]
    total_tokens: int
    state: PageState
    # The slot of every token, built once: pages never change after RESERVE, and a
    # decode step asks for every stream's context slots (rebuilding them from the page
    # list cost ~50 us per 2k-token stream, several ms per step at 128 streams).
    slot_array: np.ndarray | None = None


# (attempted transition, states it may start from, resulting state)
_TRANSITIONS: dict[str, tuple[tuple[PageState, ...], PageState]] = {
    "mark_filled": ((PageState.RESERVED,), PageState.FILLED),
    "start_decoding": ((PageState.FILLED,), PageState.DECODING),
    "finish": ((PageState.DECODING,), PageState.FREE),
    "hold": ((PageState.RESERVED, PageState.FILLED), PageState.HELD),
    "release_held": ((PageState.HELD,), PageState.FREE),
}


# A page holds `page_size` consecutive slots; page p covers slots
# `[p * page_size, (p + 1) * page_size)`. A request's pages need not be contiguous: the
# free list is FIFO (freed pages join the tail, allocation takes the head), so after
# churn a request's pages come from many earlier owners, which is the fragmentation real
# traffic produces and the transfer path must handle. Allocation is O(pages needed).
class PagePool:
    def __init__(self, n_pages: int, page_size: int = 1) -> None:
        if n_pages < 1:
            raise ValueError(f"n_pages must be >= 1 (got {n_pages})")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 (got {page_size})")
        self.n_pages = n_pages
        self.page_size = page_size
        self.n_slots = n_pages * page_size
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(n_pages))
        self._requests: dict[int, _Request] = {}
        self._pages_in: dict[PageState, int] = {s: 0 for s in PageState}
        self._pages_in[PageState.FREE] = n_pages
        self._stats: dict[str, int] = {
            "reserve_total": 0,
            "mark_filled_total": 0,
            "start_decoding_total": 0,
            "finish_total": 0,
            "hold_total": 0,
            "release_held_total": 0,
            "no_capacity_total": 0,
            "illegal_transition_total": 0,
        }
        for proof in Proof:
            self._stats[f"released_by_proof_{proof.value}"] = 0

    # ------------------------------------------------------------------ transitions
    def reserve(self, request_id: int, n_tokens: int, total_tokens: int) -> np.ndarray:
        """Allocate pages for `total_tokens` (prompt + max decode frames) -> RESERVED.
        Returns the slots of the first `n_tokens` tokens (the transfer destinations).
        Raises NoCapacity without allocating anything."""
        if not 0 <= n_tokens <= total_tokens or total_tokens < 1:
            raise ValueError(
                f"request {request_id}: need 0 <= n_tokens ({n_tokens}) <= total_tokens "
                f"({total_tokens}) and total_tokens >= 1"
            )
        needed = -(-total_tokens // self.page_size)
        with self._lock:
            if request_id in self._requests:
                self._stats["illegal_transition_total"] += 1
                raise IllegalTransition(
                    f"request {request_id}: reserve attempted in state "
                    f"{self._requests[request_id].state.name} (a request reserves once)"
                )
            if needed > len(self._free):
                self._stats["no_capacity_total"] += 1
                raise NoCapacity(len(self._free), needed)
            pages = [self._free.popleft() for _ in range(needed)]
            self._requests[request_id] = _Request(pages, total_tokens, PageState.RESERVED)
            self._pages_in[PageState.FREE] -= needed
            self._pages_in[PageState.RESERVED] += needed
            self._stats["reserve_total"] += 1
            # a copy: the caller keeps these (transfer destinations), the views are read-only
            return self._slots_locked(self._requests[request_id], request_id, n_tokens).copy()

    def mark_filled(self, request_id: int) -> None:
        """RESERVED -> FILLED: every row arrived (checksum verified)."""
        self._transition(request_id, "mark_filled")

    def start_decoding(self, request_id: int) -> None:
        """FILLED -> DECODING: D owns the pages from now on."""
        self._transition(request_id, "start_decoding")

    def finish(self, request_id: int) -> None:
        """DECODING -> FREE: the stream ended or was cancelled while decoding."""
        self._transition(request_id, "finish")

    def hold(self, request_id: int) -> None:
        """RESERVED|FILLED -> HELD: the transfer failed, was cancelled or timed out; a
        write may still land, so the pages are not reusable yet."""
        self._transition(request_id, "hold")

    def release_held(self, request_id: int, proof: Proof) -> None:
        """HELD -> FREE, only with a proof that no write of the request can land."""
        if not isinstance(proof, Proof):
            raise TypeError(
                f"request {request_id}: release_held needs a Proof "
                f"({', '.join(p.name for p in Proof)}), got {proof!r}"
            )
        self._transition(request_id, "release_held", proof)

    def _transition(self, request_id: int, name: str, proof: Proof | None = None) -> None:
        allowed, target = _TRANSITIONS[name]
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.state not in allowed:
                self._stats["illegal_transition_total"] += 1
                current = "absent (no pages)" if req is None else req.state.name
                raise IllegalTransition(
                    f"request {request_id}: {name} attempted in state {current}; "
                    f"{name} is legal only from {'|'.join(s.name for s in allowed)}"
                )
            n = len(req.pages)
            self._pages_in[req.state] -= n
            self._pages_in[target] += n
            self._stats[f"{name}_total"] += 1
            if proof is not None:
                self._stats[f"released_by_proof_{proof.value}"] += 1
            if target is PageState.FREE:
                self._free.extend(req.pages)
                del self._requests[request_id]
            else:
                req.state = target

    # ------------------------------------------------------------------ queries
    def slot_of(self, request_id: int, token_index: int) -> int:
        """Slot of the request's token #token_index; valid for any index < total_tokens."""
        with self._lock:
            req = self._get(request_id)
            if not 0 <= token_index < req.total_tokens:
                raise IndexError(
                    f"request {request_id}: token index {token_index} outside "
                    f"[0, total_tokens={req.total_tokens})"
                )
            page, offset = divmod(token_index, self.page_size)
            return req.pages[page] * self.page_size + offset

    def slots(self, request_id: int, n_tokens: int) -> np.ndarray:
        """int64 slots of tokens [0, n_tokens)."""
        with self._lock:
            return self._slots_locked(self._get(request_id), request_id, n_tokens)

    def pages_of(self, request_id: int) -> np.ndarray:
        """int64 page ids owned by the request, in token order."""
        with self._lock:
            return np.asarray(self._get(request_id).pages, dtype=np.int64)

    def state_of(self, request_id: int) -> PageState | None:
        with self._lock:
            req = self._requests.get(request_id)
            return None if req is None else req.state

    def requests(self, state: PageState | None = None) -> list[int]:
        with self._lock:
            return [r for r, q in self._requests.items() if state is None or q.state is state]

    @property
    def held_pages(self) -> int:
        with self._lock:
            return self._pages_in[PageState.HELD]

    @property
    def free_pages(self) -> int:
        with self._lock:
            return self._pages_in[PageState.FREE]

    @property
    def used_pages(self) -> int:
        with self._lock:
            return self.n_pages - self._pages_in[PageState.FREE]

    def counts(self) -> dict[str, int]:
        """Pages per state name (lower case: free, reserved, filled, decoding, held)."""
        with self._lock:
            return {s.name.lower(): n for s, n in self._pages_in.items()}

    def stats(self) -> dict[str, int]:
        """Transition counters, released_by_proof_<kind>, no_capacity_total."""
        with self._lock:
            return dict(self._stats)

    # ------------------------------------------------------------------ helpers
    def _get(self, request_id: int) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id} owns no pages in this pool")
        return req

    def _slots_locked(self, req: _Request, request_id: int, n_tokens: int) -> np.ndarray:
        if not 0 <= n_tokens <= req.total_tokens:
            raise IndexError(
                f"request {request_id}: {n_tokens} tokens outside [0, total_tokens={req.total_tokens}]"
            )
        if req.slot_array is None:
            idx = np.arange(req.total_tokens, dtype=np.int64)
            pages = np.asarray(req.pages, dtype=np.int64)
            req.slot_array = pages[idx // self.page_size] * self.page_size + idx % self.page_size
            req.slot_array.flags.writeable = False  # callers get views of it
        return req.slot_array[:n_tokens]
