"""Building a TTSModel from a model spec: deterministic random weights or a checkpoint.

Owns the two spec forms and the checkpoint format (a directory with `config.json`, the
ModelConfig fields, and `model.safetensors`, the state dict). Must never fetch anything
from the network: a spec is either `random:<config>:<seed>` or a local directory.

Random weights are generated per tensor from numpy's PCG64 seeded by (seed, CRC32 of the
tensor name), as float32 uniforms built from integer draws only (no transcendental
functions), then cast to the model dtype: the same seed gives bit-identical weights on
any machine and for any device, and one tensor's values do not depend on the others.
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

from pdunit.engine.model.config import ModelConfig, dtype_name, get_config, torch_dtype
from pdunit.engine.model.transformer import TTSModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# Scale of the output heads relative to 1/sqrt(hidden): logits with a standard deviation
# of about 3 make greedy choices clear-cut yet leave seeded sampling with real choices.
_HEAD_GAIN = 3.0


def load_model(spec: str, device: str = "cpu", dtype: str | None = None) -> TTSModel:
    """`random:<config>:<seed>` or a directory holding config.json + model.safetensors.
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
        config = get_config(parts[1])
        if dtype is not None:
            config = dataclasses.replace(config, dtype=dtype)
        model = TTSModel(config, device=device)
        _fill_random(model, int(parts[2]))
    else:
        directory = Path(spec)
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise ValueError(
                f"model spec {spec!r} is neither random:<config>:<seed> nor a directory holding "
                f"{CONFIG_FILE} and {WEIGHTS_FILE}"
            )
        config = ModelConfig.from_json_dict(json.loads((directory / CONFIG_FILE).read_text()))
        if dtype is not None:
            config = dataclasses.replace(config, dtype=dtype)
        model = TTSModel(config, device=device)
        _load_weights(model, directory / WEIGHTS_FILE)
    model.eval()
    model.requires_grad_(False)
    return model


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
    if name == "embed.weight":
        # A row's embedding is the sum of n_codebooks entries: unit variance in total.
        return 1.0 / math.sqrt(config.n_codebooks)
    fan_in = shape[1]
    if name == "head.weight":
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


@torch.no_grad()
def _load_weights(model: TTSModel, path: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(path), device="cpu")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = [f"missing tensor {k} (expected shape {list(expected[k].shape)})" for k in missing]
    problems += [f"unexpected tensor {k} (shape {list(tensors[k].shape)})" for k in unexpected]
    for k in sorted(set(expected) & set(tensors)):
        if tuple(tensors[k].shape) != tuple(expected[k].shape):
            problems.append(
                f"tensor {k} has shape {list(tensors[k].shape)}, the config "
                f"{model.config.name!r} expects {list(expected[k].shape)}"
            )
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config: " + "; ".join(problems))
    params = dict(model.named_parameters())
    for k, t in tensors.items():
        params[k].copy_(t)
