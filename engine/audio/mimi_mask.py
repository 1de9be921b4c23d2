"""The decoder transformer's sliding window over each stream's KV ring (mimi_stream.py):
which ring entries a query sees, and the attention over them.

Position p lives at entry p % ring, so every entry's absolute position follows from the
newest one (`last`): a slot reset to nothing written sees nothing of its last stream.
`ring_attention` reads the pool by slot: on CUDA a Triton kernel in place (one program per
stream and head, a stream's heads launched together, online softmax over the ring), else
torch (gather + SDPA). Both must stay
tensor ops only, with no host sync: a CUDA graph captures them. Triton is imported only
when the kernel is first used, so `import pdunit.engine` stays light.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

BLOCK_M = 16  # query rows per program (tl.dot's smallest M): a pass writes at most this many positions
BLOCK_N = 64  # ring entries per step of the kernel's loop


def ring_positions(last: torch.Tensor, ring: int) -> torch.Tensor:
    """[B, ring] absolute position held by each ring entry of the streams whose newest
    position is `last` [B] (negative: never written)."""
    entries = torch.arange(ring, device=last.device)
    return last[:, None] - (last[:, None] - entries[None, :] + ring) % ring


def ring_mask(last: torch.Tensor, q: int, ring: int, window: int) -> torch.Tensor:
    """[B, 1, q, ring] bool, True where a query sees an entry: the `q` queries are the
    positions last - q + 1 .. last; causal, the sliding window, only written entries."""
    kv_pos = ring_positions(last, ring)[:, None, :]  # [B, 1, ring]
    q_pos = (last[:, None] - (q - 1) + torch.arange(q, device=last.device)[None, :])[:, :, None]  # [B, q, 1]
    seen = (kv_pos >= 0) & (kv_pos <= q_pos) & (kv_pos > q_pos - window)
    return seen[:, None]


def ring_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                   last: torch.Tensor, window: int, scale: float, backend: str) -> torch.Tensor:
    """Attention of `query` [B, H, q, D] (the newest q positions of each stream, already
    written to the ring) over the rings of `slots` [B] in `keys`, `values` [S, ring, Hkv, D].
    Returns [B, q, H, D]. `backend`: "triton" (CUDA, reads the pool in place) or "torch"."""
    if backend == "triton":
        return _triton_ring_attention(query, keys, values, slots, last, window, scale)
    b, h, q, _ = query.shape
    ring, kv_heads = keys.shape[1], keys.shape[2]
    k = keys.index_select(0, slots).transpose(1, 2)  # [B, Hkv, ring, D]
    v = values.index_select(0, slots).transpose(1, 2)
    mask = ring_mask(last, q, ring, window)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=h != kv_heads)
    return out.transpose(1, 2)


def _triton_ring_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                           last: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    b, h, q, d = query.shape
    if q > BLOCK_M:
        raise ValueError(f"ring attention: {q} queries in one pass, the kernel takes at most {BLOCK_M}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("ring attention: the KV pool's head dimension must be contiguous")
    out = torch.empty(b, q, h, d, device=query.device, dtype=query.dtype)
    ring, kv_heads = keys.shape[1], keys.shape[2]
    _ring_kernel()[(h, b)](  # a stream's heads side by side: their rings' rows are one span of the pool
        query, keys, values, out, slots.contiguous(), last.contiguous(),
        query.stride(0), query.stride(1), query.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        out.stride(0), out.stride(2), out.stride(1),
        q, ring, window, h // kv_heads, d, scale,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=max(16, 1 << (d - 1).bit_length()),
        IEEE=query.dtype == torch.float32,
    )
    return out


@functools.cache
def _ring_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def ring_attention_kernel(
        Q, K, V, OUT, SLOTS, LAST,  # noqa: N803
        stride_qb, stride_qh, stride_qm, stride_ks, stride_kr, stride_kh, stride_vs, stride_vr, stride_vh,
        stride_ob, stride_oh, stride_om, q_len, ring, window, group, head_dim, scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,  # noqa: N803
        IEEE: tl.constexpr,  # noqa: N803
    ):
        h = tl.program_id(0)
        b = tl.program_id(1)
        slot = tl.load(SLOTS + b)
        last = tl.load(LAST + b)
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        dim_in = dims < head_dim
        q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + dims[None, :],
                    mask=(rows[:, None] < q_len) & dim_in[None, :], other=0.0)
        q_pos = last - (q_len - 1) + rows
        kv = h // group
        k_base = K + slot * stride_ks + kv * stride_kh
        v_base = V + slot * stride_vs + kv * stride_vh
        run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start in range(0, ring, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            inside = cols < ring
            k = tl.load(k_base + cols[:, None] * stride_kr + dims[None, :],
                        mask=inside[:, None] & dim_in[None, :], other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vr + dims[None, :],
                        mask=inside[:, None] & dim_in[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            pos = last - (last - cols + ring) % ring
            sees = (inside[None, :] & (pos[None, :] >= 0) & (pos[None, :] <= q_pos[:, None])
                    & (pos[None, :] > q_pos[:, None] - window))
            s = tl.where(sees, s * scale, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(s, 1))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            p = tl.exp(s - safe[:, None])
            alpha = tl.exp(run_max - safe)
            run_sum = run_sum * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            run_max = new_max
        out = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]
        tl.store(OUT + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + dims[None, :],
                 out.to(OUT.dtype.element_ty), mask=(rows[:, None] < q_len) & dim_in[None, :])

    return ring_attention_kernel
