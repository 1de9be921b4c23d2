"""The KV checksum: equal iff the rows arrived intact and in place; the definition is
pinned by a naive implementation that a GPU kernel must also match."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pdunit.engine.kv.checksum as checksum_module
from pdunit.engine.kv.checksum import kv_checksum
from pdunit.kernels.reference import copy_rows

MASK = (1 << 64) - 1
SHAPE = (3, 2, 64, 2, 8)  # layers, k/v, slots, kv heads, head dim


def pool(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def naive(storage: torch.Tensor, slots: list[int], sample_every: int = 1) -> int:
    """The documented formula, one element at a time with python integers."""

    def splitmix(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    n_layers, _, _, heads, dim = storage.shape
    e_per_row = heads * dim
    width = storage.element_size() * 8
    ints = storage.view({8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[width])
    total = 0
    for t in range(0, len(slots), sample_every):
        for layer in range(n_layers):
            for kv in range(2):
                row = ints[layer, kv, slots[t]].reshape(-1).tolist()
                for e, word in enumerate(row):
                    index = ((t * n_layers + layer) * 2 + kv) * e_per_row + e
                    total += (word & ((1 << width) - 1)) * (splitmix(index) | 1)
    return total & MASK


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64])
def test_checksum_matches_the_documented_formula(dtype: torch.dtype) -> None:
    storage = pool(dtype)
    slots = [9, 3, 40, 41, 0]
    assert kv_checksum(storage, np.array(slots)) == naive(storage, slots)
    assert kv_checksum(storage, torch.tensor(slots), sample_every=2) == naive(storage, slots, 2)
    assert 0 <= kv_checksum(storage, np.array(slots)) < 2**64


def test_equal_rows_at_other_slots_give_the_same_checksum() -> None:
    src, dst = pool(torch.bfloat16, 1), pool(torch.bfloat16, 2)
    src_slots = torch.tensor([5, 17, 2, 60, 33], dtype=torch.int64)
    dst_slots = torch.tensor([0, 1, 50, 20, 7], dtype=torch.int64)
    assert kv_checksum(src, src_slots) != kv_checksum(dst, dst_slots)
    copy_rows(src, src_slots, dst, dst_slots)
    assert kv_checksum(src, src_slots) == kv_checksum(dst, dst_slots)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64])
def test_one_flipped_bit_anywhere_changes_the_checksum(dtype: torch.dtype) -> None:
    storage = pool(dtype, 3)
    slots = np.array([4, 8, 15, 16, 23, 42])
    reference = kv_checksum(storage, slots)
    ints = storage.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[storage.element_size()])
    rng = np.random.default_rng(0)
    bits = storage.element_size() * 8
    for _ in range(40):
        layer, kv, head, d = (int(rng.integers(n)) for n in (3, 2, 2, 8))
        slot = int(rng.choice(slots))
        bit = int(rng.integers(bits))
        flipped = ints.clone()
        one = (
            torch.tensor(1, dtype=ints.dtype) << bit
            if bit < bits - 1
            else torch.tensor(torch.iinfo(ints.dtype).min, dtype=ints.dtype)
        )
        flipped[layer, kv, slot, head, d] ^= one
        assert kv_checksum(flipped.view(dtype), slots) != reference, (layer, kv, slot, bit)


def test_swapped_rows_change_the_checksum() -> None:
    storage = pool(torch.bfloat16, 4)
    slots = np.array([3, 9, 27, 30])
    reference = kv_checksum(storage, slots)
    assert kv_checksum(storage, slots[[1, 0, 2, 3]]) != reference  # tokens swapped
    swapped_kv = storage.clone()
    swapped_kv[:, [0, 1]] = storage[:, [1, 0]]  # K and V exchanged
    assert kv_checksum(swapped_kv, slots) != reference
    swapped_layers = storage.clone()
    swapped_layers[[0, 1]] = storage[[1, 0]]
    assert kv_checksum(swapped_layers, slots) != reference


def test_a_row_written_to_the_wrong_slot_is_detected() -> None:
    src = pool(torch.bfloat16, 5)
    dst = torch.zeros_like(src)
    src_slots = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    dst_slots = torch.tensor([10, 11, 12, 13], dtype=torch.int64)
    misplaced = torch.tensor([10, 11, 12, 14], dtype=torch.int64)  # last row one slot off
    copy_rows(src, src_slots, dst, misplaced)
    assert kv_checksum(dst, dst_slots) != kv_checksum(src, src_slots)


def test_sampled_checksum_covers_only_every_kth_token() -> None:
    storage = pool(torch.float32, 6)
    slots = np.arange(10, 30)
    ref1, ref4 = kv_checksum(storage, slots), kv_checksum(storage, slots, sample_every=4)
    changed = storage.clone()
    changed[0, 0, slots[5], 0, 0] += 1.0  # token 5: not sampled with k = 4
    assert kv_checksum(changed, slots, sample_every=4) == ref4
    assert kv_checksum(changed, slots) != ref1
    changed[0, 0, slots[8], 0, 0] += 1.0  # token 8: sampled
    assert kv_checksum(changed, slots, sample_every=4) != ref4


def test_checksum_does_not_depend_on_how_the_work_is_chunked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = pool(torch.bfloat16, 7)
    slots = np.random.default_rng(1).permutation(64)[:50]
    whole = kv_checksum(storage, slots)
    monkeypatch.setattr(checksum_module, "_CHUNK_ELEMENTS", 1)  # one token per chunk
    assert kv_checksum(storage, slots) == whole


def test_checksum_rejects_bad_arguments() -> None:
    storage = pool(torch.float32)
    with pytest.raises(ValueError, match="outside the pool"):
        kv_checksum(storage, np.array([64]))
    with pytest.raises(ValueError, match="sample_every"):
        kv_checksum(storage, np.array([1]), sample_every=0)
    with pytest.raises(ValueError, match="expected"):
        kv_checksum(storage[0], np.array([1]))

# The device path (a Triton kernel) is checked against this definition in
# tests/kernels/test_kv_checksum.py.
