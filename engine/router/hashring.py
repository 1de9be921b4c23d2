"""Consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam, 2018).

Owns the ring (virtual nodes of each unit, sorted by hash), the order in which a key
visits units, and the load bound (`load_bound`): a key goes to the first unit clockwise
from its hash whose load is below it.

This module is pure: no I/O, no clock, no knowledge of HTTP or of what "load" means.
It must never decide routability (draining, unready): the caller passes that in.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterator

DEFAULT_VNODES = 160


def key_hash(key: str) -> int:
    """A stable 64-bit hash (same on every router replica and every Python run)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


# The bound is `ceil(c * (L + 1) / n)`, where L is the load already placed on the n
# eligible units and the +1 counts the request being placed (without it an idle cluster
# would have a bound of 0 and nobody could take anything). Because the minimum load is
# at most the average, some unit is always below the bound.
def load_bound(total_load: int, n_units: int, factor: float) -> int:
    """The most streams a unit may hold before a new key skips it: ceil(c * (L + 1) / n)."""
    if n_units <= 0:
        return 0
    # The epsilon keeps float noise (1.1 * 10 / 11 = 1.0000000000000002) from adding one.
    return math.ceil(factor * (total_load + 1) / n_units - 1e-9)


class HashRing:
    """Units placed at `vnodes` pseudo-random points each; a key walks clockwise."""

    def __init__(self, vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._members: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, name: object) -> bool:
        return name in self._members

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def add(self, name: str) -> None:
        if name in self._members:
            return
        self._members.add(name)
        self._rebuild()

    def remove(self, name: str) -> None:
        if name not in self._members:
            return
        self._members.discard(name)
        self._rebuild()

    def _rebuild(self) -> None:
        # Membership changes are rare (discovery events); lookups are per request.
        # Ties between equal hashes are broken by name so every replica agrees.
        points = sorted(
            (key_hash(f"{name}#{i}"), name) for name in self._members for i in range(self.vnodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def walk(self, key: str) -> Iterator[str]:
        """Every member once, in ring order starting at the key's position."""
        n_points = len(self._points)
        if not n_points:
            return
        start = bisect.bisect_right(self._points, key_hash(key))
        seen: set[str] = set()
        n_members = len(self._members)
        owners = self._owners
        for i in range(n_points):
            owner = owners[(start + i) % n_points]
            if owner in seen:
                continue
            seen.add(owner)
            yield owner
            if len(seen) == n_members:
                return

    def owner(self, key: str) -> str | None:
        """The unit a key belongs to when nothing is over its bound."""
        return next(self.walk(key), None)

    def choose(
        self,
        key: str,
        load: Callable[[str], int],
        eligible: Callable[[str], bool],
        bound: int,
    ) -> str | None:
        """First eligible unit on the key's walk whose load is below `bound`, else None."""
        for name in self.walk(key):
            if eligible(name) and load(name) < bound:
                return name
        return None
