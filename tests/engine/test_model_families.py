"""The model-family seam: the registry, the pdunit family's checkpoints, the shared
checkpoint reader (single file, shards, dtypes) and the backbone options' defaults."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.engine.model.config import CONFIGS, ModelConfig
from pdunit.engine.model.loader import load_model, save_model
from pdunit.engine.model.registry import family_for, model_types
from pdunit.engine.model.transformer import ForwardBatch, TTSModel


@pytest.fixture(scope="module")
def model() -> TTSModel:
    return load_model("random:tiny:0")


def logits_of(m: TTSModel) -> torch.Tensor:
    rows = np.random.default_rng(0).integers(0, 1000, (9, 11))
    return m(ForwardBatch.from_sequences([rows], [np.arange(9)]), m.new_kv_storage(16))


def test_registry_maps_model_type_to_its_family() -> None:
    assert model_types() == ["csm", "pdunit"]
    assert family_for("pdunit").model_type == "pdunit" and family_for("csm").model_type == "csm"
    with pytest.raises(ValueError, match=r"model_type 'llama' is not a supported model family; supported: csm, pdunit"):
        family_for("llama")


def test_pdunit_checkpoint_loads_with_or_without_model_type(model: TTSModel, tmp_path: Path) -> None:
    save_model(model, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "model_type" not in cfg  # today's format: no model_type = the pdunit family
    assert torch.equal(logits_of(load_model(str(tmp_path))), logits_of(model))
    cfg["model_type"] = "pdunit"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert torch.equal(logits_of(load_model(str(tmp_path))), logits_of(model))


def test_sharded_pdunit_checkpoint_equals_the_single_file(model: TTSModel, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_model(model, str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(logits_of(load_model(str(tmp_path))), logits_of(model))


def test_unsupported_tensor_dtype_is_refused_naming_the_tensor(model: TTSModel, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_model(model, str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["norm.weight"] = tensors["norm.weight"].to(torch.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor norm.weight in model.safetensors has dtype torch.int32"):
        load_model(str(tmp_path))


def test_unexpected_tensor_is_refused_naming_it(model: TTSModel, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_model(model, str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.bias"] = torch.zeros(3, dtype=torch.float64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensor lm_head.bias \(shape \[3\]\)"):
        load_model(str(tmp_path))


def test_backbone_options_default_to_the_pdunit_model() -> None:
    tiny = CONFIGS["tiny"]
    assert tiny.qk_norm and tiny.head_codebooks is None and tiny.rope_llama3 is None
    assert tiny.head_vocab_sizes == tiny.vocab_sizes
    m = TTSModel(tiny, device="meta")
    assert m.layers[0].attn.q_norm is not None
    assert tuple(m.head.weight.shape) == (sum(tiny.vocab_sizes), tiny.hidden)


def test_backbone_options_are_validated_by_name() -> None:
    import dataclasses

    with pytest.raises(ValueError, match=r"head_codebooks must be in \[1, n_codebooks=11\]"):
        dataclasses.replace(CONFIGS["tiny"], head_codebooks=12)
    with pytest.raises(ValueError, match="rope_llama3 needs factor > 0"):
        dataclasses.replace(CONFIGS["tiny"], rope_llama3=(8.0, 4.0, 1.0, 16))
    cfg = dataclasses.replace(CONFIGS["tiny"], rope_llama3=(8.0, 1.0, 4.0, 16), head_codebooks=1)
    assert ModelConfig.from_json_dict(json.loads(json.dumps(cfg.to_json_dict()))) == cfg
