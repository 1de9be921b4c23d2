"""Hashes of PDUnit specs and PDUnitSet templates: how the operator tells that a pod or a
unit is of the current spec (the pod's spec-hash annotation, the unit's template-hash label).

Owns the hash and the rule that fields at their API defaults never change it. Must never
hash anything the apiserver may fill in by itself: a CRD upgrade adding a defaulted field
would change every hash, and roll every unit of every set.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdunit.operator import models as m


def _hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:10]



# Every PDUnit spec field that has a value without being set: its default, by wire name.
_UNIT_DEFAULTS: dict[str, Any] = {
    f.alias or name: f.default for name, f in m.PDUnitSpec.model_fields.items() if not f.is_required()
}


def _without_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's fields that differ from the API's defaults. The apiserver fills a
    field's CRD default into every stored object it serves, so a CRD upgrade adding a
    defaulted field would change every hash of the full spec, and roll every unit."""
    return {k: v for k, v in spec.items() if k not in _UNIT_DEFAULTS or _UNIT_DEFAULTS[k] != v}


def template_hashes(template: dict[str, Any]) -> tuple[str, str]:
    """(current, legacy) hashes of a PDUnitSet template (labels + spec): a change starts a
    rollout. The current one leaves out fields at their defaults; a unit labelled with
    the legacy one (the full spec, before 2026-11-30) has the same template."""
    labels = (template.get("metadata") or {}).get("labels") or {}
    spec = template.get("spec") or {}
    return _hash({"labels": labels, "spec": _without_defaults(spec)}), _hash({"labels": labels, "spec": spec})


def spec_hashes(spec: dict[str, Any]) -> tuple[str, str]:
    """(current, legacy) hashes of the pod-shaping part of a PDUnit spec (`draining` does
    not reshape the pod), as `template_hashes`."""
    shaping = {k: v for k, v in spec.items() if k != "draining"}
    return _hash(_without_defaults(shaping)), _hash(shaping)
