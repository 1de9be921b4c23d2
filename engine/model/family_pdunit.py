"""The `pdunit` family: pdunit's own model form and checkpoint format.

Parallel heads (one per codebook from one hidden state), per-head q/k norm; config.json
holds ModelConfig's fields by name (`model_type` "pdunit" or absent) and the tensors
carry the engine's own names. Must never accept a field ModelConfig does not have.
"""

from __future__ import annotations

from typing import Any

import torch

from pdunit.engine.model.checkpoint import WeightMap
from pdunit.engine.model.config import ModelConfig
from pdunit.engine.model.family import ModelFamily, ParsedConfig
from pdunit.engine.model.transformer import TTSModel


class PdunitFamily(ModelFamily):
    model_type = "pdunit"

    def parse_config(self, raw: dict[str, Any], name: str) -> ParsedConfig:
        values = {k: v for k, v in raw.items() if k != "model_type"}
        return ParsedConfig(ModelConfig.from_json_dict(values))

    def build(self, parsed: ParsedConfig, device: str | torch.device) -> TTSModel:
        return TTSModel(parsed.model, device=device)

    def weight_map(self, parsed: ParsedConfig, checkpoint_names: set[str]) -> WeightMap:
        model = TTSModel(parsed.model, device="meta")
        return {name: (name,) for name, _ in model.named_parameters()}
