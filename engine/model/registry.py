"""The model-family registry: a checkpoint's config.json `model_type` -> its family.

Owns the list of families (one file each, engine/model/family_<name>.py) and the refusal
of an unknown `model_type`, naming the supported ones. Must never hold a family's
parsing or weights: those stay in its file, beneath this one (they import only
engine/model/family.py's interface, so the families and the registry form no loop).
"""

from __future__ import annotations

from pdunit.engine.model.family import ModelFamily, ParsedConfig
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


def random_shape(name: str) -> tuple[ModelFamily, ParsedConfig] | None:
    """The family and parsed config of a family's random shape `name`; None: no family has it."""
    for family in _registry().values():
        shapes = family.random_shapes()
        if name in shapes:
            return family, shapes[name]
    return None


def random_shape_names() -> list[str]:
    return sorted(n for f in _registry().values() for n in f.random_shapes())
