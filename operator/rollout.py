"""The PDUnitSet controller's plan: which units to create, drain, undrain, relabel or
delete so that the set moves toward its spec, one step per tick.

Owns the rollout (surge a unit of the new template, wait until it is Ready, drain one old
unit, repeat), scale-up and scale-down (`plan_units`), the choice of victims
(`pick_victims`), the set's status and the manifest of a new unit. Must never let the
ready units drop below replicas - maxUnavailable, never delete a unit that still drains
(its finalizer does), never do I/O or read the clock (`now` is given).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pdunit.operator import models as m
from pdunit.operator.objects import labels_of, metadata_of, parse_time, status_of
from pdunit.operator.spec_hash import template_hashes
from pdunit.operator.unit_status import set_condition


@dataclass
class Action:
    """One decision of the set controller. kind: create | drain | undrain | delete |
    relabel (a unit of the current template labelled with its legacy hash)."""

    kind: str
    unit: str | None = None
    template_hash: str | None = None
    reason: str = ""


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    template_hash: str = ""

    def kinds(self) -> list[str]:
        return [a.kind for a in self.actions]


def unit_is_ready(unit: dict[str, Any]) -> bool:
    return bool(status_of(unit).get("ready")) and status_of(unit).get("phase") == "Ready"


def unit_in_flight(unit: dict[str, Any]) -> int:
    return int(status_of(unit).get("inFlight") or 0)


def unit_deleting(unit: dict[str, Any]) -> bool:
    return bool(metadata_of(unit).get("deletionTimestamp"))


def unit_draining(unit: dict[str, Any]) -> bool:
    return bool((unit.get("spec") or {}).get("draining"))


def unit_drained(unit: dict[str, Any]) -> bool:
    return status_of(unit).get("phase") == "Drained"


def pick_victims(units: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The n units to remove first: not-ready first, then fewest streams in flight,
    then the newest (least warm cache), then by name for a stable order."""
    if n <= 0:
        return []

    def key(u: dict[str, Any]) -> tuple[int, int, float, str]:
        created = parse_time(metadata_of(u).get("creationTimestamp"))
        age_key = -created.timestamp() if created else 0.0
        return (1 if unit_is_ready(u) else 0, unit_in_flight(u), age_key, metadata_of(u).get("name", ""))

    return sorted(units, key=key)[:n]


def plan_units(unitset: dict[str, Any], units: list[dict[str, Any]]) -> Plan:
    """Actions that move the set's units toward spec (one step; call again next tick).

    - Drained units are deleted; units being deleted are left to their finalizer.
    - Units of the current template hash are "new", others "old".
    - Missing new units: reclaim draining new units first (undrain), then create; while
      old units remain, creations are capped so that all units (draining included)
      stay within replicas + maxSurge.
    - Removal (drain) of old units, then of new units beyond replicas: not-ready units
      always may go; a ready unit only while the ready count stays >= replicas -
      maxUnavailable. So a rollout surges, waits for the new unit to be Ready, drains
      one old unit, and repeats; a scale-down drains the excess at once.
    """
    spec = unitset.get("spec") or {}
    replicas = int(spec.get("replicas", 1))
    strategy = spec.get("strategy") or {}
    max_surge = int(strategy.get("maxSurge", 1))
    max_unavailable = int(strategy.get("maxUnavailable", 0))
    hashes = template_hashes(spec.get("template") or {})
    current = hashes[0]
    plan = Plan(template_hash=current)
    for u in units:
        if labels_of(u).get(m.LABEL_TEMPLATE_HASH) == hashes[1] != current and not unit_deleting(u):
            plan.actions.append(Action("relabel", unit=metadata_of(u)["name"], template_hash=current,
                                       reason="its template, hashed without API defaults"))

    active: list[dict[str, Any]] = []
    draining: list[dict[str, Any]] = []
    for u in units:
        name = metadata_of(u).get("name")
        if unit_deleting(u):
            draining.append(u)
        elif unit_drained(u):
            plan.actions.append(Action("delete", unit=name, reason="drained"))
        elif unit_draining(u):
            draining.append(u)
        else:
            active.append(u)
    new = [u for u in active if labels_of(u).get(m.LABEL_TEMPLATE_HASH) in hashes]
    old = [u for u in active if labels_of(u).get(m.LABEL_TEMPLATE_HASH) not in hashes]

    missing = replicas - len(new)
    if missing > 0:
        reclaimable = [
            u
            for u in draining
            if not unit_deleting(u) and labels_of(u).get(m.LABEL_TEMPLATE_HASH) in hashes
        ]
        for u in reclaimable[:missing]:
            plan.actions.append(
                Action(
                    "undrain",
                    unit=metadata_of(u)["name"],
                    reason=f"scale-up to {replicas}: reuse a draining unit",
                )
            )
            active.append(u)
            draining.remove(u)
            missing -= 1
        creates = missing
        if old:
            total = len(active) + len(draining)
            creates = min(missing, replicas + max_surge - total)
        for _ in range(max(0, creates)):
            why = f"rollout to template {current}" if old else f"scale-up to {replicas}"
            plan.actions.append(Action("create", template_hash=current, reason=why))

    ready_count = sum(1 for u in active if unit_is_ready(u))
    budget = ready_count - (replicas - max_unavailable)
    removals: list[tuple[dict[str, Any], str]] = []
    for u in pick_victims(old, len(old)):
        if not unit_is_ready(u):
            removals.append((u, "rollout: replace a not-ready unit of an old template"))
        elif budget > 0:
            budget -= 1
            removals.append((u, f"rollout: replaced by template {current}"))
    excess = len(new) - replicas
    for u in pick_victims(new, max(0, excess)):
        if not unit_is_ready(u):
            removals.append((u, f"scale-down to {replicas}: not ready"))
        elif budget > 0:
            budget -= 1
            removals.append((u, f"scale-down to {replicas}: {unit_in_flight(u)} streams in flight"))
    for u, why in removals:
        plan.actions.append(Action("drain", unit=metadata_of(u)["name"], reason=why))
    return plan


