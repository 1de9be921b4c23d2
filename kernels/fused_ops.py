"""Fused element-wise Triton kernels of the transformer's GPU path (bf16/fp16).

Owns the small per-layer steps the torch reference spreads over many launches (a decode
step of the 4B shape would launch thousands of kernels): `rms_norm`, `add_rms_norm`,
`qk_norm_rope_store` (q/k norm where the model has it, RoPE, K and V stored at
`write_slots`, a negative slot storing nothing) and `silu_mul`; the norms and `silu_mul`
can write e4m3 rows for an fp8 prefill (`quant=True`). Each rounds to the model dtype where
engine/model/transformer.py's reference does, float32 in between, so the two differ only
by summation order. Must never allocate pool slots or read anything but its arguments.
Each kernel's contract: docs/performance.md, "Kernel notes"."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdunit.kernels.fp8_gemm import FP8_MAX, MIN_AMAX, Fp8Rows, empty_rows, row_warps
from pdunit.kernels.kv_dtype import FP8_KV
from pdunit.kernels.paged_attention import INTERPRET

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None


if triton is not None:
    from pdunit.kernels.fp8_gemm import write_row

    @triton.jit
    def _rms_norm_kernel(X, W, Y, S, stride_x, stride_y, n_cols, eps, fp8_max, min_amax,
                         BLOCK: tl.constexpr, QUANT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        y = (x * rstd * w).to(X.dtype.element_ty).to(tl.float32)  # the model-dtype output
        write_row(Y, S, row, stride_y, offs, mask, y, fp8_max, min_amax, QUANT)

    @triton.jit
    def _add_rms_norm_kernel(
        X, D, W, R, Y, S, stride_x, stride_d, stride_r, stride_y, n_cols, eps, fp8_max, min_amax,
        BLOCK: tl.constexpr, QUANT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(D + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        # The residual is rounded to the model dtype first, as `x + delta` does in torch.
        r = (x + d).to(R.dtype.element_ty)
        tl.store(R + row * stride_r + offs, r, mask=mask)
        rf = r.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(rf * rf, 0) / n_cols + eps)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        y = (rf * rstd * w).to(R.dtype.element_ty).to(tl.float32)
        write_row(Y, S, row, stride_y, offs, mask, y, fp8_max, min_amax, QUANT)

    @triton.jit
    def _round_e4m3(x):
        # float32 -> the e4m3 value `kv_dtype.to_kv` stores (clamped to +-448, then nearest,
        # ties to even), still as float32: the cast after it is exact, so the stored bits
        # depend neither on the hardware's conversion (satfinite or not) nor on Triton's
        # interpreter, whose fp8 downcast neither ties to even nor carries into the exponent.
        a = tl.minimum(tl.abs(x), 448.0)
        bits = a.to(tl.uint32, bitcast=True)
        # normal e4m3 (>= 2**-6): keep 3 of the 23 mantissa bits, rounding the other 20
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20
        # subnormal e4m3 steps by 2**-9, float32's ulp at 1.5 * 2**14: the addition rounds
        small = ((a + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
        r = tl.where(a < 0.015625, small, normal)
        y = (r | (x.to(tl.uint32, bitcast=True) >> 31 << 31)).to(tl.float32, bitcast=True)
        return tl.where(x == x, y, x)  # a NaN stays NaN, as under torch's clamp

    @triton.jit
    def _qk_norm_rope_store_kernel(
        QKV, QW, KW, Cos, Sin, Pos, Slots, Qout, Kpool, Vpool,
        stride_t, stride_qo_t, stride_qo_h,
        stride_ks, stride_kh, stride_vs, stride_vh,
        stride_cos,
        eps,
        N_HEADS: tl.constexpr, N_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEADS_BLOCK: tl.constexpr, FP8: tl.constexpr, QK_NORM: tl.constexpr,
    ):
        # One program per (row, block of HEADS_BLOCK heads) over the q heads then the k
        # heads (a k head also moves its v head): a [heads, D/2] tile per program, where
        # one tiny program per (row, head) ran at a third of HBM speed. QK_NORM off (a
        # Llama-style model): RoPE and the store only, QW and KW never read.
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
        HALF: tl.constexpr = HEAD_DIM // 2
        offs = tl.arange(0, HALF)
        live = j < N_HEADS + N_KV_HEADS
        is_q = j < N_HEADS
        pos = tl.load(Pos + t)
        cos = tl.load(Cos + pos * stride_cos + offs).to(tl.float32)[None, :]
        sin = tl.load(Sin + pos * stride_cos + offs).to(tl.float32)[None, :]
        src = QKV + t * stride_t + j[:, None] * HEAD_DIM + offs[None, :]  # q heads, then k heads
        x1 = tl.load(src, mask=live[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=live[:, None], other=0.0).to(tl.float32)
        dt = Qout.dtype.element_ty
        if QK_NORM:
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)
            w1 = tl.where(is_q[:, None], tl.load(QW + offs).to(tl.float32)[None, :],
                          tl.load(KW + offs).to(tl.float32)[None, :])
            w2 = tl.where(is_q[:, None], tl.load(QW + HALF + offs).to(tl.float32)[None, :],
                          tl.load(KW + HALF + offs).to(tl.float32)[None, :])
            n1 = (x1 * rstd[:, None] * w1).to(dt).to(tl.float32)
            n2 = (x2 * rstd[:, None] * w2).to(dt).to(tl.float32)
        else:  # the projection's model-dtype values, as the reference ropes them
            n1, n2 = x1, x2
        o1 = (n1 * cos - n2 * sin).to(dt)
        o2 = (n2 * cos + n1 * sin).to(dt)
        q_mask = (is_q & live)[:, None]
        qdst = Qout + t * stride_qo_t + tl.where(is_q, j, 0)[:, None] * stride_qo_h + offs[None, :]
        tl.store(qdst, o1, mask=q_mask)
        tl.store(qdst + HALF, o2, mask=q_mask)
        slot = tl.load(Slots + t)
        # a negative slot (a CUDA-graph padding row) writes nothing
        kv_mask = (live & (j >= N_HEADS))[:, None] & (tl.full([1, HALF], 0, tl.int64) + slot >= 0)
        hk = tl.where(is_q, 0, j - N_HEADS)[:, None]
        vsrc = QKV + t * stride_t + (N_HEADS + N_KV_HEADS + hk) * HEAD_DIM + offs[None, :]
        v1 = tl.load(vsrc, mask=kv_mask, other=0.0)
        v2 = tl.load(vsrc + HALF, mask=kv_mask, other=0.0)
        if FP8:  # the model-dtype rows above, as `kv_dtype.to_kv` stores them
            o1, o2 = _round_e4m3(o1.to(tl.float32)), _round_e4m3(o2.to(tl.float32))
            v1, v2 = _round_e4m3(v1.to(tl.float32)), _round_e4m3(v2.to(tl.float32))
        kdst = Kpool + slot * stride_ks + hk * stride_kh + offs[None, :]
        tl.store(kdst, o1.to(Kpool.dtype.element_ty), mask=kv_mask)
        tl.store(kdst + HALF, o2.to(Kpool.dtype.element_ty), mask=kv_mask)
        vdst = Vpool + slot * stride_vs + hk * stride_vh + offs[None, :]
        tl.store(vdst, v1.to(Vpool.dtype.element_ty), mask=kv_mask)
        tl.store(vdst + HALF, v2.to(Vpool.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _silu_mul_kernel(GU, Out, S, stride_gu, stride_o, n_cols, fp8_max, min_amax,
                         BLOCK: tl.constexpr, QUANT: tl.constexpr):
        # QUANT: one program per row (BLOCK covers it), as the row's scale needs it all
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_cols
        g = tl.load(GU + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_gu + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        dt = GU.dtype.element_ty
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        write_row(Out, S, row, stride_o, offs, mask, (s * u).to(dt).to(tl.float32), fp8_max, min_amax, QUANT)


def _need(cond: bool, what: Callable[[], str] | str) -> None:
    # `what` is formatted only on failure: these checks run ~20 times per layer on the
    # GPU path, where host time per launch is what bounds a small forward.
    if not cond:
        raise ValueError(what if isinstance(what, str) else what())


def _on_device(*ts: torch.Tensor) -> None:
    dev = ts[0].device
    if (dev.type != "cuda" and not INTERPRET) or any(t.device != dev for t in ts):
        bad = next((t.device for t in ts if t.device != dev), dev)
        raise ValueError(f"fused op input on {bad}: every input must be on one CUDA device")


def _row_out(x: torch.Tensor, n: int, quant: bool) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor, torch.Tensor]:
    """The output of a row kernel: (what it returns, its Y, its S; S is Y when unused)."""
    if quant:
        out = empty_rows(x.shape[0], n, x.device)
        return out, out.q, out.scale
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    return y, y, y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: bool = False) -> torch.Tensor | Fp8Rows:
    """x [T, N] -> RMSNorm(x) * weight, in x's dtype (quant: as `Fp8Rows`)."""
    _on_device(x, weight)
    _need(x.dim() == 2 and x.stride(1) == 1, lambda: f"rms_norm: x must be [T, N] row-major, got {tuple(x.shape)}")
    n = x.shape[1]
    out, y, s = _row_out(x, n, quant)
    _rms_norm_kernel[(x.shape[0],)](
        x, weight, y, s, x.stride(0), y.stride(0), n, eps, FP8_MAX, MIN_AMAX,
        BLOCK=triton.next_power_of_2(n), QUANT=quant, num_warps=8,
    )
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, quant: bool = False
) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
    """(x + delta, RMSNorm(x + delta) * weight), both [T, N] in x's dtype (quant: the
    second as `Fp8Rows`)."""
    _on_device(x, delta, weight)
    _need(
        x.shape == delta.shape and x.dim() == 2 and x.stride(1) == 1 and delta.stride(1) == 1,
        lambda: f"add_rms_norm: x {tuple(x.shape)} and delta {tuple(delta.shape)} must be equal [T, N]",
    )
    r = torch.empty_like(x)
    n = x.shape[1]
    out, y, s = _row_out(x, n, quant)
    _add_rms_norm_kernel[(x.shape[0],)](
        x, delta, weight, r, y, s, x.stride(0), delta.stride(0), r.stride(0), y.stride(0), n, eps,
        FP8_MAX, MIN_AMAX, BLOCK=triton.next_power_of_2(n), QUANT=quant, num_warps=8,
    )
    return r, out


