"""Decode attention over the paged KV pool: a split-K (flash-decoding) Triton kernel.

Owns decode attention for sequences with ONE new token each, reading K/V straight from
the pool (one layer's `[2, n_slots, Hkv, D]` view per call) through a table of int32 pool
slots in position order (a page of any size is a run of entries), plus the table builder
and a torch reference with the same signature (what the CPU runs). One program per
(sequence, kv head, split); the grid depends only on (batch, n_splits), so a captured CUDA
graph stays valid while contexts grow. bf16/fp16 queries; the pool in their dtype or fp8
e4m3, widened exactly (`compute_dtype`). Must never write the pool, allocate slots, or
decide which tokens a sequence sees. How and why: docs/performance.md, "Kernel notes".
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from pdunit.kernels.decode_settings import DECODE_DEFAULT, checked, parse
from pdunit.kernels.kv_dtype import FP8_KV

try:  # CPU-only installs (CI) have no usable Triton; the table code still works there.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Triton's interpreter runs the same kernels on CPU tensors (slow; for tests without a GPU).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SPLITS = 64
# The split kernel's launch settings, read at every launch: kernels/decode_settings.py
# says what each does and what it may be; an engine's `--decode-kernel` or `pdunit bench
# step --tune` changes them before the first launch (graphs capture what they were then).
DECODE_CONFIG: dict[str, int] = dict(DECODE_DEFAULT)


# The alternatives `--tune` times (each is checked against the reference by the GPU tests).
def _candidate(**changes: int) -> dict[str, int]:
    """A launch configuration: the default's settings with `changes` (the default as it
    was before any `--tune` applied one)."""
    return {**DECODE_DEFAULT, **checked(changes)}


DECODE_CANDIDATES: list[dict[str, int]] = [
    _candidate(kv_as_a=0),
    _candidate(kv_as_a=1),
    _candidate(head_major=1),
    _candidate(head_major=1, programs_per_sm=8),
    _candidate(num_stages=2, head_major=1, programs_per_sm=8),
    _candidate(block_n=128, num_warps=8, head_major=1),
    _candidate(block_n=32, num_stages=4, head_major=1, programs_per_sm=8),
    _candidate(num_warps=8, head_major=1, programs_per_sm=8),
    _candidate(block_n=128, kv_as_a=1),
    _candidate(kv_as_a=0, fp8_dots=0),
    _candidate(kv_as_a=1, fp8_dots=0),
    _candidate(block_n=128, kv_as_a=0, fp8_dots=0),
    _candidate(kv_words=1),
    _candidate(kv_words=1, block_g=8),
    _candidate(kv_words=1, block_g=8, lazy_softmax=1),
    _candidate(kv_words=1, block_g=8, lazy_softmax=1, num_stages=2),
    _candidate(kv_words=1, block_g=8, lazy_softmax=1, block_n=128),
    _candidate(kv_words=1, block_g=8, lazy_softmax=1, fp8_dots=0),
]


def configure_decode(text: str) -> dict[str, int]:
    """DECODE_CONFIG set to the default with `--decode-kernel`'s settings (`text`,
    KEY=VALUE,...; a ValueError names a bad one). Before the first launch: captured
    graphs keep the settings they were captured with. Returns the settings now live."""
    settings = {**DECODE_DEFAULT, **parse(text)}
    DECODE_CONFIG.clear()
    DECODE_CONFIG.update(settings)
    return dict(DECODE_CONFIG)


# ---------------------------------------------------------------- slot tables (pure torch)


# Triton compiles a kernel again for an integer argument whose divisibility by 16
# differs from every earlier call's, and a slot table's width is the kernels' row stride
# (`stride_tb`). Eager forwards (the monolith's mixed chunks, batches past the largest
# graph) would otherwise pass the longest context, any number: a kernel variant that the
# graphs (width max_context) and the warm-up never compiled, compiled mid-serving while
# every stream waits.
TABLE_ALIGN = 16


def build_slot_table(
    context_slots: Sequence[torch.Tensor | np.ndarray],
    width: int | None = None,
    out: np.ndarray | None = None,
    align: int = TABLE_ALIGN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad per-sequence slot lists into `table` int32 [B, width] (padding: slot 0, never
    read because `lengths` bounds every row) and `lengths` int32 [B], both on the CPU.
    `width` defaults to the longest context rounded up to a multiple of `align`
    (TABLE_ALIGN; 1 for a graph runner's staging, whose kernels read a fixed table); a
    context longer than `width`, an empty one, or a slot outside int32 is an error naming
    the sequence. `out`, a flat int32 array of at least B * width entries (a pinned
    staging buffer), receives the table instead of a new allocation; the returned table
    is then a view of it."""
    n = len(context_slots)
    if n == 0:
        raise ValueError("build_slot_table: no sequences")
    arrays = [
        c.detach().to("cpu", torch.int64).numpy() if isinstance(c, torch.Tensor) else np.asarray(c)
        for c in context_slots
    ]
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=n)
    longest = int(lengths.max())
    w = -(-longest // align) * align if width is None else int(width)
    for i, a in enumerate(arrays):
        if a.ndim != 1 or a.shape[0] == 0:
            raise ValueError(f"sequence {i}: context slots must be a non-empty 1-D list")
        if a.shape[0] > w:
            raise ValueError(
                f"sequence {i}: {a.shape[0]} context slots exceed the table width {w} "
                "(raise the width: the runner's max_context)"
            )
    if out is None:
        table = np.zeros((n, w), dtype=np.int32)
    else:
        if out.dtype != np.int32 or out.ndim != 1 or out.size < n * w:
            raise ValueError(f"out must be a flat int32 array of >= {n * w} entries")
        table = out[: n * w].reshape(n, w)
    flat = np.concatenate(arrays)
    if int(flat.min()) < 0 or int(flat.max()) > np.iinfo(np.int32).max:
        bad = next(i for i, a in enumerate(arrays) if a.min() < 0 or a.max() > np.iinfo(np.int32).max)
        raise ValueError(f"sequence {bad}: context slots must lie in [0, 2**31) (int32 table)")
    if int(lengths.min()) == w:  # every row full: one copy
        table[:] = flat.reshape(n, w)
    else:
        for i, a in enumerate(arrays):
            k = a.shape[0]
            table[i, :k] = a
            if out is not None:
                table[i, k:] = 0
    return torch.from_numpy(table), torch.from_numpy(lengths.astype(np.int32))


def choose_splits(batch: int, n_kv_heads: int, sm_count: int, max_context: int) -> int:
    """Splits per sequence so that batch x programs per sequence x splits fills the GPU
    `programs_per_sm` programs deep, never splitting below one tile per split."""
    programs = max(1, batch * n_kv_heads)
    want = math.ceil(DECODE_CONFIG["programs_per_sm"] * sm_count / programs)
    tiles = max(1, math.ceil(max_context / DECODE_CONFIG["block_n"]))
    return int(max(1, min(want, MAX_SPLITS, tiles)))


def compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tl.dtype:
    """The dtype a kernel's dots take their operands in (see the module docstring)."""
    return tl.float16 if kv_dtype == FP8_KV or q_dtype == torch.float16 else tl.bfloat16


def reference_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Torch reference: q [B, Hq, D], kv_layer [2, S, Hkv, D] -> [B, Hq, D] in q's dtype,
    computed in float32 (float64 for float64 inputs) over the first lengths[b] slots. An
    fp8 kv_layer is widened straight to float32: the same values as the kernel's widening
    to q's dtype, since every e4m3 value is exact in bf16 and fp16."""
    b, hq, d = q.shape
    hkv = kv_layer.shape[2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    idx = table.to(q.device, torch.int64)
    k = kv_layer[0][idx].to(ct)  # [B, W, Hkv, D]
    v = kv_layer[1][idx].to(ct)
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    valid = torch.arange(idx.shape[1], device=q.device)[None, :] < lengths.to(q.device)[:, None]
    # Entries past a row's length are never read: whatever their slots hold (even inf)
    # must not reach the result.
    k = k.masked_fill(~valid[:, :, None, None], 0.0)
    v = v.masked_fill(~valid[:, :, None, None], 0.0)
    s = torch.einsum("bhd,bwhd->bhw", q.to(ct), k) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhw,bwhd->bhd", p, v).to(q.dtype)


# ---------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _e4m3_half_bits(w, shift):
        """The e4m3 byte at bit `shift` of each int32 word, widened to fp16, as the low 16
        bits of an int32 (the portable form of one half of cvt.rn.f16x2.e4m3x2)."""
        byte = ((w >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        return byte.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF

    @triton.jit
    def _load_fp8_rows_wide(base, slots, n_mask, head_offset, stride_s, ROWS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, CVT_ASM: tl.constexpr):
        """Rows [ROWS, HEAD_DIM] of an e4m3 pool loaded as 32-bit words of four values and
        widened to fp16 in registers, two values an instruction (cvt.rn.f16x2.e4m3x2; the
        portable shifts where CVT_ASM is off: Triton's interpreter, GPUs before sm_89).
        Loaded byte-wise, a tile that feeds a dot is widened byte by byte from shared memory."""
        words = base.to(tl.pointer_type(tl.int32), bitcast=True)
        offs_w = tl.arange(0, HEAD_DIM // 4)
        w = tl.load(words + (slots[:, None] * stride_s + head_offset) // 4 + offs_w[None, :], mask=n_mask[:, None],
                    other=0)
        if CVT_ASM:
            lo, hi = tl.inline_asm_elementwise(
                asm="""{
                .reg .b16 l, h;
                mov.b32 {l, h}, $2;
                cvt.rn.f16x2.e4m3x2 $0, l;
                cvt.rn.f16x2.e4m3x2 $1, h;
                }""",
                constraints="=r,=r,r",
                args=[w],
                dtype=(tl.int32, tl.int32),
                is_pure=True,
                pack=1,
            )
        else:
            lo = _e4m3_half_bits(w, 0) | (_e4m3_half_bits(w, 8) << 16)
            hi = _e4m3_half_bits(w, 16) | (_e4m3_half_bits(w, 24) << 16)
        # lo holds values 4j, 4j+1 of word j and hi 4j+2, 4j+3, as fp16 pairs: pair p = 2j + s
        # is values 2p, 2p+1; its halves interleaved give the row in order.
        pairs = tl.join(lo, hi).reshape([ROWS, HEAD_DIM // 2])
        even = pairs.to(tl.int16).to(tl.float16, bitcast=True)
        odd = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        return tl.join(even, odd).reshape([ROWS, HEAD_DIM])

    @triton.jit
    def _load_k_tile(row_table, K, offs, end, offs_d, head_offset, stride_ks, WORDS: tl.constexpr,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CVT_ASM: tl.constexpr):
        """One tile of a sequence's K rows through its slot table: the slots (int64, for
        the V load that follows), the rows' mask, and the K tile [BLOCK_N, HEAD_DIM] (with
        WORDS, an e4m3 tile already widened to fp16: _load_fp8_rows_wide)."""
        n_mask = offs < end
        slots = tl.load(row_table + offs, mask=n_mask, other=0).to(tl.int64)
        if WORDS:
            k = _load_fp8_rows_wide(K, slots, n_mask, head_offset, stride_ks, BLOCK_N, HEAD_DIM, CVT_ASM)
        else:
            k = tl.load(K + slots[:, None] * stride_ks + head_offset + offs_d[None, :], mask=n_mask[:, None],
                        other=0.0)
        return slots, n_mask, k

    @triton.jit
    def _decode_split_kernel(
        Q, K, V, Table, Lens, Out, PartO, PartLse,
        stride_qb, stride_qh,
        stride_ks, stride_kh, stride_vs, stride_vh,
        stride_tb,
        stride_ob, stride_oh,
        scale_log2e,
        n_splits,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, N_KV: tl.constexpr, DIRECT: tl.constexpr,
        HEAD_MAJOR: tl.constexpr, WIDE: tl.constexpr, KV_AS_A: tl.constexpr, FP8_DOTS: tl.constexpr,
        K_WORDS: tl.constexpr, V_WORDS: tl.constexpr, LAZY: tl.constexpr, CVT_ASM: tl.constexpr,
    ):
        if HEAD_MAJOR:
            hkv = tl.program_id(0)
            b = tl.program_id(1)
        else:
            b = tl.program_id(0)
            hkv = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(Lens + b)
        # Equal chunks rounded up to a whole tile, computed from the live length.
        chunk = tl.cdiv(tl.cdiv(length, n_splits), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, length)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        heads = hkv * GROUP + offs_g
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0)
        if FP8_DOTS:  # Q K^T on fp8 tensor cores: each query head's row scaled into e4m3's range
            q32 = q.to(tl.float32)
            amax = tl.max(tl.abs(q32), 1)
            q_scale = tl.where(amax > 0.0, amax / 448.0, 1.0)
            q = (q32 / q_scale[:, None]).to(tl.float8e4nv)
            s_scale = q_scale * scale_log2e  # [BLOCK_G]: undoes the row scale in the scores
        else:
            q = q.to(WIDE)
            # read by the lazy softmax only: the widened dots below scale by it directly, as before fp8 dots
            s_scale = tl.zeros([BLOCK_G], dtype=tl.float32) + scale_log2e
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        row_table = Table + b.to(tl.int64) * stride_tb
        # K_WORDS, V_WORDS: the tile comes as fp16 from _load_fp8_rows_wide (K: when it is widened).
        # LAZY: the scores stay unscaled until the exponent (one fused multiply-add; the
        # scale is > 0, so the max commutes with it) and P's sums stay per element, summed
        # once after the loop (no cross-warp reduction a tile).
        if KV_AS_A:  # transposed: K and V^T are the dots' first operands (DECODE_CONFIG)
            q_t = tl.trans(q)  # [HEAD_DIM, BLOCK_G]
            acc_t = tl.zeros([HEAD_DIM, BLOCK_G], dtype=tl.float32)
            l_t = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
            for n0 in range(start, end, BLOCK_N):
                slots, n_mask, k = _load_k_tile(row_table, K, n0 + offs_n, end, offs_d, hkv * stride_kh, stride_ks,
                                                K_WORDS, BLOCK_N, HEAD_DIM, CVT_ASM)
                if LAZY:
                    s_t = tl.dot(k, q_t) if FP8_DOTS else tl.dot(k.to(WIDE), q_t)  # [BLOCK_N, BLOCK_G] unscaled
                    s_t = tl.where(n_mask[:, None], s_t, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s_t, 0) * s_scale)
                    alpha = tl.exp2(m_i - m_new)
                    p_t = tl.exp2(s_t * s_scale[None, :] - m_new[None, :])
                    l_t = l_t * alpha[None, :] + p_t
                else:
                    if FP8_DOTS:
                        s_t = tl.dot(k, q_t) * s_scale[None, :]  # [BLOCK_N, BLOCK_G] fp32
                    else:
                        s_t = tl.dot(k.to(WIDE), q_t) * scale_log2e
                    s_t = tl.where(n_mask[:, None], s_t, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s_t, 0))
                    alpha = tl.exp2(m_i - m_new)
                    p_t = tl.exp2(s_t - m_new[None, :])
                    l_i = l_i * alpha + tl.sum(p_t, 0)
                if V_WORDS:
                    v = _load_fp8_rows_wide(V, slots, n_mask, hkv * stride_vh, stride_vs, BLOCK_N, HEAD_DIM, CVT_ASM)
                    acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), p_t.to(WIDE))
                else:
                    v_t = tl.load(  # [HEAD_DIM, BLOCK_N]: V's rows as columns
                        V + slots[None, :] * stride_vs + hkv * stride_vh + offs_d[:, None],
                        mask=n_mask[None, :],
                        other=0.0,
                    )
                    acc_t = acc_t * alpha[None, :] + tl.dot(v_t.to(WIDE), p_t.to(WIDE))
                m_i = m_new
            acc = tl.trans(acc_t)
            if LAZY:
                l_i = tl.sum(l_t, 0)
        else:
            acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
            l_p = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
            for n0 in range(start, end, BLOCK_N):
                slots, n_mask, k = _load_k_tile(row_table, K, n0 + offs_n, end, offs_d, hkv * stride_kh, stride_ks,
                                                K_WORDS, BLOCK_N, HEAD_DIM, CVT_ASM)
                if LAZY:
                    qk = tl.dot(q, tl.trans(k)) if FP8_DOTS else tl.dot(q, tl.trans(k.to(WIDE)))  # unscaled
                    qk = tl.where(n_mask[None, :], qk, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(qk, 1) * s_scale)
                    alpha = tl.exp2(m_i - m_new)
                    p = tl.exp2(qk * s_scale[:, None] - m_new[:, None])
                    l_p = l_p * alpha[:, None] + p
                else:
                    if FP8_DOTS:
                        qk = tl.dot(q, tl.trans(k)) * s_scale[:, None]  # [BLOCK_G, BLOCK_N] fp32
                    else:
                        qk = tl.dot(q, tl.trans(k.to(WIDE))) * scale_log2e
                    qk = tl.where(n_mask[None, :], qk, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(qk, 1))
                    alpha = tl.exp2(m_i - m_new)
                    p = tl.exp2(qk - m_new[:, None])
                    l_i = l_i * alpha + tl.sum(p, 1)
                if V_WORDS:
                    v = _load_fp8_rows_wide(V, slots, n_mask, hkv * stride_vh, stride_vs, BLOCK_N, HEAD_DIM, CVT_ASM)
                else:
                    v = tl.load(
                        V + slots[:, None] * stride_vs + hkv * stride_vh + offs_d[None, :],
                        mask=n_mask[:, None],
                        other=0.0,
                    )
                acc = acc * alpha[:, None] + tl.dot(p.to(WIDE), v.to(WIDE))
                m_i = m_new
            if LAZY:
                l_i = tl.sum(l_p, 1)
        # An empty split (short context) leaves l_i == 0 and m_i == -inf: its lse is -inf
        # and the merge gives it zero weight.
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / safe_l[:, None]
        if DIRECT:  # one split: the normalised output is final
            tl.store(
                Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                o.to(Out.dtype.element_ty),
                mask=g_mask[:, None],
            )
        else:
            lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
            # PartO [B, Hq, N_SPLITS, D] and PartLse [B, Hq, N_SPLITS], contiguous.
            row = (b * (N_KV * GROUP) + heads) * n_splits + split
            tl.store(PartO + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_mask[:, None])
            tl.store(PartLse + row, lse, mask=g_mask)

    @triton.jit
    def _decode_merge_kernel(
        PartO, PartLse, Out,
        stride_ob, stride_oh,
        n_splits,
        N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, HEAD_DIM)
        s_mask = offs_s < n_splits
        base = (b * N_HEADS + h) * n_splits
        lse = tl.load(PartLse + base + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)  # finite: split 0 always holds at least one token
        w = tl.exp2(lse - m)
        o = tl.load(
            PartO + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None],
            other=0.0,
        )
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


@functools.cache
def _has_e4m3x2_cvt(device: torch.device) -> bool:
    """Whether `device` runs cvt.rn.f16x2.e4m3x2 (sm_89 and later; never interpreted)."""
    return device.type == "cuda" and not INTERPRET and torch.cuda.get_device_capability(device) >= (8, 9)


def _check(q: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor) -> None:
    problems = []
    if q.dim() != 3:
        problems.append(f"q has shape {tuple(q.shape)}, expected [batch, n_heads, head_dim]")
    if kv_layer.dim() != 4 or kv_layer.shape[0] != 2:
        problems.append(
            f"kv_layer has shape {tuple(kv_layer.shape)}, expected [2, n_slots, n_kv_heads, head_dim]"
        )
    if problems:
        raise ValueError("paged decode attention: " + "; ".join(problems))
    b, hq, d = q.shape
    hkv = kv_layer.shape[2]
    if kv_layer.shape[3] != d or hq % hkv:
        problems.append(
            f"q heads/dim {hq}x{d} do not fit kv heads/dim {hkv}x{kv_layer.shape[3]} "
            "(n_heads must be a multiple of n_kv_heads, head_dim equal)"
        )
    if q.dtype not in HALF_DTYPES or kv_layer.dtype not in (q.dtype, FP8_KV):
        problems.append(
            f"dtypes q={q.dtype} kv_layer={kv_layer.dtype}: the kernel takes a bf16 or fp16 q and "
            f"a kv_layer of q's dtype or {FP8_KV} (use reference_decode_attention for others)"
        )
    if d & (d - 1) or d < 16:
        problems.append(f"head_dim {d} must be a power of two >= 16")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != b:
        problems.append(f"table must be int32 [{b}, width], got {table.dtype} {tuple(table.shape)}")
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (b,):
        problems.append(f"lengths must be int32 [{b}], got {lengths.dtype} {tuple(lengths.shape)}")
    if q.stride(2) != 1 or kv_layer.stride(3) != 1 or table.stride(1) != 1:
        problems.append("q, kv_layer and table need a contiguous last dimension")
    for name, t in (("q", q), ("kv_layer", kv_layer), ("table", table), ("lengths", lengths)):
        if t.device != q.device or (t.device.type != "cuda" and not INTERPRET):
            problems.append(f"{name} is on {t.device}; every input must be on q's CUDA device")
    if problems:
        raise ValueError("paged decode attention: " + "; ".join(problems))


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    n_splits: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one new token per sequence, already written into the pool) attends
    to pool slots table[b, :lengths[b]] of kv_layer [2, S, Hkv, D]. Every length must be
    >= 1 (the new token itself). Returns [B, Hq, D] in q's dtype. Launches only: safe to
    capture in a CUDA graph (scratch comes from the caching allocator)."""
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton (pip install triton)")
    _check(q, kv_layer, table, lengths)
    b, hq, d = q.shape
    hkv = kv_layer.shape[2]
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = kv_layer[0], kv_layer[1]
    if n_splits > 1:
        part_o = torch.empty((b, hq, n_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, hq, n_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    head_major = bool(DECODE_CONFIG["head_major"])
    kv_as_a = DECODE_CONFIG["kv_as_a"]
    fp8 = kv_layer.dtype == FP8_KV
    words = fp8 and DECODE_CONFIG["kv_words"] == 1
    grid = (hkv, b, n_splits) if head_major else (b, hkv, n_splits)
    _decode_split_kernel[grid](
        q, k, v, table, lengths, out, part_o, part_lse,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        table.stride(0),
        out.stride(0), out.stride(1),
        scale * 1.4426950408889634,  # exp(x) = exp2(x * log2(e))
        n_splits,
        GROUP=group, BLOCK_G=max(DECODE_CONFIG["block_g"] if fp8 else 16, triton.next_power_of_2(group)),
        BLOCK_N=DECODE_CONFIG["block_n"], HEAD_DIM=d, N_KV=hkv, DIRECT=n_splits == 1,
        HEAD_MAJOR=head_major, WIDE=compute_dtype(q.dtype, kv_layer.dtype),
        KV_AS_A=kv_as_a == 1 or (kv_as_a == -1 and fp8),
        FP8_DOTS=DECODE_CONFIG["fp8_dots"] if fp8 else 0,
        K_WORDS=words and not DECODE_CONFIG["fp8_dots"], V_WORDS=words, LAZY=fp8 and DECODE_CONFIG["lazy_softmax"] == 1 and scale > 0,
        CVT_ASM=words and _has_e4m3x2_cvt(q.device),
        num_warps=DECODE_CONFIG["num_warps"], num_stages=DECODE_CONFIG["num_stages"],
    )
    if n_splits > 1:
        _decode_merge_kernel[(b, hq)](
            part_o, part_lse, out,
            out.stride(0), out.stride(1),
            n_splits,
            N_HEADS=hq, HEAD_DIM=d,
            BLOCK_S=max(2, triton.next_power_of_2(n_splits)),
            num_warps=4,
        )
    return out