def set_status(
    unitset: dict[str, Any], units: list[dict[str, Any]], now: datetime
) -> dict[str, Any]:
    """PDUnitSet status: counts over its units, the /scale selector, conditions."""
    spec = unitset.get("spec") or {}
    replicas = int(spec.get("replicas", 1))
    max_unavailable = int((spec.get("strategy") or {}).get("maxUnavailable", 0))
    hashes = template_hashes(spec.get("template") or {})
    active = [u for u in units if not (unit_deleting(u) or unit_draining(u) or unit_drained(u))]
    ready = sum(1 for u in active if unit_is_ready(u))
    updated = sum(1 for u in active if labels_of(u).get(m.LABEL_TEMPLATE_HASH) in hashes)
    name = metadata_of(unitset)["name"]
    conditions = status_of(unitset).get("conditions")
    available = ready >= replicas - max_unavailable
    conditions = set_condition(
        conditions,
        "Available",
        available,
        "MinimumUnitsReady" if available else "TooFewReadyUnits",
        f"{ready}/{replicas} units ready",
        now,
    )
    progressing = updated < replicas or len(active) != replicas or ready < replicas
    conditions = set_condition(
        conditions,
        "Progressing",
        progressing,
        "Reconciling" if progressing else "Complete",
        f"{updated} updated, {len(active)} current, {ready} ready of {replicas}",
        now,
    )
    conditions = set_condition(conditions, "SpecValid", True, "Valid", "", now)
    conditions = set_condition(conditions, "Reconciled", True, "Reconciled", "", now)
    return {
        "replicas": len(active),
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "drainingReplicas": len(units) - len(active),
        "selector": f"{m.LABEL_SET}={name}",
        "templateHash": hashes[0],
        "observedGeneration": metadata_of(unitset).get("generation"),
        "conditions": conditions,
    }


def new_unit(unitset: dict[str, Any], thash: str) -> dict[str, Any]:
    """A PDUnit manifest for the set's current template (name from generateName)."""
    meta = metadata_of(unitset)
    template = (unitset.get("spec") or {}).get("template") or {}
    tmeta = template.get("metadata") or {}
    labels = dict(tmeta.get("labels") or {})
    labels.update({m.LABEL_SET: meta["name"], m.LABEL_TEMPLATE_HASH: thash})
    spec = dict(template.get("spec") or {})
    spec["draining"] = False
    return {
        "apiVersion": m.API_VERSION,
        "kind": m.UNIT_KIND,
        "metadata": {
            "generateName": f"{meta['name']}-{thash[:5]}-",
            "namespace": meta.get("namespace"),
            "labels": labels,
            "annotations": dict(tmeta.get("annotations") or {}),
            "ownerReferences": [
                {
                    "apiVersion": m.API_VERSION,
                    "kind": m.SET_KIND,
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
    }


def invalid_set_status(unitset: dict[str, Any], message: str, now: datetime) -> dict[str, Any]:
    """Status of a set whose spec the operator cannot use: SpecValid=False naming the
    field; the /scale selector stays, so `kubectl scale` still finds the set."""
    meta = metadata_of(unitset)
    return {
        "conditions": set_condition(status_of(unitset).get("conditions"), "SpecValid", False, "InvalidSpec",
                                    message, now),
        "observedGeneration": meta.get("generation"),
        "selector": f"{m.LABEL_SET}={meta['name']}",
    }


def unit_patch(action: Action) -> dict[str, Any]:
    """The patch of the unit a drain, undrain or relabel action changes."""
    if action.kind in ("drain", "undrain"):
        return {"spec": {"draining": action.kind == "drain"}}
    if action.kind == "relabel" and action.template_hash:
        return {"metadata": {"labels": {m.LABEL_TEMPLATE_HASH: action.template_hash}}}
    raise ValueError(f"action {action.kind!r} patches no unit: expected drain, undrain or relabel")


_EVENTS = {"create": "UnitCreated", "drain": "UnitDraining", "undrain": "UnitUndrained",
           "relabel": "UnitRelabelled", "delete": "UnitDeleted"}


def action_event(action: Action, unit_name: str | None = None) -> tuple[str, str]:
    """(reason, message) of the Event an action done posts on the set; `unit_name`: the
    unit it acted on (a created unit's generated name)."""
    unit = unit_name or action.unit
    verbs = {"create": "created unit", "drain": "draining unit", "undrain": "keeping unit",
             "delete": "deleted unit", "relabel": "unit"}
    if action.kind not in _EVENTS:
        raise ValueError(f"unknown action {action.kind!r}; expected one of {', '.join(_EVENTS)}")
    return _EVENTS[action.kind], f"{verbs[action.kind]} {unit}: {action.reason}"
