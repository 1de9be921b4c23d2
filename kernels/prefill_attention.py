"""Fused prefill attention over the paged KV pool: a varlen flash-attention Triton kernel.

Owns attention for sequences with SEVERAL new tokens (a whole prompt, a prompt after a
cached prefix, or one chunk of a chunked prefill), all sequences of a forward in one
launch, reading K/V straight from the pool through decode's slot table
(kernels/paged_attention.build_slot_table). Sequence s's new tokens are the last
`q_len[s]` of its `ctx_len[s]` context entries, causal and aligned bottom-right (a cached
prefix is visible to every new token), as engine/model/transformer.py's torch reference.
The launch shape is a `PrefillTile`. Must never write the pool or decide which tokens a
sequence sees. The work split and precision: docs/performance.md, "Kernel notes".
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import torch

from pdunit.kernels.kv_dtype import FP8_KV
from pdunit.kernels.paged_attention import HALF_DTYPES, INTERPRET, build_slot_table, compute_dtype

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None



@dataclass(frozen=True)
class PrefillTile:
    """The kernel's launch shape. `block_m` counts tile rows (new rows x the query heads
    of one kv head), so a tile covers block_m // group new rows; `pdunit bench attention`
    sweeps these on a GPU (attention-20261130-h200x2.md picked the default: best
    over its points, 6% ahead of 128x64w8s3 at 4 prompts x 1500 rows)."""

    block_m: int = 256
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"PrefillTile.{name} = {v}: need a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 6:
            raise ValueError(f"PrefillTile: num_warps {self.num_warps} (1..16, a power of two), "
                             f"num_stages {self.num_stages} (1..6)")

    @classmethod
    def parse(cls, text: str) -> PrefillTile:
        """'128x64w8s3' -> block_m 128, block_n 64, 8 warps, 3 stages."""
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text.strip())
        if not m:
            raise ValueError(f"prefill tile {text!r} is not BLOCK_MxBLOCK_NwWARPSsSTAGES (e.g. 128x64w8s3)")
        return cls(*(int(g) for g in m.groups()))

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}"


DEFAULT_TILE = PrefillTile()


class PrefillPlan(TypedDict):
    """What `paged_prefill_attention` takes beside q, the pool and out."""

    table: torch.Tensor  # int32 [S, W]
    ctx_len: torch.Tensor  # int32 [S]
    q_len: torch.Tensor  # int32 [S]
    q_start: torch.Tensor  # int32 [S]
    max_q_len: int


def prefill_plan(
    query_lens: Sequence[int], context_slots: Sequence[torch.Tensor | np.ndarray], first_row: Sequence[int],
    device: torch.device | str = "cpu", non_blocking: bool = False,
) -> PrefillPlan:
    """The tensors the kernel takes, for the sequences given, built on the CPU and moved
    to `device`: `table` int32 [S, W], `ctx_len`, `q_len`, `q_start` int32 [S], and
    `max_q_len`."""
    if not (len(query_lens) == len(context_slots) == len(first_row)):
        raise ValueError("prefill_plan: query_lens, context_slots and first_row differ in length")
    table, lengths = build_slot_table(context_slots)
    q_len = torch.tensor(list(query_lens), dtype=torch.int32)
    if bool((q_len < 1).any()) or bool((q_len > lengths).any()):
        raise ValueError(f"prefill_plan: need 1 <= q_len <= ctx_len, got {q_len.tolist()} / {lengths.tolist()}")
    q_start = torch.tensor(list(first_row), dtype=torch.int32)
    return {
        "table": table.to(device, non_blocking=non_blocking),
        "ctx_len": lengths.to(device, non_blocking=non_blocking),
        "q_len": q_len.to(device, non_blocking=non_blocking),
        "q_start": q_start.to(device, non_blocking=non_blocking),
        "max_q_len": int(q_len.max()),
    }


def reference_prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    table: torch.Tensor,
    ctx_len: torch.Tensor,
    q_len: torch.Tensor,
    q_start: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Torch reference of `paged_prefill_attention` (float32 math, float64 for float64; an
    fp8 kv_layer widened exactly, as the kernel's widening to q's dtype is); rows of q
    that belong to no sequence come back as zeros."""
    t, hq, d = q.shape
    hkv = kv_layer.shape[2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros_like(q)
    for s in range(table.shape[0]):
        n, length, r0 = int(q_len[s]), int(ctx_len[s]), int(q_start[s])
        idx = table[s, :length].to(q.device, torch.int64)
        k = kv_layer[0][idx].to(ct).repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = kv_layer[1][idx].to(ct).repeat_interleave(hq // hkv, dim=1)
        qs = q[r0 : r0 + n].to(ct)
        sc = torch.einsum("ihd,jhd->hij", qs, k) * scale
        pos = torch.arange(length - n, length, device=q.device)
        allowed = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        sc = sc.masked_fill(~allowed[None], float("-inf"))
        out[r0 : r0 + n] = torch.einsum("hij,jhd->ihd", torch.softmax(sc, -1), v).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _prefill_kernel(
        Q, K, V, Out, Table, CtxLen, QLen, QStart,
        stride_qt, stride_qh,
        stride_ks, stride_kh, stride_vs, stride_vh,
        stride_ot, stride_oh,
        stride_tb,
        scale_log2e,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr,
    ):
        # Tile row r is query head hk * GROUP + r % GROUP at new row p0 + r // GROUP: the
        # GROUP query heads that share kv head hk ride in one tile, so each K/V tile is
        # loaded once for all of them (one program per query head loaded it GROUP times).
        BLOCK_P: tl.constexpr = BLOCK_M // GROUP  # new rows per tile
        pid_p = tl.program_id(0)
        hk = tl.program_id(1)
        s = tl.program_id(2)
        q_len = tl.load(QLen + s)
        if pid_p * BLOCK_P < q_len:
            ctx_len = tl.load(CtxLen + s)
            q_start = tl.load(QStart + s).to(tl.int64)
            r = tl.arange(0, BLOCK_M)
            p = pid_p * BLOCK_P + r // GROUP
            h = hk * GROUP + r % GROUP
            # rows past BLOCK_P * GROUP exist only when GROUP does not divide BLOCK_M
            r_mask = (r < BLOCK_P * GROUP) & (p < q_len)
            pos = ctx_len - q_len + p
            offs_d = tl.arange(0, HEAD_DIM)
            offs_n = tl.arange(0, BLOCK_N)
            q = tl.load(
                Q + (q_start + p)[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                mask=r_mask[:, None],
                other=0.0,
            ).to(WIDE)  # the dots' dtype: paged_attention.compute_dtype
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            row_table = Table + s.to(tl.int64) * stride_tb
            k_head = K + hk * stride_kh
            v_head = V + hk * stride_vh
            # Every row of the tile sees the entries <= its first row's position: whole
            # BLOCK_N tiles below that need no mask at all. The tile's last row sees
            # entries <= first + BLOCK_P - 1: the masked tiles stop there (causal work is
            # skipped, not masked).
            first = ctx_len - q_len + pid_p * BLOCK_P
            open_end = ((first + 1) // BLOCK_N) * BLOCK_N
            kv_end = tl.minimum(ctx_len, first + BLOCK_P)
            for n0 in range(0, open_end, BLOCK_N):
                slots = tl.load(row_table + n0 + offs_n).to(tl.int64)
                k = tl.load(k_head + slots[:, None] * stride_ks + offs_d[None, :])
                qk = tl.dot(q, tl.trans(k.to(WIDE))) * scale_log2e
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                alpha = tl.exp2(m_i - m_new)
                pr = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(pr, 1)
                v = tl.load(v_head + slots[:, None] * stride_vs + offs_d[None, :])
                acc = acc * alpha[:, None] + tl.dot(pr.to(WIDE), v.to(WIDE))
                m_i = m_new
            for n0 in range(open_end, kv_end, BLOCK_N):
                offs = n0 + offs_n
                n_mask = offs < kv_end
                slots = tl.load(row_table + offs, mask=n_mask, other=0).to(tl.int64)
                k = tl.load(k_head + slots[:, None] * stride_ks + offs_d[None, :], mask=n_mask[:, None], other=0.0)
                qk = tl.dot(q, tl.trans(k.to(WIDE))) * scale_log2e
                qk = tl.where(n_mask[None, :] & (offs[None, :] <= pos[:, None]), qk, float("-inf"))
                # Each row sees entry `first` or an earlier one by the time this loop ends
                # its first tile (entry 0 if open_end is 0), so m_new is finite from here on.
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                alpha = tl.exp2(m_i - m_new)
                pr = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(pr, 1)
                v = tl.load(v_head + slots[:, None] * stride_vs + offs_d[None, :], mask=n_mask[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(pr.to(WIDE), v.to(WIDE))
                m_i = m_new
            o = acc / l_i[:, None]
            tl.store(
                Out + (q_start + p)[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
                o.to(Out.dtype.element_ty),
                mask=r_mask[:, None],
            )


def paged_prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    table: torch.Tensor,
    ctx_len: torch.Tensor,
    q_len: torch.Tensor,
    q_start: torch.Tensor,
    max_q_len: int,
    out: torch.Tensor,
    scale: float | None = None,
    tile: PrefillTile = DEFAULT_TILE,
) -> torch.Tensor:
    """Writes the attention output of every listed sequence's new rows into `out`
    [T, Hq, D] (rows of other sequences untouched). q [T, Hq, D]; kv_layer [2, S, Hkv, D];
    table int32 [n_seqs, W]; ctx_len, q_len, q_start int32 [n_seqs], on q's device.
    `max_q_len` >= every q_len (it sizes the grid)."""
    if triton is None:
        raise RuntimeError("paged_prefill_attention needs triton (pip install triton)")
    t, hq, d = q.shape
    hkv = kv_layer.shape[2]
    n = table.shape[0]
    problems = []
    if q.dtype not in HALF_DTYPES or kv_layer.dtype not in (q.dtype, FP8_KV) or out.dtype != q.dtype:
        problems.append(f"dtypes q={q.dtype} kv_layer={kv_layer.dtype} out={out.dtype}: need a bf16/fp16 q, "
                        f"out of q's dtype and a kv_layer of q's dtype or {FP8_KV}")
    if kv_layer.dim() != 4 or kv_layer.shape[0] != 2 or kv_layer.shape[3] != d or hq % hkv:
        problems.append(f"kv_layer {tuple(kv_layer.shape)} does not fit q {tuple(q.shape)}")
    if d & (d - 1) or d < 16:
        problems.append(f"head_dim {d} must be a power of two >= 16")
    if table.dtype != torch.int32 or table.stride(1) != 1:
        problems.append("table must be int32 with a contiguous last dimension")
    for name, x in (("ctx_len", ctx_len), ("q_len", q_len), ("q_start", q_start)):
        if x.dtype != torch.int32 or tuple(x.shape) != (n,):
            problems.append(f"{name} must be int32 [{n}], got {x.dtype} {tuple(x.shape)}")
    for name, x in (("q", q), ("kv_layer", kv_layer), ("table", table), ("out", out)):
        if x.device != q.device or (x.device.type != "cuda" and not INTERPRET):
            problems.append(f"{name} is on {x.device}; every input must be on q's CUDA device")
    if tuple(out.shape) != tuple(q.shape) or q.stride(2) != 1 or out.stride(2) != 1:
        problems.append("out must match q's shape; q and out need a contiguous last dimension")
    if problems:
        raise ValueError("paged prefill attention: " + "; ".join(problems))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = kv_layer[0], kv_layer[1]
    group = hq // hkv
    block_m = max(tile.block_m, triton.next_power_of_2(group))  # at least one new row per tile
    grid = (triton.cdiv(max_q_len, block_m // group), hkv, n)
    _prefill_kernel[grid](
        q, k, v, out, table, ctx_len, q_len, q_start,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        table.stride(0),
        scale * 1.4426950408889634,
        GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=tile.block_n,
        WIDE=compute_dtype(q.dtype, kv_layer.dtype),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
