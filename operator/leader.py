"""Leader election on a coordination.k8s.io/v1 Lease: one operator replica acts, the rest wait.

Owns the Lease's record (holderIdentity, acquireTime, renewTime, leaseDurationSeconds,
leaseTransitions) and the answer to "may this replica act now" (`may_take`,
`LeaderElector.hold`). Every write is a replace carrying the read resourceVersion, so
of two candidates one gets 409 and loses. A leader that cannot renew must stop acting
at once (main.py stops kopf and exits non-zero), before any standby may take over.
Never acts on any other object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from pdunit.operator.kube import Kube

log = logging.getLogger("pdunit.operator.leader")

# What one failed read or write of the Lease can raise: the API answered an error, or
# the connection failed or timed out. Anything else is a bug and propagates.
LEASE_ERRORS = (ApiException, aiohttp.ClientError, OSError, asyncio.TimeoutError)


def micro_time(at: datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339, microseconds, UTC)."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Observed:
    """The Lease record as last read, and when (monotonic) it was first seen so."""

    holder: str
    renew_time: str
    duration_s: float
    seen_at: float


def observe(previous: Observed | None, spec: dict[str, Any], now: float) -> Observed:
    """The new observation of `spec`: `seen_at` moves only when the record changed."""
    holder = str(spec.get("holderIdentity") or "")
    renew = str(spec.get("renewTime") or "")
    duration = float(spec.get("leaseDurationSeconds") or 0)
    if previous and (previous.holder, previous.renew_time) == (holder, renew):
        return Observed(holder, renew, duration, previous.seen_at)
    return Observed(holder, renew, duration, now)


# A candidate takes the Lease only when it is free (no holder: the last leader released
# it) or when the record has not changed for a whole lease duration by this process's
# monotonic clock (wall clocks of two nodes may disagree; the time a record was first
# seen as it is cannot).
def may_take(observed: Observed, identity: str, now: float) -> bool:
    """Whether `identity` may write itself as holder: the Lease is its own, released, or
    unchanged for a whole lease duration since this process first saw it so."""
    if not observed.holder or observed.holder == identity:
        return True
    return now - observed.seen_at >= observed.duration_s


# The leader renews every `retry_s`; when no renewal succeeded for `renew_deadline_s`
# (shorter than the lease) or another identity holds the record, `hold` returns and the
# caller must stop acting at once: a partitioned leader stops before any standby may
# take over.
class LeaderElector:
    """Acquire, renew and release one Lease for `identity`."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_s: float,
        renew_deadline_s: float,
        retry_s: float,
    ) -> None:
        if not retry_s < renew_deadline_s < lease_s:
            raise ValueError(
                f"leader election needs retry ({retry_s}s) < renew deadline ({renew_deadline_s}s) "
                f"< lease ({lease_s}s): raise --lease-seconds or lower the others"
            )
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_s, self.renew_deadline_s, self.retry_s = lease_s, renew_deadline_s, retry_s
        self.observed: Observed | None = None
        self.where = {"lease": f"{namespace}/{name}", "identity": identity}

    def _spec(self, old: dict[str, Any], now: datetime) -> dict[str, Any]:
        ours = old.get("holderIdentity") == self.identity
        transitions = int(old.get("leaseTransitions") or 0)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_s)),
            "acquireTime": old.get("acquireTime") if ours and old.get("acquireTime") else micro_time(now),
            "renewTime": micro_time(now),
            "leaseTransitions": transitions if ours or not old.get("holderIdentity") else transitions + 1,
        }

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this identity holds the Lease afterwards."""
        mono, now = time.monotonic(), datetime.now(UTC)
        lease = await self.kube.get_lease(self.namespace, self.name)
        if lease is None:
            manifest = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec({}, now),
            }
            created = await self.kube.create_lease(self.namespace, manifest)
            if created is None:  # another candidate created it first
                return False
            self.observed = observe(None, created["spec"], mono)
            return True
        spec = lease.get("spec") or {}
        self.observed = observe(self.observed, spec, mono)
        if not may_take(self.observed, self.identity, mono):
            return False
        lease["spec"] = self._spec(spec, now)
        replaced = await self.kube.replace_lease(self.namespace, self.name, lease)
        if replaced is None:  # the record changed since our read: read again next time
            return False
        self.observed = observe(self.observed, replaced["spec"], mono)
        return True

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this identity holds the Lease (True) or `stop` is set (False)."""
        log.info("waiting for leadership", extra=self.where)
        while not stop.is_set():
            try:
                if await asyncio.wait_for(self.try_acquire_or_renew(), timeout=self.retry_s * 5):
                    log.info("leadership acquired", extra=self.where)
                    return True
            except LEASE_ERRORS as exc:
                log.warning("lease read or write failed", extra={**self.where, "error": repr(exc)})
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.retry_s)
            except TimeoutError:
                pass
        return False

    async def hold(self) -> str:
        """Renew until leadership is lost; returns why. The caller must stop acting."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.retry_s)
            left = self.renew_deadline_s - (time.monotonic() - last_ok)
            try:
                ok = await asyncio.wait_for(self.try_acquire_or_renew(), timeout=max(left, 0.1))
            except LEASE_ERRORS as exc:
                ok = False
                log.warning("lease renewal failed", extra={**self.where, "error": repr(exc)})
            if ok:
                last_ok = time.monotonic()
                continue
            holder = self.observed.holder if self.observed else ""
            if holder and holder != self.identity:
                return f"lease {self.namespace}/{self.name} is held by {holder}"
            if time.monotonic() - last_ok >= self.renew_deadline_s:
                return (
                    f"lease {self.namespace}/{self.name} not renewed for "
                    f"{self.renew_deadline_s:g}s (renew deadline)"
                )

    async def release(self) -> None:
        """Give the Lease up (holder cleared) so a standby takes over at once; best effort."""
        try:
            lease = await self.kube.get_lease(self.namespace, self.name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"] = {
                **lease["spec"],
                "holderIdentity": "",
                "leaseDurationSeconds": 1,
                "renewTime": micro_time(datetime.now(UTC)),
            }
            if await self.kube.replace_lease(self.namespace, self.name, lease) is not None:
                log.info("leadership released", extra=self.where)
        except LEASE_ERRORS as exc:
            log.warning(
                "could not release the lease; a standby takes over when it expires",
                extra={**self.where, "error": repr(exc)},
            )
