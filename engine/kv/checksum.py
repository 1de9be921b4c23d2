"""The KV transfer checksum: P computes it over its source slots, D over its destination
slots; equal iff the rows arrived intact and in the right place (PROTOCOL.md 3, COMMIT).

Owns the definition (written above `kv_checksum`), which a GPU implementation must
reproduce bit for bit. Must never modify storage.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger("pdunit.kv.checksum")
_warned_host = False

_C0 = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)

_MASK64 = (1 << 64) - 1
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED_TORCH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Elements per chunk of the host computation (bounds memory for big models).
_CHUNK_ELEMENTS = 1 << 22


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised SplitMix64 finaliser over uint64 (wrapping arithmetic)."""
    z = x + _C0
    z = (z ^ (z >> np.uint64(30))) * _C1
    z = (z ^ (z >> np.uint64(27))) * _C2
    return z ^ (z >> np.uint64(31))


# The definition:
#
#     checksum = sum over sampled tokens t, layers l, k/v index kv, elements e of
#                word(t, l, kv, e) * (splitmix64(((t * L + l) * 2 + kv) * E + e) | 1)
#     mod 2**64
#
# - t is the token index within the request (0-based position in `slots`); with
#   `sample_every = k` only t = 0, k, 2k, ... are summed (t keeps its full value).
# - E = n_kv_heads * head_dim; e = head * head_dim + dim.
# - word = the element's bits read as an unsigned integer (8, 16, 32 or 64 bits: an fp8
#   pool's elements are 8-bit words), so the check is bit-exact, NaN payloads and signed
#   zeros included.
# - splitmix64 is the standard finaliser (constants above). The weight is odd, so flipping
#   any single bit changes the sum (w * 2**b != 0 mod 2**64 for odd w, b < 64); distinct
#   weights per (t, l, kv, e) make swapped or misplaced rows change it.
# - A wrapping sum is order independent: any reduction order (GPU blocks) gives the same.
def kv_checksum(
    storage: torch.Tensor, slots: np.ndarray | torch.Tensor, sample_every: int = 1
) -> int:
    """uint64 checksum (python int in [0, 2**64)) of every layer's K and V rows of `slots`
    of a pool tensor `[n_layers, 2, n_slots, n_kv_heads, head_dim]`."""
    if storage.dim() != 5 or storage.shape[1] != 2:
        raise ValueError(
            f"storage has shape {tuple(storage.shape)}, expected [n_layers, 2, n_slots, "
            "n_kv_heads, head_dim]"
        )
    if sample_every < 1:
        raise ValueError(f"sample_every must be >= 1 (got {sample_every})")
    width = storage.element_size()
    if width not in _UNSIGNED:
        raise ValueError(f"unsupported element size {width} bytes ({storage.dtype})")
    if isinstance(slots, torch.Tensor):
        slot_arr = slots.to(device="cpu", dtype=torch.int64).reshape(-1)
    else:
        slot_arr = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64).reshape(-1))
    n_slots = storage.shape[2]
    if slot_arr.numel() and (int(slot_arr.min()) < 0 or int(slot_arr.max()) >= n_slots):
        raise ValueError(f"slots outside the pool [0, {n_slots})")
    tokens = torch.arange(0, slot_arr.numel(), sample_every, dtype=torch.int64)
    if storage.is_cuda:
        return _checksum_on_device(storage, slot_arr, tokens)
    return _checksum_on_host(storage, slot_arr, tokens)


def _checksum_on_host(storage: torch.Tensor, slot_arr: torch.Tensor, tokens: torch.Tensor) -> int:
    width = storage.element_size()
    per_token = storage.shape[0] * 2 * storage.shape[3] * storage.shape[4]
    chunk = max(1, _CHUNK_ELEMENTS // per_token)
    within = np.arange(per_token, dtype=np.uint64)
    total = 0
    for start in range(0, tokens.numel(), chunk):
        t = tokens[start : start + chunk]
        src = slot_arr[t].to(storage.device)
        rows = storage.index_select(2, src)  # [L, 2, m, H, D]
        rows = rows.permute(2, 0, 1, 3, 4).contiguous().cpu()  # [m, L, 2, H, D]
        words = rows.view(_SIGNED_TORCH[width]).numpy().view(_UNSIGNED[width])
        words = words.reshape(t.numel(), per_token).astype(np.uint64)
        index = t.numpy().astype(np.uint64)[:, None] * np.uint64(per_token) + within[None, :]
        weights = splitmix64(index) | np.uint64(1)
        total = (total + int(np.sum(words * weights, dtype=np.uint64))) & _MASK64
    return total


def _checksum_on_device(storage: torch.Tensor, slot_arr: torch.Tensor, tokens: torch.Tensor) -> int:
    """The same number as the host path, computed where the pool lives by one Triton
    kernel (kernels/kv_checksum.py): a 2k-token request of the 4B shape is ~150 M words,
    seconds on the host, well under a millisecond there."""
    from pdunit.kernels import kv_checksum as kernel

    if not kernel.available(storage):
        global _warned_host
        if not _warned_host:
            _warned_host = True
            log.warning("KV checksum of a CUDA pool runs on the host (slow): the Triton kernel cannot run here",
                        extra={"dtype": str(storage.dtype), "contiguous": storage.is_contiguous()})
        return _checksum_on_host(storage, slot_arr, tokens)
    return kernel.kv_checksum_device(storage, slot_arr, tokens)
