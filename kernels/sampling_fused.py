"""The frame sampler of a capture-safe frame step as one Triton kernel (`sample_rows`).

Owns the launch and the kernel: one program per (row, column) reads the column's logits
and its row's sampling (temperature, top-k, EOS flag, uniform in a float64 row table)
and writes the frame id: the first argmax for a greedy row; else the logits / temperature
in float64, a top-k threshold (the k-th largest value, found by bisection on its bits),
exp, cumulative sum and the inverse-CDF comparison. The torch form is the reference
(engine/model/sampling.py `sample_frames_static`, which picks one by device). Must never
host-sync or allocate beyond its output (CUDA graphs capture it), nor read another row.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

# Triton's interpreter runs the same kernel on CPU tensors (slow; for tests without a GPU).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_VOCAB = 16384  # a program holds its column's logits in registers


def available(device: torch.device) -> bool:
    """Whether the kernel runs on `device`: CUDA, or any device under the interpreter."""
    return device.type == "cuda" or INTERPRET


def sample_rows(logits: torch.Tensor, rows: torch.Tensor, eos_id: int, *, temperature_col: int, top_k_col: int,
                suppress_col: int | None, uniform_col: int, top_k_cap: int | None) -> torch.Tensor:
    """logits [n, c, V] (any float dtype, read as float32; ids contiguous) and `rows`
    float64 [n, columns] -> int32 frames [n, c]. Row i's temperature is rows[i,
    temperature_col] (<= 0: greedy), its top_k rows[i, top_k_col] (0 or >= V: no
    filter), column j's uniform rows[i, uniform_col + j]; `suppress_col` (None: none)
    flags rows whose column 0 may not draw `eos_id`. `top_k_cap`: 0 filters nothing, an
    int clamps k to it, None leaves k as it is (the torch form's `torch.topk(cap)`)."""
    n, c, vocab = logits.shape
    if logits.stride(2) != 1 or rows.dtype != torch.float64 or rows.dim() != 2 or rows.shape[0] != n:
        raise ValueError(f"sample_rows: logits {tuple(logits.shape)} need contiguous ids and rows float64 "
                         f"[{n}, columns], got {rows.dtype} {tuple(rows.shape)}")
    if not 0 < vocab <= MAX_VOCAB:
        raise ValueError(f"sample_rows: a vocabulary of {vocab} ids, the kernel holds 1..{MAX_VOCAB}")
    if uniform_col + c > rows.shape[1]:
        raise ValueError(f"sample_rows: {c} columns from uniform column {uniform_col} exceed rows' {rows.shape[1]}")
    if rows.device != logits.device or not available(logits.device):
        raise ValueError(f"sample_rows: logits on {logits.device}, rows on {rows.device}: both must be on one "
                         "CUDA device")
    out = torch.empty(n, c, dtype=torch.int32, device=logits.device)
    if n * c == 0:
        return out
    block = 1 << (vocab - 1).bit_length()
    cap = vocab if top_k_cap is None else min(top_k_cap, vocab)
    _sample_kernel[(n, c)](
        logits, rows, out, vocab, eos_id, uniform_col, cap, logits.stride(0), logits.stride(1), rows.stride(0),
        rows.stride(1), out.stride(0),
        TEMP_COL=temperature_col, TOPK_COL=top_k_col, SUPPRESS_COL=-1 if suppress_col is None else suppress_col,
        FILTER=cap > 0, BLOCK=block, num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,
    )
    return out


if triton is not None:

    @triton.jit
    def _kth_largest(s, valid, k):
        # The k-th largest of s (float64, ties counted: torch.topk's k-th value), exactly.
        # Keys ordered as the values are (the bits, negatives' magnitude bits flipped);
        # the answer is an element key in [a, b]: a bisection that snaps both ends to the
        # elements nearest the split (so ties and bf16-rounded values end it in ~13 steps,
        # not 64), or stops when exactly k keys are >= a.
        bits = s.to(tl.int64, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
        a = tl.min(tl.where(valid, key, 0x7FFFFFFFFFFFFFFF), 0)
        b = tl.max(tl.where(valid, key, -0x7FFFFFFFFFFFFFFF), 0)
        while a < b:
            mid = ((a + 1) >> 1) + (b >> 1) + ((a + 1) & b & 1)  # floor((a + 1 + b) / 2): in (a, b]
            ge = valid & (key >= mid)
            above = tl.sum(ge.to(tl.int32), 0)
            up = tl.min(tl.where(ge, key, 0x7FFFFFFFFFFFFFFF), 0)
            down = tl.max(tl.where(valid & (key < mid), key, -0x7FFFFFFFFFFFFFFF), 0)
            a = tl.where(above >= k, up, a)  # the smallest element >= mid: still >= k of them
            b = tl.where(above >= k, tl.where(above == k, up, b), down)  # else the largest below mid
        return tl.min(tl.where(valid & (key >= a), s, float("inf")), 0)

    @triton.jit(do_not_specialize=["vocab", "eos_id", "uniform_col", "cap"])
    def _sample_kernel(
        L, ROWS, OUT, vocab, eos_id, uniform_col, cap, stride_ln, stride_lc, stride_rn, stride_rc, stride_on,  # noqa: N803
        TEMP_COL: tl.constexpr, TOPK_COL: tl.constexpr, SUPPRESS_COL: tl.constexpr,  # noqa: N803
        FILTER: tl.constexpr, BLOCK: tl.constexpr,  # noqa: N803
    ):
        r = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1)
        ids = tl.arange(0, BLOCK)
        valid = ids < vocab
        row = ROWS + r * stride_rn
        x = tl.load(L + r * stride_ln + col * stride_lc + ids, mask=valid, other=float("-inf")).to(tl.float32)
        if SUPPRESS_COL >= 0:
            if (col == 0) & (tl.load(row + SUPPRESS_COL * stride_rc) > 0):
                x = tl.where(ids == eos_id, float("-inf"), x)
        frame = tl.argmax(x, 0, tie_break_left=True).to(tl.int32)
        temperature = tl.load(row + TEMP_COL * stride_rc)
        if temperature > 0:
            s = x.to(tl.float64) / temperature
            if FILTER:
                k = tl.load(row + TOPK_COL * stride_rc).to(tl.int64)
                if (k > 0) & (k < vocab):
                    s = tl.where(s < _kth_largest(s, valid, tl.minimum(k, cap).to(tl.int32)), float("-inf"), s)
            w = tl.exp(s - tl.max(s, 0))  # -inf and padding -> 0
            cdf = tl.cumsum(w, 0)
            total = tl.sum(tl.where(ids == vocab - 1, cdf, 0.0), 0)  # the last id's entry, exactly
            target = tl.load(row + (uniform_col + col) * stride_rc) * total
            idx = tl.sum((valid & (cdf <= target)).to(tl.int32), 0)
            last = tl.max(tl.where(w > 0, ids, -1), 0)  # u * total may round up to total
            frame = tl.minimum(idx, last).to(tl.int32)
        tl.store(OUT + r * stride_on + col, frame)
