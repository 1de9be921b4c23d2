"""`--kv-cache-dtype`'s values: the names of the KV pool precisions, torch-free.

Owns the one list of names; kernels/kv_dtype.py says what each means for the bytes.
Must never import torch: the LB, the router and the operator read these names (through
engine/settings.py and the CRD models) in processes that never load torch.
"""

from __future__ import annotations

from typing import Literal, get_args

KvCacheDtype = Literal["auto", "fp8_e4m3"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
