"""The model-family seam: the `ModelFamily` interface every family implements.

A family (one file each, engine/model/family_<name>.py; docs/models.md) owns what
differs between models: parsing its
checkpoint's config.json into the engine's ModelConfig (plus extras of its own), the
map from checkpoint tensor names to the engine's, the row embedding and the frame
generator it gives the shared backbone (engine/model/transformer.py). This module must
never hold backbone math, and nothing outside engine/model/ may branch on a family.
The registry (`model_type` -> family) is engine/model/registry.py: it imports the families.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from pdunit.engine.model.checkpoint import WeightMap
from pdunit.engine.model.config import ModelConfig
from pdunit.engine.model.request_rules import RowRule
from pdunit.engine.model.transformer import TTSModel


@dataclass(frozen=True)
class ParsedConfig:
    """A family's reading of config.json: the backbone's ModelConfig and its own extras."""

    model: ModelConfig
    extras: Any = None


class ModelFamily(ABC):
    """One model family. `model_type` is the config.json value that selects it."""

    model_type: str

    @abstractmethod
    def parse_config(self, raw: dict[str, Any], name: str) -> ParsedConfig:
        """config.json's object -> ParsedConfig; ValueError naming an unknown, missing or
        unsupported field."""

    @abstractmethod
    def build(self, parsed: ParsedConfig, device: str | torch.device) -> TTSModel:
        """The engine model with uninitialised weights (the loader fills them)."""

    @abstractmethod
    def weight_map(self, parsed: ParsedConfig, checkpoint_names: set[str]) -> WeightMap:
        """Engine tensor name -> the checkpoint tensors it is made of (dim-0 concatenated)."""

    def row_rule(self, parsed: ParsedConfig) -> RowRule | None:
        """What a prompt row must hold beyond its columns' id ranges (None: nothing);
        `build` sets it on the model (`TTSModel.row_rule`), whose Hello carries it to the LB."""
        return None

    def ignored(self, checkpoint_name: str) -> bool:
        """True for a checkpoint tensor the family deliberately does not load."""
        return False

    def random_shapes(self) -> dict[str, ParsedConfig]:
        """The family's named shapes for `random:<name>:<seed>` (tests, benchmarks)."""
        return {}
