"""Fused Triton kernels of the Mimi stream decoder's GPU path (engine/audio/mimi_stream.py).

Owns `stream_conv` (a causal convolution over channels-last rows as one implicit GEMM: the
stream's context rows and the new ones read in place, the ELU before it applied on load,
bias and a residual added in the epilogue, the next context written by the same launch)
and `pcm16` (float PCM to int16 samples). The torch forms of the same arithmetic are the
references (engine/audio/mimi_conv.py's `StreamConv`, mimi_stream.py's `to_pcm16`); the
caller picks one by device. Must never read or write a stream's context other than through
its arguments, nor host-sync (CUDA graphs capture these). Triton is imported at first use.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

# Triton's interpreter runs the same kernels on CPU tensors (slow; for tests without a GPU).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 64  # output rows (stream, time) a program
ROUND = 12582912.0  # 1.5 x 2**23: x + ROUND - ROUND rounds a float32 |x| < 2**22 half to even


def available(device: torch.device) -> bool:
    """Whether the kernels run on `device`: CUDA, or any device under the interpreter."""
    return device.type == "cuda" or INTERPRET


def _pow2(n: int, low: int, high: int) -> int:
    return max(low, min(high, 1 << max(0, n - 1).bit_length()))


def stream_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, taps: int, dilation: int,
                state: torch.Tensor | None, next_state: torch.Tensor | None, elu: float | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """`x` [B, T, in] (last dim contiguous) -> y [B, T, N]: row t of stream b is the sum
    over taps i of row t + i x dilation of [context; elu(x)] times `weight` [taps x in, N]
    (row block i is tap i), plus `bias` [N] and `residual` [B, T, N]. The context is the
    last (taps - 1) x dilation rows of the stream's input, already through the ELU: read
    from `state` [B, context x in] (rows contiguous), the next one written to `next_state`
    (the same shape; never `state` itself: other programs still read it)."""
    b, t, cin = x.shape
    n = weight.shape[1]
    context = (taps - 1) * dilation
    if weight.shape[0] != taps * cin or x.stride(2) != 1 or weight.stride(1) != 1 or weight.stride(0) != n:
        raise ValueError(f"stream_conv: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit {taps} taps "
                         "(x's channels and weight's rows must be contiguous)")
    if context:
        if (state is None or next_state is None or tuple(state.shape) != (b, context * cin)
                or tuple(next_state.shape) != (b, context * cin)):
            raise ValueError(f"stream_conv: a context of {context} rows needs state and next_state "
                             f"[{b}, {context * cin}]")
        if state.stride(1) != 1 or next_state.stride(1) != 1 or state.data_ptr() == next_state.data_ptr():
            raise ValueError("stream_conv: state and next_state must be distinct tensors with contiguous rows")
    if residual is not None and (residual.shape != (b, t, n) or residual.stride(2) != 1):
        raise ValueError(f"stream_conv: residual {tuple(residual.shape)} must be [{b}, {t}, {n}], channels contiguous")
    y = torch.empty(b, t, n, dtype=x.dtype, device=x.device)
    if b * t == 0:
        return y
    past = state if context else x  # never read without a context
    nxt = next_state if context else x  # never written without a context
    res = residual if residual is not None else y
    block_n, block_k = _pow2(n, 16, 128), _pow2(cin, 16, 64)
    tiles_n = -(-n // block_n)
    rows = max(b * t, b * context)
    grid = (-(-rows // BLOCK_M), tiles_n + (1 if context else 0))  # the last column writes the next context
    assert past is not None and nxt is not None
    _conv_kernel()[grid](
        x, past, nxt, weight, bias if bias is not None else weight, res, y,
        b * t, t, cin, n, context, max(context, 1), dilation, taps, b * context, tiles_n,
        x.stride(0), x.stride(1), past.stride(0), nxt.stride(0), res.stride(0), res.stride(1),
        y.stride(0), y.stride(1), 1.0 if elu is None else float(elu),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, ELU=elu is not None, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, IEEE=x.dtype == torch.float32, num_warps=4, num_stages=3,
    )
    return y


def pcm16(pcm: torch.Tensor) -> torch.Tensor:
    """`pcm` [B, S] (any float dtype, samples contiguous or strided) -> int16 [B, S]: NaN
    is silence, out-of-range values clip, x 32767 rounded half to even (`to_pcm16`'s)."""
    rows, cols = pcm.shape
    out = torch.empty(rows, cols, dtype=torch.int16, device=pcm.device)
    if rows * cols:
        block = 1024
        _pcm16_kernel()[(rows, -(-cols // block))](
            pcm, out, cols, pcm.stride(0), pcm.stride(1), out.stride(0), ROUND,
            BLOCK=block, num_warps=4, enable_fp_fusion=False,  # x * 32767 rounded before the add, as torch does
        )
    return out


@functools.cache
def _conv_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def stream_conv_kernel(
        X, PAST, NEXT, W, BIAS, RES, Y,  # noqa: N803
        rows, t_len, cin, n_out, context, context_rows, dilation, taps, state_rows, tiles_n,
        stride_xb, stride_xt, stride_pb, stride_nb, stride_rb, stride_rt, stride_yb, stride_yt, alpha,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
        ELU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr,  # noqa: N803
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        r = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        if pid_n == tiles_n:
            # the next context: row j of stream b is row t_len + j of [context; elu(x)]
            live = r < state_rows
            b = r // context_rows
            j = r % context_rows
            src = t_len + j
            old = src < context
            span = tl.where(pid_m * BLOCK_M < state_rows, cin, 0)  # most of this column has no context row
            for k0 in range(0, span, BLOCK_K):
                k = k0 + ks
                kin = (k < cin)[None, :]
                pv = tl.load(PAST + (b * stride_pb + src * cin)[:, None] + k[None, :],
                             mask=(live & old)[:, None] & kin, other=0.0)
                xv = tl.load(X + (b * stride_xb + (src - context) * stride_xt)[:, None] + k[None, :],
                             mask=(live & ~old)[:, None] & kin, other=0.0)
                if ELU:  # in float32, rounded to x's dtype as torch's ELU rounds its output
                    xf = xv.to(tl.float32)
                    xv = tl.where(xf > 0, xf, alpha * (tl.exp(tl.minimum(xf, 0.0)) - 1.0)).to(xv.dtype)
                v = tl.where(old[:, None], pv, xv)
                tl.store(NEXT + (b * stride_nb + j * cin)[:, None] + k[None, :], v, mask=live[:, None] & kin)
        else:
            live = r < rows
            b = r // t_len
            t = r % t_len
            ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            nin = ns < n_out
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for i in range(0, taps):
                src = t + i * dilation  # row of [context; x]
                old = src < context
                for k0 in range(0, cin, BLOCK_K):
                    k = k0 + ks
                    kin = (k < cin)[None, :]
                    pv = tl.load(PAST + (b * stride_pb + src * cin)[:, None] + k[None, :],
                                 mask=(live & old)[:, None] & kin, other=0.0)
                    xv = tl.load(X + (b * stride_xb + (src - context) * stride_xt)[:, None] + k[None, :],
                                 mask=(live & ~old)[:, None] & kin, other=0.0)
                    if ELU:
                        xf = xv.to(tl.float32)
                        xv = tl.where(xf > 0, xf, alpha * (tl.exp(tl.minimum(xf, 0.0)) - 1.0)).to(xv.dtype)
                    a = tl.where(old[:, None], pv, xv)
                    w = tl.load(W + (i * cin + k)[:, None] * n_out + ns[None, :],
                                mask=(k < cin)[:, None] & nin[None, :], other=0.0)
                    if IEEE:
                        acc += tl.dot(a, w, input_precision="ieee")
                    else:
                        acc += tl.dot(a, w)
            if HAS_BIAS:
                acc += tl.load(BIAS + ns, mask=nin, other=0.0).to(tl.float32)[None, :]
            out = live[:, None] & nin[None, :]
            if HAS_RES:
                acc += tl.load(RES + (b * stride_rb + t * stride_rt)[:, None] + ns[None, :], mask=out,
                               other=0.0).to(tl.float32)
            tl.store(Y + (b * stride_yb + t * stride_yt)[:, None] + ns[None, :], acc.to(Y.dtype.element_ty),
                     mask=out)

    return stream_conv_kernel


@functools.cache
def _pcm16_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def pcm16_kernel(X, OUT, cols, stride_xb, stride_xs, stride_ob, rounder, BLOCK: tl.constexpr):  # noqa: N803
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = s < cols
        x = tl.load(X + row * stride_xb + s * stride_xs, mask=inside, other=0.0).to(tl.float32)
        x = tl.minimum(tl.maximum(tl.where(x == x, x, 0.0), -1.0), 1.0)
        y = x * 32767.0
        y = (y + rounder) - rounder
        tl.store(OUT + row * stride_ob + s, y.to(tl.int16), mask=inside)

    return pcm16_kernel
