"""Reading a checkpoint directory's tensors and copying them into a model by a family's map.

Owns the file layout every family shares (as `transformers` saves it): `model.safetensors`,
or shards listed by `model.safetensors.index.json` (its `weight_map`: tensor name -> shard
file), in bf16, fp16 or fp32 (float64 too, for pdunit's float64 test models); and the
strict copy: every engine tensor filled, every checkpoint tensor used or deliberately
ignored, every shape checked, all problems in one error. Must never know a family's
names (the family's `weight_map` does), never fetch anything from a network.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHECKPOINT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# engine tensor name -> the checkpoint tensors it is made of, concatenated along dim 0
WeightMap = Mapping[str, tuple[str, ...]]


def has_weights(directory: Path) -> bool:
    return (directory / WEIGHTS_FILE).is_file() or (directory / INDEX_FILE).is_file()


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `directory`, on CPU, in its stored dtype.
    Raises ValueError naming a missing weights file, a bad index or a missing shard."""
    from safetensors.torch import load_file

    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"checkpoint index {index} is not a safetensors index with a 'weight_map' "
                f"object ({e!r}); re-save the checkpoint"
            ) from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(
                f"checkpoint {directory}: shard(s) {absent} listed in {INDEX_FILE} are missing; "
                "copy every shard next to the index"
            )
    else:
        raise ValueError(f"checkpoint {directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f), device="cpu").items():
            if t.dtype not in CHECKPOINT_DTYPES:
                raise ValueError(
                    f"checkpoint tensor {name} in {f.name} has dtype {t.dtype}; supported: "
                    "bfloat16, float16, float32"
                )
            tensors[name] = t
    return tensors


@torch.no_grad()
def load_mapped(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    weight_map: WeightMap,
    ignored: Callable[[str], bool],
    where: str,
) -> None:
    """Fill every parameter of `model` from `tensors` through `weight_map` (cast to the
    parameter's dtype). A checkpoint tensor neither mapped nor `ignored` is unexpected.
    Raises ValueError listing every missing, unexpected or mis-shaped tensor."""
    params = dict(model.named_parameters())
    problems = [f"engine tensor {k} has no source in the family's weight map" for k in sorted(set(params) - set(weight_map))]
    used: set[str] = set()
    sources: dict[str, torch.Tensor] = {}
    for name in sorted(params):
        if name not in weight_map:
            continue
        parts = weight_map[name]
        used.update(parts)
        absent = [p for p in parts if p not in tensors]
        if absent:
            problems += [f"missing tensor {p} (expected shape {_expected(params[name], parts, p)})" for p in absent]
            continue
        t = tensors[parts[0]] if len(parts) == 1 else torch.cat([tensors[p] for p in parts])
        if tuple(t.shape) != tuple(params[name].shape):
            got = " + ".join(f"{p} {list(tensors[p].shape)}" for p in parts)
            shape = f"tensor {parts[0]} has shape {list(t.shape)}" if len(parts) == 1 else f"tensors {got} make {list(t.shape)}"
            problems.append(f"{shape}, the config expects {list(params[name].shape)}")
            continue
        sources[name] = t
    unexpected = sorted(k for k in tensors if k not in used and not ignored(k))
    problems += [f"unexpected tensor {k} (shape {list(tensors[k].shape)})" for k in unexpected]
    if problems:
        raise ValueError(f"checkpoint {where} does not match its config: " + "; ".join(problems))
    for name, t in sources.items():
        params[name].copy_(t)


def _expected(param: torch.Tensor, parts: tuple[str, ...], part: str) -> str:
    if len(parts) == 1:
        return str(list(param.shape))
    return f"part of {list(param.shape)}"
