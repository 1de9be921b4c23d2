"""The KV cache's storage precision: the model's dtype, or fp8 e4m3 (`--kv-cache-dtype`).

Owns what an fp8 pool means, so that every writer (the fused store kernel, the torch
reference forward, the monolith's prompt copy) and every reader (the paged decode and
prefill kernels, their references) agree bit for bit: K and V rows are stored as
`torch.float8_e4m3fn` with scale 1 (as vLLM's and SGLang's uncalibrated fp8 KV cache), a
value outside +-448 saturates to +-448 instead of becoming NaN, and a reader widens each
element to the query's dtype before any arithmetic. Must never choose slots or allocate a
pool. The flag's names live torch-free in kernels/kv_dtype_names.py.
"""

from __future__ import annotations

import torch

from pdunit.kernels.kv_dtype_names import KV_CACHE_DTYPES

FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # the largest finite e4m3fn value


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype` -> the pool tensor's dtype ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_KV
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows computed in the model's dtype -> the pool's dtype (saturating for fp8)."""
    if dtype == FP8_KV:
        return x.float().clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV)
    return x.to(dtype)


def index_copy_kv(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.index_copy_(dim, index, src)` for every pool dtype: torch has no fp8
    index_copy on the CPU, so 1-byte pools copy their bytes."""
    if dst.element_size() == 1:
        dst.view(torch.uint8).index_copy_(dim, index, src.view(torch.uint8))
    else:
        dst.index_copy_(dim, index, src)
