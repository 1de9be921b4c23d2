"""Model shapes: the named configs of the multi-codebook TTS decoder (ARCHITECTURE.md 4).

Owns the numbers that define a model (layers, heads, vocabularies, EOS id, compute dtype,
backbone variants) and the KV size they imply. Must never hold weights or touch a device.

A prompt row and an output frame are `n_codebooks` ids; column j takes ids in
`[0, vocab_sizes[j])`. Column 0 carries the end-of-stream id `eos_id`.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

import torch

# Compute dtypes (a model's weights and activations) ...
_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# ... and what a KV pool may also hold (`--kv-cache-dtype fp8_e4m3`, kernels/kv_dtype.py).
_POOL_DTYPES: dict[str, torch.dtype] = {**_DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}


def torch_dtype(name: str, pool: bool = False) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`, a compute dtype (`pool`: or a KV pool's, which
    may also be fp8); a clear error lists the supported names."""
    names = _POOL_DTYPES if pool else _DTYPES
    key = name.removeprefix("torch.")
    if key not in names:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(names)}")
    return names[key]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (the inverse of `torch_dtype`, pool dtypes included)."""
    for name, value in _POOL_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}: expected one of {', '.join(_POOL_DTYPES)}")


# kw_only: the spec orders `n_codebooks` (defaulted) before `vocab_sizes` (required).
# Backbone variants a checkpoint may need (defaults = the `pdunit` family's model):
# `qk_norm` (per-head q/k RMSNorm), `head_codebooks` (how many leading columns the
# backbone's head predicts; the others come from the family's frame generator),
# `rope_llama3` (Llama 3 RoPE frequency scaling). A family (engine/model/family.py) maps
# its checkpoint's config onto these fields.
@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    n_codebooks: int = 11
    vocab_sizes: tuple[int, ...]
    eos_id: int
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    # Default compute and KV dtype. `tiny` uses float64 so that PD and monolith frames are
    # bit-identical on CPU whatever the batch composition (BLAS blocking changes rounding
    # with the batch shape; float64 pushes that far below any argmax margin).
    dtype: str = "float32"
    max_positions: int = 8192
    qk_norm: bool = True
    # None: one head per column (every codebook from the backbone's hidden state).
    head_codebooks: int | None = None
    # Llama 3 RoPE scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None = plain RoPE with `rope_theta`.
    rope_llama3: tuple[float, float, float, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "vocab_sizes", tuple(int(v) for v in self.vocab_sizes))
        problems = []
        if self.rope_llama3 is not None:
            if len(self.rope_llama3) != 4:
                problems.append(
                    "rope_llama3 must be [factor, low_freq_factor, high_freq_factor, "
                    f"original_max_positions] (got {list(self.rope_llama3)})"
                )
            else:
                factor, lo, hi, orig = self.rope_llama3
                object.__setattr__(self, "rope_llama3", (float(factor), float(lo), float(hi), int(orig)))
                if not (factor > 0 and 0 < lo < hi and orig > 0):
                    problems.append(
                        "rope_llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor "
                        f"and original_max_positions > 0 (got {list(self.rope_llama3)})"
                    )
        if self.head_codebooks is not None and not 1 <= self.head_codebooks <= self.n_codebooks:
            problems.append(
                f"head_codebooks must be in [1, n_codebooks={self.n_codebooks}] or null "
                f"(got {self.head_codebooks})"
            )
        for f in (
            "n_layers",
            "hidden",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_hidden",
            "n_codebooks",
            "max_positions",
        ):
            if int(getattr(self, f)) <= 0:
                problems.append(f"{f} must be > 0 (got {getattr(self, f)})")
        if len(self.vocab_sizes) != self.n_codebooks:
            problems.append(
                f"vocab_sizes has {len(self.vocab_sizes)} entries, expected one per codebook "
                f"(n_codebooks={self.n_codebooks})"
            )
        if any(v <= 0 for v in self.vocab_sizes):
            problems.append(f"vocab_sizes must all be > 0 (got {self.vocab_sizes})")
        if self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
            problems.append(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE (got {self.head_dim})")
        if self.vocab_sizes and not 0 <= self.eos_id < self.vocab_sizes[0]:
            problems.append(
                f"eos_id {self.eos_id} is outside column 0's vocabulary [0, {self.vocab_sizes[0]})"
            )
        torch_dtype(self.dtype)  # raises on an unknown name
        if problems:
            raise ValueError(f"model config {self.name!r}: " + "; ".join(problems))

    @property
    def vocab_max(self) -> int:
        return max(self.vocab_sizes)

    @property
    def head_vocab_sizes(self) -> tuple[int, ...]:
        """The vocabularies of the columns the backbone's head predicts."""
        n = self.n_codebooks if self.head_codebooks is None else self.head_codebooks
        return self.vocab_sizes[:n]

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """K and V of every layer for one token, in `dtype` (default: the config's)."""
        dt = torch_dtype(self.dtype) if dtype is None else dtype  # a pool's dtype may be fp8
        element = torch.empty((), dtype=dt).element_size()
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * element

    def to_json_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["vocab_sizes"] = list(self.vocab_sizes)
        if self.rope_llama3 is not None:
            out["rope_llama3"] = list(self.rope_llama3)
        return out

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"model config has unknown field(s) {unknown}; known fields: {sorted(known)}"
            )
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING)
        if missing:
            raise ValueError(f"model config is missing field(s) {missing}")
        values = dict(data)
        values["vocab_sizes"] = tuple(values["vocab_sizes"])
        if values.get("rope_llama3") is not None:
            values["rope_llama3"] = tuple(values["rope_llama3"])
        return cls(**values)


CONFIGS: dict[str, ModelConfig] = {
    # CPU tests and `make run`: about 3.3 M parameters.
    "tiny": ModelConfig(
        name="tiny",
        n_layers=2,
        hidden=128,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_hidden=256,
        vocab_sizes=(1024,) * 11,
        eos_id=1023,
        dtype="float64",
    ),
    # The articles' model shape: 36 x K,V x 8 kv-heads x 128 x bf16 = 144 KiB per token.
    # Every column, the text column 0 included, has 4096 ids: one head matrix of uniform
    # width keeps the head a single matmul and costs nothing in KV, which is what the
    # benchmarks measure.
    "qwen3-4b-shape": ModelConfig(
        name="qwen3-4b-shape",
        n_layers=36,
        hidden=2560,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffn_hidden=9728,
        vocab_sizes=(4096,) * 11,
        eos_id=4095,
        dtype="bfloat16",
    ),
}


def get_config(name: str) -> ModelConfig:
    """The named config; an unknown name lists the known ones."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}: known configs are {', '.join(CONFIGS)}")
    return CONFIGS[name]
