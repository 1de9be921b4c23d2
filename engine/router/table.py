"""The router's unit table: who exists, who may take new streams, and how loaded each is.

Owns per unit what discovery says, what its `/v1/load` says (polled here, parsed as a
LoadDocument), the streams this router has open to it and the sessions routed to it;
and the decision (`pick`): consistent hashing with bounded load for session keys,
least-loaded otherwise, over routable units with headroom first. Load and headroom are
the unit's last report corrected by the streams this router opened since (the report
lags). A unit is routable only when discovery and its last poll say ready and not
draining and nothing refused a stream since. Must never proxy HTTP (proxy.py does).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from pdunit.engine.lb.load import LoadDocumentError, read_load_document
from pdunit.engine.router.hashring import DEFAULT_VNODES, HashRing, load_bound


def _load_of(unit: Unit) -> int:
    return unit.load


STATES = ("routable", "draining", "unready", "full", "unreachable", "pending")


@dataclass(frozen=True)
class DiscoveredUnit:
    """What discovery knows about a unit (a static list entry or a PDUnit's status)."""

    name: str
    url: str  # "" while the unit has no address yet (pod not scheduled)
    ready: bool = True
    draining: bool = False
    phase: str = ""


@dataclass
class Unit:
    name: str
    url: str
    phase: str = ""
    discovered_ready: bool = True
    discovered_draining: bool = False
    polled: bool = False  # at least one poll answered since the URL was set
    reachable: bool = False
    unit_ready: bool = False
    unit_draining: bool = False
    full: bool = False  # answered 429 since the last poll
    rejected: bool = False  # answered 503 since the last poll
    unit_in_flight: int = 0  # streams_in_flight at the last poll
    unit_headroom: int = -1  # headroom_streams at the last poll; -1: no rate-floor admission
    router_in_flight_at_poll: int = 0
    router_in_flight: int = 0  # streams this router has open to the unit now
    sessions: int = 0
    last_poll_at: float = 0.0  # monotonic
    last_error: str = ""
    routable: bool = False
    # The estimates the decision reads: kept as plain fields (set by `update_load`)
    # because the least-loaded scan reads them for every unit on every keyless request.
    load: int = 0
    headroom: int = -1  # streams it would still admit now; -1: no limit known

    def update_load(self) -> None:
        """Load: the unit's report plus the streams this router opened since (it misses
        other routers' since), never below this router's own open count. Headroom: the
        report's minus those streams (-1 stays -1: no rate-floor admission, no limit)."""
        opened = self.router_in_flight - self.router_in_flight_at_poll
        self.load = max(self.router_in_flight, self.unit_in_flight + opened)
        self.headroom = -1 if self.unit_headroom < 0 else max(0, self.unit_headroom - opened)

    @property
    def draining(self) -> bool:
        return self.discovered_draining or self.unit_draining

    @property
    def ready(self) -> bool:
        return self.discovered_ready and self.unit_ready and not self.rejected

    @property
    def state(self) -> str:
        if not self.url or not self.polled:
            return "pending"
        if not self.reachable:
            return "unreachable"
        if self.draining:
            return "draining"
        if not self.ready:
            return "unready"
        if self.full:
            return "full"
        return "routable"


@dataclass(frozen=True)
class Decision:
    unit: Unit
    how: str  # "affinity" | "walked" | "least_loaded" | "over_bound" | "no_headroom"
    bound: int


class RoutingTable:
    """Units by name, the hash ring over them, and the routing decision.

    `on_unit_gone(name)` is called once a removed unit holds no stream of this router
    any more: its `unit`-labelled series live exactly as long as that."""

    def __init__(
        self,
        load_bound_factor: float = 1.25,
        vnodes: int = DEFAULT_VNODES,
        max_tracked_sessions: int = 100_000,
        logger: logging.Logger | None = None,
        on_unit_gone: Callable[[str], None] | None = None,
    ) -> None:
        if load_bound_factor <= 1.0:
            raise ValueError(f"load_bound_factor must be > 1.0, got {load_bound_factor}")
        self.factor = load_bound_factor
        self.units: dict[str, Unit] = {}
        self.ring = HashRing(vnodes)
        self.max_tracked_sessions = max_tracked_sessions
        self.log = logger or logging.getLogger("pdunit.router.table")
        self.membership_changed = asyncio.Event()
        self.on_unit_gone = on_unit_gone
        self._routable: list[Unit] = []
        self._roomy: list[Unit] = []  # routable units with headroom (> 0 or no limit)
        self._total_load = 0  # sum of load over routable units, kept exact incrementally
        self._rr = 0
        self._sessions: OrderedDict[str, str] = OrderedDict()

    # ---- discovery side -------------------------------------------------------------

    def upsert(self, found: DiscoveredUnit) -> None:
        unit = self.units.get(found.name)
        if unit is None:
            unit = Unit(name=found.name, url=found.url)
            self.units[found.name] = unit
            self.ring.add(found.name)
            self.log.info("unit added", extra={"unit": found.name, "url": found.url})
            self.membership_changed.set()
        elif unit.url != found.url:
            # A new pod behind the same name: nothing the old address said holds.
            self.log.info(
                "unit address changed",
                extra={"unit": found.name, "url": found.url, "old_url": unit.url},
            )
            unit.url = found.url
            unit.polled = unit.reachable = unit.unit_ready = unit.unit_draining = False
            unit.full = unit.rejected = False
            unit.unit_in_flight = unit.router_in_flight_at_poll = 0
            unit.unit_headroom = -1
            unit.update_load()
            self.membership_changed.set()
        unit.discovered_ready = found.ready
        unit.discovered_draining = found.draining
        unit.phase = found.phase
        self._refresh(unit)

    def remove(self, name: str) -> None:
        unit = self.units.pop(name, None)
        if unit is None:
            return
        self.ring.remove(name)
        self.log.info(
            "unit removed", extra={"unit": name, "router_in_flight": unit.router_in_flight}
        )
        self._recount()
        if unit.router_in_flight == 0:
            self._gone(name)

    def _gone(self, name: str) -> None:
        if self.on_unit_gone is not None and name not in self.units:
            self.on_unit_gone(name)

    def replace_all(self, found: list[DiscoveredUnit]) -> None:
        """Make the table hold exactly these units (a fresh list from discovery)."""
        names = {f.name for f in found}
        for name in list(self.units):
            if name not in names:
                self.remove(name)
        for f in found:
            self.upsert(f)

    # ---- what units say about themselves --------------------------------------------

    def apply_load(
        self,
        name: str,
        *,
        ready: bool,
        draining: bool,
        streams_in_flight: int,
        headroom_streams: int = -1,
    ) -> None:
        """What a unit's `/v1/load` said (LoadPoller parses it): its own ready/draining,
        streams in flight, and rate-floor headroom (-1: no admission, no limit)."""
        unit = self.units.get(name)
        if unit is None:
            return
        before = unit.state
        unit.polled = unit.reachable = True
        unit.unit_ready, unit.unit_draining = ready, draining
        unit.full = unit.rejected = False
        unit.unit_in_flight = streams_in_flight
        unit.unit_headroom = max(-1, headroom_streams)
        unit.router_in_flight_at_poll = unit.router_in_flight
        unit.update_load()
        unit.last_poll_at = time.monotonic()
        unit.last_error = ""
        self._refresh(unit, before)

    def apply_poll_error(self, name: str, error: str) -> None:
        unit = self.units.get(name)
        if unit is None:
            return
        before = unit.state
        unit.polled = True
        unit.reachable = False
        unit.last_poll_at = time.monotonic()
        unit.last_error = error
        self._refresh(unit, before)

    def mark_rejected(self, name: str, status: int, message: str) -> None:
        """The unit refused a stream (503 draining/unready, 429 full, 502 failing to start
        one): skip it until the next poll says otherwise, so the next requests don't hit
        the same wall."""
        unit = self.units.get(name)
        if unit is None:
            return
        before = unit.state
        if status == 429:
            unit.full = True
        else:
            unit.rejected = True
        unit.last_error = f"HTTP {status}: {message}"
        self._refresh(unit, before)

    def mark_unreachable(self, name: str, error: str) -> None:
        self.apply_poll_error(name, error)

    # ---- the routing decision -------------------------------------------------------

    def routable_count(self) -> int:
        return len(self._routable)

    def total_load(self) -> int:
        return self._total_load

    def current_bound(self) -> int:
        return load_bound(self._total_load, len(self._routable), self.factor)

    def pick(self, session: str | None, exclude: frozenset[str] = frozenset()) -> Decision | None:
        """The unit for the next stream, or None when no routable unit is left.

        With a session key: the first routable, non-excluded unit with headroom on the
        key's ring walk whose load is below the bound. Without one: the least-loaded
        routable unit with headroom (ties rotate). Excluded units are those this request
        already tried. Units without headroom come only when no unit with room is left
        ("no_headroom": their D has the last word).
        """
        routable = self._routable
        if not routable:
            return None
        bound = load_bound(self._total_load, len(routable), self.factor)
        units = self.units
        if session:
            first = True
            for name in self.ring.walk(session):
                unit = units[name]
                if unit.routable and unit.headroom and name not in exclude and unit.load < bound:
                    return Decision(unit, "affinity" if first else "walked", bound)
                first = False
            # Only reachable when every unit with room below the bound was excluded: the
            # bound balances, it is not a capacity limit, so the least loaded of the rest goes.
        best = self._least_loaded(self._roomy, exclude)
        if best is not None:
            return Decision(best, "least_loaded" if not session else "over_bound", bound)
        best = self._least_loaded(routable, exclude)
        if best is None:
            return None
        return Decision(best, "no_headroom", bound)

    def _least_loaded(self, routable: list[Unit], exclude: frozenset[str]) -> Unit | None:
        n = len(routable)
        if not n:
            return None
        start = self._rr % n
        self._rr += 1
        if not exclude:
            # min() keeps the first of equal loads: starting the scan at a rotating
            # offset spreads ties (~5 us for 100 units on a 2-core box).
            return min(itertools.chain(routable[start:], routable[:start]), key=_load_of)
        best: Unit | None = None
        for i in range(n):
            unit = routable[(start + i) % n]
            if unit.name not in exclude and (best is None or unit.load < best.load):
                best = unit
        return best

    def acquire(self, unit: Unit) -> None:
        """A proxied stream to `unit` is open (counted from the request's send)."""
        had_room = unit.headroom != 0
        unit.router_in_flight += 1
        unit.update_load()
        if unit.routable and self.units.get(unit.name) is unit:
            if had_room and unit.headroom == 0:
                self._recount()  # its last room was just taken
            else:
                self._total_load += 1  # load moves by exactly one with router_in_flight

    def release(self, unit: Unit) -> None:
        """That stream is closed. Count its outcome before: once a unit that left the
        table has no stream open, its series are removed (`on_unit_gone`)."""
        had_room = unit.headroom != 0
        unit.router_in_flight -= 1
        unit.update_load()
        if self.units.get(unit.name) is not unit:
            if unit.router_in_flight == 0:
                self._gone(unit.name)
        elif unit.routable:
            if not had_room and unit.headroom != 0:
                self._recount()  # room again
            else:
                self._total_load -= 1

    def record_session(self, session: str, unit: Unit) -> bool:
        """Remember the unit a session's stream went to; True when the session moved."""
        previous = self._sessions.pop(session, None)
        moved = previous is not None and previous != unit.name
        if previous is not None and previous in self.units:
            self.units[previous].sessions -= 1
        self._sessions[session] = unit.name
        unit.sessions += 1
        while len(self._sessions) > self.max_tracked_sessions:
            _, oldest = self._sessions.popitem(last=False)
            if oldest in self.units:
                self.units[oldest].sessions -= 1
        return moved

    def session_unit(self, session: str) -> str | None:
        return self._sessions.get(session)

    # ---- bookkeeping ----------------------------------------------------------------

    def _refresh(self, unit: Unit, before: str | None = None) -> None:
        after = unit.state
        routable = after == "routable"
        if before is not None and before != after:
            level = logging.WARNING if after in ("unreachable", "unready") else logging.INFO
            self.log.log(
                level,
                "unit state changed",
                extra={
                    "unit": unit.name,
                    "url": unit.url,
                    "from_state": before,
                    "to_state": after,
                    "error": unit.last_error,
                },
            )
        unit.routable = routable
        # Loads or routability moved: rebuild the routable list and the exact total.
        self._recount()

    def _recount(self) -> None:
        self._routable = [u for u in self.units.values() if u.routable]
        self._roomy = [u for u in self._routable if u.headroom]
        self._total_load = sum(u.load for u in self._routable)

    def counts_by_state(self) -> dict[str, int]:
        counts = dict.fromkeys(STATES, 0)
        for unit in self.units.values():
            counts[unit.state] += 1
        return counts

    def snapshot(self) -> dict[str, Any]:
        """The routing table as `/v1/units` serves it."""
        now = time.monotonic()
        bound = self.current_bound()
        units = []
        for unit in sorted(self.units.values(), key=lambda u: u.name):
            units.append(
                {
                    "name": unit.name,
                    "url": unit.url,
                    "phase": unit.phase,
                    "state": unit.state,
                    "routable": unit.routable,
                    "ready": unit.ready,
                    "draining": unit.draining,
                    "reachable": unit.reachable,
                    "in_flight": unit.load,
                    "router_in_flight": unit.router_in_flight,
                    "unit_in_flight": unit.unit_in_flight,
                    "headroom_streams": unit.headroom,
                    "unit_headroom_streams": unit.unit_headroom,
                    "load_bound": bound,
                    "over_bound": unit.load >= bound,
                    "sessions": unit.sessions,
                    "last_poll_age_s": round(now - unit.last_poll_at, 3)
                    if unit.last_poll_at
                    else None,
                    "last_error": unit.last_error,
                }
            )
        return {
            "load_bound_factor": self.factor,
            "load_bound": bound,
            "routable_units": len(self._routable),
            "units_with_headroom": len(self._roomy),
            "total_in_flight": self._total_load,
            "tracked_sessions": len(self._sessions),
            "units": units,
        }


class LoadPoller:
    """Reads every unit's `/v1/load` each interval (and at once when units appear)."""

    def __init__(
        self,
        table: RoutingTable,
        client: httpx.AsyncClient,
        interval_s: float,
        timeout_s: float,
        on_failure: Any = None,
    ) -> None:
        self.table = table
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_failure = on_failure  # callable(unit_name) for the failure counter

    async def poll_unit(self, name: str, url: str) -> None:
        try:
            resp = await self.client.get(url + "/v1/load", timeout=self.timeout_s)
            if resp.status_code != 200:
                raise RuntimeError(f"/v1/load answered HTTP {resp.status_code}")
            doc = read_load_document(resp.content)
        except LoadDocumentError as exc:
            self._failed(name, url, f"poll {url}/v1/load: {exc}")
            return
        except (httpx.HTTPError, RuntimeError) as exc:
            self._failed(name, url, f"poll {url}/v1/load failed: {exc!r}")
            return
        unit = self.table.units.get(name)
        if unit is not None and unit.url == url:
            self.table.apply_load(
                name,
                ready=doc.ready,
                draining=doc.draining,
                streams_in_flight=doc.streams_in_flight,
                headroom_streams=doc.headroom_streams,
            )

    def _failed(self, name: str, url: str, error: str) -> None:
        # The unit may have been removed or re-addressed while we waited.
        unit = self.table.units.get(name)
        if unit is not None and unit.url == url:
            self.table.apply_poll_error(name, error)
            if self.on_failure is not None:
                self.on_failure(name)

    async def poll_once(self) -> None:
        targets = [(u.name, u.url) for u in self.table.units.values() if u.url]
        if targets:
            await asyncio.gather(*(self.poll_unit(n, url) for n, url in targets))

    async def run(self) -> None:
        changed = self.table.membership_changed
        while True:
            changed.clear()
            await self.poll_once()
            try:
                await asyncio.wait_for(changed.wait(), timeout=self.interval_s)
            except TimeoutError:
                pass
