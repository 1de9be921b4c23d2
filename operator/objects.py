"""Plain-dict access to Kubernetes objects exactly as the API serves them (camelCase).

Owns the small readers every operator module shares: an object's metadata, labels and
status, its controller ownerReference, whether it is being deleted, and the RFC 3339
times of conditions and the drain. Must never change an object, do I/O or read the
clock: callers pass `now`, so everything built on these stays a pure function.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def iso(ts: datetime) -> str:
    """RFC 3339, seconds (Kubernetes' convention for conditions)."""
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_us(ts: datetime) -> str:
    """RFC 3339 with microseconds: the drain's empty checks are compared sub-second."""
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def metadata_of(obj: dict[str, Any] | None) -> dict[str, Any]:
    return (obj or {}).get("metadata") or {}


def labels_of(obj: dict[str, Any] | None) -> dict[str, str]:
    return metadata_of(obj).get("labels") or {}


def status_of(obj: dict[str, Any] | None) -> dict[str, Any]:
    return (obj or {}).get("status") or {}


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether `obj`'s controller ownerReference is the object of `uid`."""
    return any(ref.get("uid") == uid and ref.get("controller")
               for ref in metadata_of(obj).get("ownerReferences") or [])


def has_controller(obj: dict[str, Any]) -> bool:
    return any(ref.get("controller") for ref in metadata_of(obj).get("ownerReferences") or [])


def terminating(obj: dict[str, Any] | None) -> bool:
    """Whether `obj` is being deleted (its deletionTimestamp is set)."""
    return bool(metadata_of(obj).get("deletionTimestamp"))
