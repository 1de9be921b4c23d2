"""Leader election (issue 27.6): the Lease rules as pure functions, and LeaderElector
against an in-memory Lease store with the apiserver's optimistic concurrency (a write
with a stale resourceVersion gets 409, i.e. None)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from pdunit.operator.leader import LeaderElector, Observed, may_take, observe


def test_a_record_held_by_another_is_taken_only_after_a_whole_unchanged_lease() -> None:
    seen = observe(None, {"holderIdentity": "a", "renewTime": "t1", "leaseDurationSeconds": 15}, 100.0)
    assert not may_take(seen, "b", 114.9)
    assert may_take(seen, "b", 115.0)
    # A renewal restarts the clock; the same record read again does not.
    assert observe(seen, {"holderIdentity": "a", "renewTime": "t1", "leaseDurationSeconds": 15}, 110).seen_at == 100
    renewed = observe(seen, {"holderIdentity": "a", "renewTime": "t2", "leaseDurationSeconds": 15}, 110.0)
    assert renewed.seen_at == 110.0 and not may_take(renewed, "b", 115.0)


def test_a_released_or_own_lease_is_taken_at_once() -> None:
    assert may_take(Observed("", "t", 1, 100.0), "b", 100.0)
    assert may_take(Observed("b", "t", 15, 100.0), "b", 100.0)


class FakeKube:
    """One namespace's Leases with resourceVersion checks."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise OSError("connection refused")

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._check()
        return copy.deepcopy(self.leases.get(name))

    async def create_lease(self, namespace: str, lease: dict[str, Any]) -> dict[str, Any] | None:
        self._check()
        name = lease["metadata"]["name"]
        if name in self.leases:
            return None
        self.version += 1
        lease = copy.deepcopy(lease)
        lease["metadata"]["resourceVersion"] = str(self.version)
        self.leases[name] = lease
        return copy.deepcopy(lease)

    async def replace_lease(self, namespace: str, name: str, lease: dict[str, Any]) -> dict[str, Any] | None:
        self._check()
        if self.leases[name]["metadata"]["resourceVersion"] != lease["metadata"].get("resourceVersion"):
            return None
        self.version += 1
        lease = copy.deepcopy(lease)
        lease["metadata"]["resourceVersion"] = str(self.version)
        self.leases[name] = lease
        return copy.deepcopy(lease)


def _elector(kube: FakeKube, identity: str, **timing: float) -> LeaderElector:
    t = {"lease_s": 15.0, "renew_deadline_s": 10.0, "retry_s": 2.0, **timing}
    return LeaderElector(kube, "ns", "op", identity, **t)  # type: ignore[arg-type]


def test_two_candidates_one_leader_and_a_stale_write_loses() -> None:
    async def go() -> None:
        kube = FakeKube()
        a, b = _elector(kube, "a"), _elector(kube, "b")
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
        assert await a.try_acquire_or_renew()  # renewal
        assert kube.leases["op"]["spec"]["holderIdentity"] == "a"
        # b read the record, then a renewed: b's write carries a stale resourceVersion.
        stale = await kube.get_lease("ns", "op")
        assert await a.try_acquire_or_renew()
        assert stale is not None
        stale["spec"]["holderIdentity"] = "b"
        assert await kube.replace_lease("ns", "op", stale) is None
        await a.release()
        assert kube.leases["op"]["spec"]["holderIdentity"] == ""
        assert await b.try_acquire_or_renew()
        assert kube.leases["op"]["spec"]["holderIdentity"] == "b"

    asyncio.run(go())


def test_a_leader_that_cannot_renew_gives_up_before_the_lease_could_pass() -> None:
    async def go() -> None:
        kube = FakeKube()
        a = _elector(kube, "a", lease_s=0.6, renew_deadline_s=0.3, retry_s=0.05)
        assert await a.try_acquire_or_renew()
        kube.down = True  # partitioned from the apiserver
        why = await asyncio.wait_for(a.hold(), timeout=5)
        assert "renew deadline" in why

    asyncio.run(go())


def test_a_leader_whose_lease_another_took_stops_at_once() -> None:
    async def go() -> None:
        kube = FakeKube()
        a = _elector(kube, "a", lease_s=0.6, renew_deadline_s=0.3, retry_s=0.05)
        assert await a.try_acquire_or_renew()
        kube.leases["op"]["spec"]["holderIdentity"] = "b"
        kube.leases["op"]["spec"]["renewTime"] = "later"
        assert "held by b" in await asyncio.wait_for(a.hold(), timeout=5)

    asyncio.run(go())


def test_timings_that_allow_two_leaders_are_refused_naming_the_flags() -> None:
    with pytest.raises(ValueError, match="--lease-seconds"):
        _elector(FakeKube(), "a", lease_s=10.0, renew_deadline_s=10.0)
