"""The Mimi decoder's causal convolutions streamed as GEMMs over channels-last frames.

Owns `StreamConv`: a causal stride-1 conv or a causal transposed conv (trimmed right) run on
[batch, time, channels] rows, its left context read from and written back to the caller's
state. A transposed conv of stride s and kernel K runs as the causal conv of ceil(K / s)
taps over its input frames, s output frames a row. Weights are snapshotted at construction.
Two forms of one call: torch ops (the reference; any device) or `fused`, one Triton launch
(kernels/codec_fused.py; the caller picks it by device). No host sync (CUDA graphs capture
it); it must never run a cuDNN convolution or a layout conversion (the cost it removes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdunit.kernels import codec_fused


def _dense(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A grouped conv weight [rows, per group, k] as the dense one [rows, per x groups, k]
    (zeros between the groups; rows are a conv's outputs or a transposed conv's inputs)."""
    if groups == 1:
        return weight
    rows, per, k = weight.shape
    dense = weight.new_zeros(rows, per * groups, k)
    block = rows // groups
    for g in range(groups):
        dense[g * block : (g + 1) * block, g * per : (g + 1) * per] = weight[g * block : (g + 1) * block]
    return dense


class StreamConv:
    """A causal convolution over channels-last rows: `weight` [out, in, taps] (a conv1d's
    layout, dense), `dilation` between taps, `frames` output frames a row (a transposed
    conv's stride; the `out / frames` channels of each follow one another in the row).

    `state_values` = context rows x in channels: what a stream keeps between calls (the
    last `(taps - 1) x dilation` input rows). The GEMM is the unfolded input times the
    weights, or, where the output is narrow, the input times every tap's weights at once
    followed by a shifted sum of the taps (less traffic; `shift_add`). The fused kernel
    always takes the unfolded form's weights (`rows`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1, frames: int = 1) -> None:
        out, cin, taps = weight.shape
        if out % frames:
            raise ValueError(f"stream conv: {out} output channels do not split into {frames} frames")
        self.in_channels, self.taps, self.dilation, self.frames = cin, taps, dilation, frames
        self.out_channels = out // frames  # a frame's channels
        self.context = (taps - 1) * dilation
        self.state_values = self.context * cin
        unfold_cost = 2 * taps * cin + out  # per row: the unfolded copy written and read, the output
        shift_cost = cin + 3 * taps * out  # the taps' products written and read back, summed
        self.shift_add = taps > 1 and shift_cost < unfold_cost
        w = weight.detach()
        self.rows = w.permute(2, 1, 0).reshape(taps * cin, out).contiguous()  # [taps x in, out]: row block i is tap i
        self.row_bias = None if bias is None else bias.detach().clone()
        if self.shift_add:  # [in, taps x out]: column block i is tap i
            self.weight = w.permute(1, 2, 0).reshape(cin, taps * out).contiguous()
            self.bias = None if bias is None else torch.cat([bias.detach(), bias.new_zeros((taps - 1) * out)])
        else:
            self.weight, self.bias = self.rows, self.row_bias

    @classmethod
    def conv1d(cls, conv: nn.Conv1d) -> StreamConv:
        """An `nn.Conv1d` of stride 1 and no padding, streamed causally (its left padding is
        the context)."""
        if conv.stride[0] != 1 or conv.padding[0] != 0 or conv.padding_mode != "zeros":
            raise ValueError("codec decoder convolution with stride != 1 or padding is not a streamable Mimi one")
        return cls(_dense(conv.weight, conv.groups), conv.bias, dilation=conv.dilation[0])

    @classmethod
    def transposed(cls, conv: nn.ConvTranspose1d) -> StreamConv:
        """An `nn.ConvTranspose1d` whose right `kernel - stride` outputs are trimmed (a
        causal Mimi one), streamed: output frame t x s + r = sum over j of input frame t - j
        times kernel tap j x s + r."""
        if (conv.padding[0] or conv.dilation[0] != 1 or conv.output_padding[0]
                or conv.kernel_size[0] < conv.stride[0]):
            raise ValueError("codec transposed convolution is not a causal Mimi one")
        w = _dense(conv.weight, conv.groups)  # [in, out, K]
        cin, cout, kernel = w.shape
        s = conv.stride[0]
        m = math.ceil(kernel / s)
        w = F.pad(w, (0, m * s - kernel)).view(cin, cout, m, s)  # [in, out, j, r]
        # tap i of the causal conv reads input frame t - (m - 1 - i): kernel block j = m - 1 - i
        weight = w.flip(2).permute(3, 1, 0, 2).reshape(s * cout, cin, m)  # [(r, out), in, i]
        bias = None if conv.bias is None else conv.bias.repeat(s)
        return cls(weight, bias, frames=s)

    def __call__(self, x: torch.Tensor, state: torch.Tensor | None, next_state: torch.Tensor | None,
                 elu: float | None = None, residual: torch.Tensor | None = None, fused: bool = False) -> torch.Tensor:
        """`x` [B, T, in] -> [B, T x frames, out]. `state` [B, state_values] (a view) read as
        the context, the next one written to `next_state` (the torch form may be given
        `state` itself; the fused one needs another buffer; both None when `state_values`
        is 0); `elu`: the ELU's alpha applied to `x` first (the context holds its output);
        `residual` [B, T x frames, out]: added to the output; `fused`: the Triton kernel."""
        b, t, _ = x.shape
        if fused:
            y = codec_fused.stream_conv(
                x, self.rows, self.row_bias, self.taps, self.dilation, state, next_state, elu,
                None if residual is None else residual.view(b, t, self.frames * self.out_channels))
        else:
            y = self._torch(x, state, next_state, elu)
            if residual is not None:
                y = y.view(b, t * self.frames, self.out_channels).add_(residual)
        return y.view(b, t * self.frames, self.out_channels)

    def _torch(self, x: torch.Tensor, state: torch.Tensor | None, next_state: torch.Tensor | None,
               elu: float | None) -> torch.Tensor:
        b, t, cin = x.shape
        p = self.context
        if p == 0:
            h = x if elu is None else F.elu(x, elu)
            a = h.reshape(b * t, cin)
            return torch.mm(a, self.weight) if self.bias is None else torch.addmm(self.bias, a, self.weight)
        assert state is not None and next_state is not None
        h = x.new_empty(b, p + t, cin)  # the context rows, then the new ones: what the conv reads
        h[:, :p].copy_(state.view(b, p, cin))
        if elu is None:
            h[:, p:].copy_(x)
        else:
            torch.ops.aten.elu.out(x, elu, 1, 1, out=h[:, p:])
        next_state.view(b, p, cin).copy_(h[:, t:])
        if self.shift_add:
            rows = h.view(b * (p + t), cin)
            z = torch.mm(rows, self.weight) if self.bias is None else torch.addmm(self.bias, rows, self.weight)
            z = z.view(b, p + t, self.taps, -1)
            d = self.dilation
            y = torch.add(z[:, :t, 0], z[:, d : d + t, 1])
            for i in range(2, self.taps):
                y.add_(z[:, i * d : i * d + t, i])
            return y
        a = h.as_strided((b, t, self.taps, cin), (h.stride(0), cin, self.dilation * cin, 1)).reshape(
            b * t, self.taps * cin)
        return torch.mm(a, self.weight) if self.bias is None else torch.addmm(self.bias, a, self.weight)
