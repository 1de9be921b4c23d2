"""FP8 (e4m3) GEMMs for prefill forwards: weights scaled per output channel, activations
per row at run time, float32 accumulation, the result in the model dtype.

Prefill only: P's forward is compute-bound and an H200 runs e4m3 GEMMs at twice the bf16
peak; D's step is bound by memory and keeps bf16. `Fp8Weight.quantize` (per output
channel, so a fused q|k|v quantizes as its parts would), `quantize_rows` (Triton on CUDA,
torch elsewhere), `fp8_gemm` (`torch._scaled_mm` on CUDA; the same arithmetic in float32
elsewhere, the CPU reference) and `fp8_linear` (both steps). A scale maps a row's largest
magnitude to 448; an all-zero row takes `MIN_AMAX`'s, so nothing divides by zero. Must
never quantise the KV pool: that is kernels/kv_dtype.py. Details: docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdunit.kernels.paged_attention import INTERPRET

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_AMAX = 1e-12


if triton is not None:

    @triton.jit
    def write_row(Y, S, row, stride_y, offs, mask, y, fp8_max, min_amax, QUANT: tl.constexpr):
        """Stores one whole row `y` (float32, zero where masked): as is into Y, or with
        QUANT as e4m3 into Y and its scale into S[row] (the row's largest magnitude maps
        to fp8_max). Shared by the quantiser here and kernels/fused_ops.py's norms and
        SwiGLU, so a fused producer quantises exactly as this module does."""
        if QUANT:
            scale = tl.maximum(tl.max(tl.abs(y), 0), min_amax) / fp8_max
            q = tl.minimum(tl.maximum(y / scale, -fp8_max), fp8_max)
            tl.store(Y + row * stride_y + offs, q.to(Y.dtype.element_ty), mask=mask)
            tl.store(S + row, scale)
        else:
            tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_rows_kernel(X, Q, S, stride_x, stride_q, n_cols, fp8_max, min_amax, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        write_row(Q, S, row, stride_q, offs, mask, x, fp8_max, min_amax, QUANT=True)


class Fp8Rows(NamedTuple):
    """Activations [M, K] as e4m3 values `q` [M, K] and float32 scales `scale` [M, 1]:
    x[m, k] ~= q[m, k] * scale[m]."""

    q: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class Fp8Weight:
    """A weight [N, K] as e4m3 values `q` [N, K] and float32 scales `scale` [N]:
    w[n, k] ~= q[n, k] * scale[n]."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    @torch.no_grad()
    def quantize(cls, w: torch.Tensor) -> Fp8Weight:
        q, scale = quantize_rows_reference(w)  # a weight's rows are its output channels
        return cls(q, scale.view(-1).contiguous())

    def rows(self, start: int, stop: int) -> Fp8Weight:
        """Output channels [start, stop): a view, as a fused matrix's parts are."""
        return Fp8Weight(self.q[start:stop], self.scale[start:stop])

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


def quantize_rows_reference(x: torch.Tensor) -> Fp8Rows:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]), in torch."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return Fp8Rows((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale)


def quantize_rows(x: torch.Tensor) -> Fp8Rows:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): the Triton kernel on CUDA (and
    under Triton's interpreter), the torch reference elsewhere."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows: x must be [M, K] row-major, got {tuple(x.shape)}")
    if triton is None or not (x.is_cuda or INTERPRET):
        return quantize_rows_reference(x)
    m, k = x.shape
    out = empty_rows(m, k, x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](
            x, out.q, out.scale, x.stride(0), out.q.stride(0), k, FP8_MAX, MIN_AMAX,
            BLOCK=block, num_warps=row_warps(block),
        )
    return out


def row_warps(block: int) -> int:
    """Warps of a one-row-per-program kernel over `block` columns (16384 for the 4B
    shape's SwiGLU rows: 32 values per thread)."""
    return 16 if block > 4096 else 8


def empty_rows(m: int, k: int, device: torch.device) -> Fp8Rows:
    """Uninitialised quantised rows, for a kernel that writes them."""
    return Fp8Rows(torch.empty((m, k), dtype=FP8, device=device), torch.empty((m, 1), dtype=torch.float32, device=device))


def fp8_gemm(a: Fp8Rows, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """Quantised rows [M, K] @ w.T -> [M, N] in `out_dtype`."""
    if a.q.is_cuda:
        # mat2 must be column-major: the transpose of the row-major [N, K] weight is.
        return torch._scaled_mm(a.q, w.q.t(), scale_a=a.scale, scale_b=w.scale.view(1, -1), out_dtype=out_dtype)
    return ((a.q.float() * a.scale) @ w.dequantize().t()).to(out_dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [M, K] @ w.T -> [M, N] in x's dtype, both operands in e4m3."""
    return fp8_gemm(quantize_rows(x), w, x.dtype)


def fp8_unsupported(device: torch.device, dims: dict[str, int]) -> str | None:
    """Why FP8 GEMMs cannot run on `device` for these GEMM dimensions, or None. CUDA
    needs compute capability 8.9+ (Ada, Hopper and later) and every K and N a multiple
    of 16 (torch._scaled_mm); the CPU reference takes anything."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no FP8 GEMMs: 8.9+ needed"
    odd = {name: n for name, n in dims.items() if n % 16}
    if odd:
        return f"FP8 GEMMs need dimensions that are multiples of 16; {odd} are not"
    return None
