"""Torch reference row kernels: semantics every GPU kernel must match, and validation."""

from __future__ import annotations

import pytest
import torch

from pdunit.kernels.reference import copy_rows, gather_rows, scatter_rows

SHAPE = (2, 2, 32, 2, 4)


def pool(seed: int, dtype: torch.dtype = torch.bfloat16, slots: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE[:2] + (slots,) + SHAPE[3:], generator=g).to(dtype)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_copy_rows_moves_every_layers_k_and_v_rows_and_nothing_else() -> None:
    src, dst = pool(0), pool(1, slots=20)
    before = dst.clone()
    src_slots, dst_slots = ids(31, 0, 7, 7), ids(3, 19, 0, 11)  # a source row may repeat
    copy_rows(src, src_slots, dst, dst_slots)
    for s, d in zip(src_slots.tolist(), dst_slots.tolist(), strict=True):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    untouched = [i for i in range(20) if i not in dst_slots.tolist()]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])


def test_gather_then_scatter_equals_copy() -> None:
    src = pool(2)
    a, b = pool(3), pool(3)
    src_slots, dst_slots = ids(5, 9, 1, 30), ids(0, 31, 16, 2)
    staging = gather_rows(src, src_slots)
    assert staging.shape == (2, 2, 4, 2, 4) and staging.is_contiguous()
    scatter_rows(staging, a, dst_slots)
    copy_rows(src, src_slots, b, dst_slots)
    assert torch.equal(a, b)


def test_empty_slot_lists_copy_nothing() -> None:
    src, dst = pool(4), pool(5)
    before = dst.clone()
    copy_rows(src, ids(), dst, ids())
    assert torch.equal(dst, before)


@pytest.mark.parametrize(
    ("src", "src_slots", "dst", "dst_slots", "message"),
    [
        (pool(0), ids(1), pool(0, torch.float32), ids(1), "dtype"),
        (pool(0), ids(1), torch.zeros(2, 2, 32, 4, 4, dtype=torch.bfloat16), ids(1), "geometry"),
        (pool(0), ids(1, 2), pool(0), ids(1), "2 entries but dst_slots 1"),
        (pool(0), ids(32), pool(0), ids(1), "src_slots contains slot 32"),
        (pool(0), ids(1), pool(0), ids(-1), "dst_slots contains slot -1"),
        (pool(0), ids(1, 2), pool(0), ids(5, 5), "duplicate"),
        (pool(0), torch.tensor([1], dtype=torch.int32), pool(0), ids(1), "int64"),
        (pool(0)[0], ids(1), pool(0), ids(1), "src has shape"),
    ],
)
def test_copy_rows_rejects_bad_arguments_naming_the_problem(
    src: torch.Tensor,
    src_slots: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
    message: str,
) -> None:
    before = dst.clone()
    with pytest.raises(ValueError, match=message):
        copy_rows(src, src_slots, dst, dst_slots)
    assert torch.equal(dst, before)


def test_scatter_rows_checks_the_staging_size() -> None:
    with pytest.raises(ValueError, match="staging holds 3 rows but slots has 2"):
        scatter_rows(gather_rows(pool(0), ids(1, 2, 3)), pool(1), ids(4, 5))
