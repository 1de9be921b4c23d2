"""csm's depth decoder on the backbone GPU path's kernels (`--depth-kernels fused`).

Owns the depth layers' fused q|k|v and gate|up weights, the index tensors of a pass (a
frame's K/V buffer `work` viewed per layer as a pool: row b's position p is slot b*K + p)
and the pass itself: the norms, RoPE + K/V store, paged attention and SwiGLU of
kernels/fused_ops.py and kernels/paged_attention.py (GEMMs in e4m3 under decode_gemm fp8),
about ten launches a layer where the torch form takes ~35. Must never change a weight's
values, nor its storage once built, never sync, and never drop index tensors a pass has
read: the frame graphs (engine/model/frame_graphs.py) hold the addresses of all of them.
The flag and its refusal live with the depth decoder (family_csm.py `set_depth_kernels`).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from pdunit.engine.model.config import ModelConfig
from pdunit.engine.model.transformer import (
    MLP,
    Linear,
    RMSNorm,
    _fuse_rows,
    _gemm,
    _LayerGemms,
    gpu_layer_stack,
)


class _Attention(Protocol):
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear


class _Layer(Protocol):
    attn_norm: RMSNorm
    attn: _Attention
    mlp_norm: RMSNorm
    mlp: MLP


class DepthModules(Protocol):
    """What the pass reads of family_csm's DepthDecoder (which imports this module)."""

    cfg: ModelConfig  # the depth transformer's shape
    n_codebooks: int
    fp8_gemms: list[_LayerGemms] | None  # decode_gemm fp8: the layers' e4m3 GEMMs
    layers: nn.ModuleList
    project: Linear
    norm: RMSNorm
    rope_cos: torch.Tensor  # float32 [K, head_dim / 2]
    rope_sin: torch.Tensor

    @property
    def heads(self) -> torch.Tensor: ...  # [K - 1, hidden, vocab]


class FusedDepthPass:
    """`extend(x, start, work)`: `DepthDecoder._extend`'s logits with the frame's K/V in
    `work` (`DepthDecoder.static_work`), on the fused kernels."""

    def __init__(self, dd: DepthModules) -> None:
        self.dd = dd
        self.layers = cast(list[_Layer], list(dd.layers))
        with torch.no_grad():  # the Linear weights become row views of these (no copy kept)
            self.gemms = [_LayerGemms(_fuse_rows([la.attn.q_proj, la.attn.k_proj, la.attn.v_proj]),
                                      la.attn.o_proj.weight, _fuse_rows([la.mlp.gate_proj, la.mlp.up_proj]),
                                      la.mlp.down_proj.weight) for la in self.layers]
            # The codebook heads in rows padded to a multiple of 8 ids (16-byte rows, which
            # cuBLAS needs for the card's own GEMM kernels: csm's 2051 ids get a legacy
            # one); dd.heads becomes a view of their first `vocab` columns (no copy kept).
            heads = dd.heads
            self.vocab = heads.shape[-1]
            self.wide_heads = heads.new_zeros(*heads.shape[:-1], -(-self.vocab // 8) * 8)
            self.wide_heads[..., : self.vocab] = heads
            heads.data = self.wide_heads[..., : self.vocab]
        # (start, n, device) -> (positions, write slots, table, lengths) for `_rows[key]`
        # frame rows; a pass of B rows reads their first B*n entries. A grown set replaces
        # the old one in `_index` and the old one stays in `_retired`: a graph may read it.
        self._index: dict[tuple[int, int, torch.device], tuple[torch.Tensor, ...]] = {}
        self._rows: dict[tuple[int, int, torch.device], int] = {}
        self._retired: list[tuple[torch.Tensor, ...]] = []

    def reserve(self, rows: int, device: torch.device) -> None:
        """Makes every pass's index tensors for up to `rows` frame rows now (before a
        capture: a pass then only slices them)."""
        k = self.dd.n_codebooks
        for start, n in [(0, 2)] + [(j, 1) for j in range(2, k)]:
            self._pass_index(rows, start, n, device)

    def _pass_index(self, b: int, start: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(positions int64, write slots int64, table int32 [T, K], lengths int32) of T =
        b*n query rows in (row, position) order: each query row attends to its own
        frame's positions 0..its own, so no causal mask is needed."""
        key = (start, n, device)
        have = self._rows.get(key, 0)
        if have < b:
            if key in self._index:
                self._retired.append(self._index[key])
            rows = max(b, 2 * have)
            k = self.dd.n_codebooks
            pos = torch.arange(start, start + n, dtype=torch.int64, device=device).repeat(rows)
            row = torch.arange(rows, dtype=torch.int64, device=device).repeat_interleave(n)
            table = row[:, None] * k + torch.arange(k, dtype=torch.int64, device=device)[None, :]
            self._index[key] = (pos, row * k + pos, table.to(torch.int32), (pos + 1).to(torch.int32))
            self._rows[key] = have = rows
        t = b * n
        return tuple(x[:t] for x in self._index[key])

    def extend(self, x: torch.Tensor, start: int, work: torch.Tensor, fp8: bool = False) -> torch.Tensor:
        """The frame's positions start.. (x [B, n, backbone_hidden]) -> logits [B, n', V]
        float32 of the codebooks they predict, as `DepthDecoder._extend`; their K/V is
        written into work[:, :, :B] at their positions, the earlier positions' read there.
        `fp8`: the layers' GEMMs in e4m3 (`dd.fp8_gemms`, the torch form's weights), their
        inputs quantised by the norms and SwiGLU that produce them; the projection and
        the heads stay in the model dtype."""
        from pdunit.kernels.fused_ops import rms_norm
        from pdunit.kernels.paged_attention import paged_decode_attention

        dd = self.dd
        b, n = x.shape[:2]
        positions, slots, table, lengths = self._pass_index(b, start, n, x.device)
        c, dt = dd.cfg, x.dtype
        h_kv = (work.shape[2] * work.shape[3], c.n_kv_heads, c.head_dim)
        gemms = self.gemms
        if fp8:
            assert dd.fp8_gemms is not None, "fp8 depth pass before TTSModel.set_decode_gemm('fp8')"
            gemms = dd.fp8_gemms
        xs = _gemm(x.reshape(b * n, -1), dd.project.weight, dt)
        h0 = rms_norm(xs, self.layers[0].attn_norm.weight, c.rms_eps, fp8)
        h = gpu_layer_stack(xs, h0, self.layers, gemms, dd.norm.weight, c, dt, dd.rope_cos, dd.rope_sin,
                            positions, slots, lambda i: work[i].view(2, *h_kv),
                            lambda q, pool: paged_decode_attention(q, pool, table, lengths, 1), fp8)
        first = 1 if start == 0 else 0
        out = h.view(b, n, -1)[:, first:]
        return codebook_logits(out, self.wide_heads[start + first - 1 : start + n - 1], self.vocab)


def codebook_logits(h: torch.Tensor, heads: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """h [B, p, hidden] (position i's final-norm state) and heads [p, hidden, V'] (its
    codebook's head; its first `vocab` columns are the ids, all by default) -> float32
    logits [B, p, vocab]. One position (every pass of a frame step) is a plain
    [B, hidden] x [hidden, V'] GEMM, for which cuBLAS picks the card's own kernels
    (einsum's batched product of one took a legacy one); more (the teacher-forced
    logits) stay one batched product."""
    if h.shape[1] == 1:
        out = torch.mm(h[:, 0], heads[0])[:, None]
    else:
        out = torch.einsum("bph,phv->bpv", h, heads)
    return out[..., :vocab].float().contiguous()
