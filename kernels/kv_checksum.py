"""The KV transfer checksum on the GPU: one Triton kernel, one pass over the rows.

Computes exactly the number engine/kv/checksum.py defines (that module owns the
definition and the host reference; this one only reproduces it where the pool lives).
P and D compute it for EVERY transfer, D beside its decode steps, so it must be cheap:
each program reads one (token, layer, K|V) row once and writes one partial sum, added on
the host with wrapping uint64 arithmetic (independent of the order). Must never write the
pool. Needs a contiguous pool `[n_layers, 2, n_slots, n_kv_heads, head_dim]` with 1-, 2-,
4- or 8-byte elements (1: an fp8 pool, kernels/kv_dtype.py).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

try:  # CPU-only installs have no usable Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

# Triton's interpreter runs the kernel on CPU tensors (tests without a GPU).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SPLITMIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def available(storage: torch.Tensor) -> bool:
    """Whether the kernel can run on `storage` (Triton present, tensor on CUDA or
    interpreted, contiguous, a supported element width)."""
    return (triton is not None and (storage.is_cuda or INTERPRET) and storage.is_contiguous()
            and storage.element_size() in _WORDS)


if triton is not None:

    @triton.jit
    def _checksum_rows(pool, slots, tokens, partial, plane_stride, row_elems, per_token,
                       c0, c1, c2, UNSIGNED: tl.constexpr, BLOCK: tl.constexpr):
        # program (i, p): sampled token i, plane p = layer * 2 + (0 for K, 1 for V)
        i = tl.program_id(0)
        p = tl.program_id(1).to(tl.int64)
        n_planes = tl.num_programs(1)
        t = tl.load(tokens + i)  # the token's index within the request (int64)
        slot = tl.load(slots + t)
        row = pool + p * plane_stride + slot * row_elems
        first = (t * per_token + p * row_elems).to(tl.uint64)
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        for e0 in range(0, row_elems, BLOCK):
            e = e0 + tl.arange(0, BLOCK)
            live = e < row_elems
            word = tl.load(row + e, mask=live, other=0).to(UNSIGNED, bitcast=True).to(tl.uint64)
            # splitmix64 of the element's global index: wrapping uint64 arithmetic
            z = first + e.to(tl.uint64) + c0
            z = (z ^ (z >> 30)) * c1
            z = (z ^ (z >> 27)) * c2
            z = z ^ (z >> 31)
            acc += word * (z | 1)
        tl.store(partial + i * n_planes + p, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


_UNSIGNED = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def kv_checksum_device(storage: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> int:
    """The checksum of `storage`'s rows at `slots[tokens]` (slots: every token of the
    request in order, int64; tokens: the sampled token indices, int64), both on the host
    or on storage's device. Blocks until the result is on the host."""
    if not available(storage):
        raise RuntimeError("the checksum kernel needs Triton and a contiguous CUDA pool of 1/2/4/8-byte elements "
                           f"(got {storage.device}, contiguous={storage.is_contiguous()}, {storage.dtype})")
    n_layers, _, n_slots = storage.shape[:3]
    row_elems = int(storage.shape[3] * storage.shape[4])
    width = storage.element_size()
    dev = storage.device
    n_tokens = int(tokens.numel())
    if n_tokens == 0:
        return 0
    partial = torch.empty((n_tokens, n_layers * 2), dtype=torch.int64, device=dev)
    words = storage.view(_WORDS[width])
    block = min(1024, triton.next_power_of_2(row_elems))
    c0, c1, c2 = _SPLITMIX
    # Triton launches on the calling thread's current device, and checks its pointers
    # there: the pool's device must be current (the proxy maps regions of both GPUs).
    with torch.cuda.device(dev) if storage.is_cuda else contextlib.nullcontext():
        _checksum_rows[(n_tokens, n_layers * 2)](
            words, slots.to(dev, torch.int64), tokens.to(dev, torch.int64), partial,
            n_slots * row_elems, row_elems, n_layers * 2 * row_elems, c0, c1, c2,
            UNSIGNED=getattr(tl, _UNSIGNED[width]), BLOCK=block)
    host = partial.cpu().numpy().view(np.uint64)
    return int(host.sum(dtype=np.uint64))