def qk_norm_rope_store(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    write_slots: torch.Tensor,
    kv_layer: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] (the fused projection) -> roped q [T, Hq, D]; writes the
    normed, roped K and the raw V of row t into kv_layer[0/1][write_slots[t]] unless
    write_slots[t] < 0, converted by `kv_dtype.to_kv` (kv_layer: qkv's dtype or fp8 e4m3).
    cos/sin [max_positions, D/2] float32; positions, write_slots int64. Both norm weights
    None: a model without q/k norm, RoPE and the store only (K roped, not normed)."""
    qk_norm = q_norm_weight is not None
    _need(qk_norm == (k_norm_weight is not None), "qk_norm_rope_store: give both q/k norm weights or neither")
    qw = q_norm_weight if q_norm_weight is not None else qkv  # never read without q/k norm
    kw = k_norm_weight if k_norm_weight is not None else qkv
    _on_device(qkv, qw, kw, cos, sin, positions, write_slots, kv_layer)
    t = qkv.shape[0]
    _need(
        qkv.dim() == 2 and qkv.shape[1] == (n_heads + 2 * n_kv_heads) * head_dim and qkv.stride(1) == 1,
        lambda: f"qk_norm_rope_store: qkv has shape {tuple(qkv.shape)}, expected [T, {(n_heads + 2 * n_kv_heads) * head_dim}]",
    )
    _need(
        positions.dtype == torch.int64 and write_slots.dtype == torch.int64
        and tuple(positions.shape) == (t,) and tuple(write_slots.shape) == (t,),
        "qk_norm_rope_store: positions and write_slots must be int64 [T]",
    )
    _need(cos.dtype == torch.float32 and cos.stride() == sin.stride() and cos.stride(1) == 1,
          "qk_norm_rope_store: cos/sin must be float32 [max_positions, D/2] with equal strides")
    _need(kv_layer.stride(3) == 1 and kv_layer.shape[2:] == (n_kv_heads, head_dim),
          lambda: f"qk_norm_rope_store: kv_layer {tuple(kv_layer.shape)} does not fit {n_kv_heads}x{head_dim}")
    _need(kv_layer.dtype in (qkv.dtype, FP8_KV),
          lambda: f"qk_norm_rope_store: kv_layer dtype {kv_layer.dtype}: need qkv's ({qkv.dtype}) or {FP8_KV}")
    q = torch.empty((t, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k, v = kv_layer[0], kv_layer[1]
    heads_block = 8
    _qk_norm_rope_store_kernel[(t, triton.cdiv(n_heads + n_kv_heads, heads_block))](
        qkv, qw, kw, cos, sin, positions, write_slots, q, k, v,
        qkv.stride(0), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0),
        eps,
        N_HEADS=n_heads, N_KV_HEADS=n_kv_heads, HEAD_DIM=head_dim, HEADS_BLOCK=heads_block,
        FP8=kv_layer.dtype == FP8_KV, QK_NORM=qk_norm, num_warps=4,
    )
    return q


def silu_mul(gate_up: torch.Tensor, quant: bool = False) -> torch.Tensor | Fp8Rows:
    """gate_up [T, 2F] (gate columns first) -> silu(gate) * up [T, F] (quant: as `Fp8Rows`)."""
    _on_device(gate_up)
    _need(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1,
          lambda: f"silu_mul: gate_up must be [T, 2F] row-major, got {tuple(gate_up.shape)}")
    t, f2 = gate_up.shape
    f = f2 // 2
    out, y, s = _row_out(gate_up, f, quant)
    block = triton.next_power_of_2(f) if quant else 1024
    _silu_mul_kernel[(t, triton.cdiv(f, block))](
        gate_up, y, s, gate_up.stride(0), y.stride(0), f, FP8_MAX, MIN_AMAX,
        BLOCK=block, QUANT=quant, num_warps=row_warps(block) if quant else 4,
    )
    return out
