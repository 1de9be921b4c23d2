"""The model-family registry: a checkpoint's config.json `model_type` -> its family.

Owns the list of families (one file each, engine/model/family_<name>.py) and the refusal
of an unknown `model_type`, naming the supported ones. Must never hold a family's
parsing or weights: those stay in its file, beneath this one (they import only
engine/model/family.py's interface, so the families and the registry form no loop).
"""

from __future__ import annotations

from pdunit.engine.model.family import ModelFamily
from pdunit.engine.model.family_csm import CsmFamily
from pdunit.engine.model.family_pdunit import PdunitFamily


def _registry() -> dict[str, ModelFamily]:
    return {f.model_type: f for f in (PdunitFamily(), CsmFamily())}


def family_for(model_type: str) -> ModelFamily:
    """The family registered for `model_type`; an unknown one lists the supported."""
    families = _registry()
    if model_type not in families:
        raise ValueError(
            f"config.json model_type {model_type!r} is not a supported model family; "
            f"supported: {', '.join(sorted(families))} (docs/models.md says how to add one)"
        )
    return families[model_type]


def model_types() -> list[str]:
    return sorted(_registry())
