"""Building a TTSModel from a model spec: deterministic random weights or a checkpoint.

Owns the two spec forms: `random:<config>:<seed>`, or a local directory with
`config.json`, whose `model_type` selects the model family (engine/model/registry.py;
absent = `pdunit`), and `model.safetensors` or sharded files with
`model.safetensors.index.json` (engine/model/checkpoint.py). Every problem is one
ValueError at load, naming the field, tensor or file. Must never fetch anything from the
network. Random weights are bit-identical for a seed on any machine (`_fill_tensor`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pdunit.engine.model.checkpoint import (
    INDEX_FILE,
    WEIGHTS_FILE,
    has_weights,
    load_mapped,
    read_tensors,
)
from pdunit.engine.model.config import CONFIGS, ModelConfig, dtype_name, get_config, torch_dtype
from pdunit.engine.model.family import ParsedConfig
from pdunit.engine.model.registry import family_for, random_shape, random_shape_names
from pdunit.engine.model.transformer import TTSModel

CONFIG_FILE = "config.json"

# Scale of the output heads relative to 1/sqrt(hidden): logits with a standard deviation
# of about 3 make greedy choices clear-cut yet leave seeded sampling with real choices.
_HEAD_GAIN = 3.0


def load_model(spec: str, device: str = "cpu", dtype: str | None = None) -> TTSModel:
    """`random:<config>:<seed>` or a checkpoint directory (the module docstring); `config`
    is a pdunit shape (engine/model/config.py) or a family's random shape (`csm-tiny`).
    `dtype` overrides the config's compute/KV dtype (the returned model's config says
    the dtype it really uses). Its GEMMs run in the model dtype until
    `TTSModel.set_prefill_gemm`. Raises ValueError naming what is wrong."""
    if dtype is not None:
        torch_dtype(dtype)  # fail fast on a bad name
    if spec.startswith("random:"):
        parts = spec.split(":")
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(
                f"model spec {spec!r}: expected random:<config>:<seed> with a non-negative "
                "integer seed, e.g. random:tiny:0"
            )
        model = _random_model(parts[1], device, dtype)
        _fill_random(model, int(parts[2]))
    else:
        model = _load_checkpoint(spec, device, dtype)
    c = model.config
    if model.frame_generator is None and c.head_vocab_sizes != c.vocab_sizes:
        raise ValueError(
            f"model {spec!r}: its head gives {len(c.head_vocab_sizes)} of {c.n_codebooks} columns "
            "(head_codebooks) and no frame generator gives the rest; set head_codebooks to null"
        )
    model.eval()
    model.requires_grad_(False)
    return model


def _random_model(name: str, device: str, dtype: str | None) -> TTSModel:
    """A model of the named shape with uninitialised weights: a pdunit config, or a
    family's random shape."""
    shape = random_shape(name)
    if shape is None:
        if name not in CONFIGS:
            raise ValueError(
                f"unknown model config {name!r}: known configs are "
                f"{', '.join([*CONFIGS, *random_shape_names()])}"
            )
        config = get_config(name)
        if dtype is not None:
            config = dataclasses.replace(config, dtype=dtype)
        return TTSModel(config, device=device)
    family, parsed = shape
    if dtype is not None:
        parsed = ParsedConfig(dataclasses.replace(parsed.model, dtype=dtype), parsed.extras)
    return family.build(parsed, device)


def save_model(model: TTSModel, directory: str) -> None:
    """Write config.json (with the model's real dtype) and model.safetensors."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(model.config, dtype=dtype_name(model.dtype))
    (out / CONFIG_FILE).write_text(json.dumps(config.to_json_dict(), indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_FILE))


def _init_std(name: str, shape: tuple[int, ...], config: ModelConfig) -> float | None:
    """Standard deviation of a tensor's random init; None = ones (norm weights)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith("embed.weight"):
        # A row's embedding is the sum of n_codebooks entries: unit variance in total.
        return 1.0 / math.sqrt(config.n_codebooks)
    fan_in = shape[1]  # [out, in] matrices, and a frame generator's [K-1, in, out] heads
    if name == "head.weight" or name.endswith(".heads"):
        return _HEAD_GAIN / math.sqrt(fan_in)
    return 1.0 / math.sqrt(fan_in)


def _fill_random(model: TTSModel, seed: int) -> None:
    # One task per tensor: numpy's generator and torch's copy release the GIL, so threads
    # cut a 4B-parameter init several-fold; each tensor's values depend only on its name.
    params = list(model.named_parameters())
    workers = max(1, min(8, os.cpu_count() or 1, len(params)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in pool.map(lambda item: _fill_tensor(item[0], item[1], model.config, seed), params):
            pass


# Random weights are generated per tensor from numpy's PCG64 seeded by (seed, CRC32 of
# the tensor name), as float32 uniforms built from integer draws only (no transcendental
# functions), then cast to the model dtype: the same seed gives bit-identical weights on
# any machine and for any device, and one tensor's values do not depend on the others.
@torch.no_grad()
def _fill_tensor(name: str, param: torch.Tensor, config: ModelConfig, seed: int) -> None:
    std = _init_std(name, tuple(param.shape), config)
    if std is None:
        param.fill_(1.0)
        return
    entropy = np.random.SeedSequence([seed, zlib.crc32(name.encode())])
    rng = np.random.Generator(np.random.PCG64(entropy))
    u = rng.random(param.numel(), dtype=np.float32)  # exact: (uint32 >> 8) * 2**-24
    half_width = np.float32(std * math.sqrt(3.0))  # uniform with standard deviation std
    w = (u * np.float32(2.0) - np.float32(1.0)) * half_width
    param.copy_(torch.from_numpy(w).view(param.shape))


def _load_checkpoint(spec: str, device: str, dtype: str | None) -> TTSModel:
    directory = Path(spec)
    if not (directory / CONFIG_FILE).is_file() or not has_weights(directory):
        raise ValueError(
            f"model spec {spec!r} is neither random:<config>:<seed> nor a directory holding "
            f"{CONFIG_FILE} and {WEIGHTS_FILE} (or {INDEX_FILE} and its shards)"
        )
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
    except ValueError as e:
        raise ValueError(f"{directory / CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{directory / CONFIG_FILE} must hold a JSON object")
    model_type = raw.get("model_type", "pdunit")
    family = family_for(str(model_type))
    parsed = family.parse_config(raw, name=directory.name)
    if dtype is not None:
        parsed = ParsedConfig(dataclasses.replace(parsed.model, dtype=dtype), parsed.extras)
    model = family.build(parsed, device)
    tensors = read_tensors(directory)
    load_mapped(model, tensors, family.weight_map(parsed, set(tensors)), family.ignored, str(directory))
    return model
