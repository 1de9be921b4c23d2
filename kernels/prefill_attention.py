"""Fused prefill attention over the paged KV pool: a varlen flash-attention Triton kernel.

Owns attention for sequences with SEVERAL new tokens (a whole prompt, a prompt after a
cached prefix, or one chunk of a chunked prefill), all sequences of a forward in one
launch, reading K/V straight from the pool through a slot table (the same int32 table
as decode, kernels/paged_attention.build_slot_table). Must never write the pool or
decide which tokens a sequence sees.

Semantics (the torch reference in engine/model/transformer.py): sequence s has
`ctx_len[s]` context entries, the last `q_len[s]` of which are its new tokens, packed
in q at rows `[q_start[s], q_start[s] + q_len[s])`. New token i sits at position
`ctx_len - q_len + i` and attends to context entries j <= that position (causal,
aligned bottom-right: a cached prefix is visible to every new token).

One program per (block of 64 new tokens, query head, sequence); K/V tiles stop at the
block's last position, so causal work is skipped, not masked. GQA maps query head h to
kv head h // group. Online softmax in float32, base-2 exponentials; bf16/fp16 only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from pdunit.kernels.paged_attention import HALF_DTYPES, INTERPRET, build_slot_table

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

BLOCK_M = 64
BLOCK_N = 64


def prefill_plan(
    query_lens: Sequence[int], context_slots: Sequence[torch.Tensor | np.ndarray], first_row: Sequence[int]
) -> dict[str, torch.Tensor | int]:
    """CPU tensors the kernel takes, for the sequences given: `table` int32 [S, W],
    `ctx_len`, `q_len`, `q_start` int32 [S], and `max_q_len`."""
    if not (len(query_lens) == len(context_slots) == len(first_row)):
        raise ValueError("prefill_plan: query_lens, context_slots and first_row differ in length")
    table, lengths = build_slot_table(context_slots)
    q_len = torch.tensor(list(query_lens), dtype=torch.int32)
    if bool((q_len < 1).any()) or bool((q_len > lengths).any()):
        raise ValueError(f"prefill_plan: need 1 <= q_len <= ctx_len, got {q_len.tolist()} / {lengths.tolist()}")
    return {
        "table": table,
        "ctx_len": lengths,
        "q_len": q_len,
        "q_start": torch.tensor(list(first_row), dtype=torch.int32),
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
    """Torch reference of `paged_prefill_attention` (float32 math, float64 for float64);
    rows of q that belong to no sequence come back as zeros."""
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
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        q_len = tl.load(QLen + s)
        if pid_m * BLOCK_M < q_len:
            ctx_len = tl.load(CtxLen + s)
            q_start = tl.load(QStart + s).to(tl.int64)
            first_pos = ctx_len - q_len
            hk = h // GROUP
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            r_mask = rows < q_len
            pos = first_pos + rows
            offs_d = tl.arange(0, HEAD_DIM)
            offs_n = tl.arange(0, BLOCK_N)
            q = tl.load(
                Q + (q_start + rows)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=r_mask[:, None],
                other=0.0,
            )
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            # The block's last row sees entries <= first_pos + (pid_m + 1) * BLOCK_M - 1.
            kv_end = tl.minimum(ctx_len, first_pos + (pid_m + 1) * BLOCK_M)
            row_table = Table + s.to(tl.int64) * stride_tb
            for n0 in range(0, kv_end, BLOCK_N):
                offs = n0 + offs_n
                n_mask = offs < kv_end
                slots = tl.load(row_table + offs, mask=n_mask, other=0).to(tl.int64)
                k = tl.load(
                    K + slots[:, None] * stride_ks + hk * stride_kh + offs_d[None, :],
                    mask=n_mask[:, None],
                    other=0.0,
                )
                qk = tl.dot(q, tl.trans(k)) * scale_log2e
                allowed = n_mask[None, :] & (offs[None, :] <= pos[:, None])
                qk = tl.where(allowed, qk, float("-inf"))
                # Every row sees entry 0 in the first tile, so m_new is finite from then on.
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(
                    V + slots[:, None] * stride_vs + hk * stride_vh + offs_d[None, :],
                    mask=n_mask[:, None],
                    other=0.0,
                )
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            o = acc / l_i[:, None]
            tl.store(
                Out + (q_start + rows)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
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
    if q.dtype not in HALF_DTYPES or kv_layer.dtype != q.dtype or out.dtype != q.dtype:
        problems.append(f"dtypes q={q.dtype} kv={kv_layer.dtype} out={out.dtype}: need equal bf16/fp16")
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
    grid = (triton.cdiv(max_q_len, BLOCK_M), hq, n)
    _prefill_kernel[grid](
        q, k, v, out, table, ctx_len, q_len, q_start,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        table.stride(0),
        scale * 1.4426950408889634,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        num_warps=4, num_stages=2,
    )
    return out
