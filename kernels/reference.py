"""Torch reference implementations of the KV row kernels (CPU, or any device torch runs).

Owns the semantics every GPU kernel (same signatures) must match bit for bit, and the
argument validation they share, on pools `[n_layers, 2, n_slots, n_kv_heads, head_dim]`
(a "row" is one slot of one layer's K or V): copy_rows (dst[:, :, dst_slots] =
src[:, :, src_slots]), gather_rows (staging = src[:, :, slots], contiguous) and
scatter_rows (dst[:, :, slots] = staging). Destination slots must be distinct: two rows
aimed at one slot is a caller bug whose result would depend on write order. Must never
allocate pool storage or decide which slots to use.
"""

from __future__ import annotations

import torch

from pdunit.kernels.kv_dtype import index_copy_kv


def _check_pool(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 5 or t.shape[1] != 2:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"{name} has shape {shape}, expected a pool tensor [n_layers, 2, n_slots, "
            "n_kv_heads, head_dim]"
        )


def _check_slots(name: str, slots: torch.Tensor, n_slots: int, distinct: bool) -> None:
    if not isinstance(slots, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of int64, got {type(slots).__name__}")
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError(
            f"{name} must be a 1-D int64 tensor, got {slots.dtype} with shape {tuple(slots.shape)}"
        )
    if slots.numel() == 0:
        return
    lo, hi = int(slots.min()), int(slots.max())
    if lo < 0 or hi >= n_slots:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} contains slot {bad}, outside the pool [0, {n_slots})")
    if distinct and torch.unique(slots).numel() != slots.numel():
        raise ValueError(f"{name} contains duplicate slots: two rows would race for one slot")


def _check_same_geometry(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{a_name} dtype {a.dtype} differs from {b_name} dtype {b.dtype}")
    ga = (a.shape[0], a.shape[3], a.shape[4])
    gb = (b.shape[0], b.shape[3], b.shape[4])
    if ga != gb:
        raise ValueError(
            f"{a_name} geometry (n_layers, n_kv_heads, head_dim) = {ga} differs from {b_name} {gb}"
        )
    if a.device != b.device:
        raise ValueError(f"{a_name} is on {a.device} but {b_name} on {b.device}")


def validate_copy(
    src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """The checks of copy_rows, alone: a transport validates a whole transfer before it
    writes its first chunk."""
    _check_pool("src", src)
    _check_pool("dst", dst)
    _check_same_geometry("src", src, "dst", dst)
    _check_slots("src_slots", src_slots, src.shape[2], distinct=False)
    _check_slots("dst_slots", dst_slots, dst.shape[2], distinct=True)
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(
            f"src_slots has {src_slots.numel()} entries but dst_slots {dst_slots.numel()}"
        )


def copy_rows(
    src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """dst[:, :, dst_slots] = src[:, :, src_slots] for pool tensors [L, 2, S, H, D]."""
    validate_copy(src, src_slots, dst, dst_slots)
    index_copy_kv(dst, 2, dst_slots.to(dst.device), src.index_select(2, src_slots.to(src.device)))


def gather_rows(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """-> staging [L, 2, n, H, D], contiguous."""
    _check_pool("src", src)
    _check_slots("slots", slots, src.shape[2], distinct=False)
    return src.index_select(2, slots.to(src.device)).contiguous()


def scatter_rows(staging: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor) -> None:
    """dst[:, :, slots] = staging for staging [L, 2, n, H, D]."""
    _check_pool("staging", staging)
    _check_pool("dst", dst)
    _check_same_geometry("staging", staging, "dst", dst)
    _check_slots("slots", slots, dst.shape[2], distinct=True)
    if staging.shape[2] != slots.numel():
        raise ValueError(f"staging holds {staging.shape[2]} rows but slots has {slots.numel()}")
    index_copy_kv(dst, 2, slots.to(dst.device), staging)
