"""The multi-codebook decoder-only TTS transformer and its paged-attention forward.

Owns the math of one forward step over a batch of sequences whose K/V live in a paged
pool tensor `[n_layers, 2, n_slots, n_kv_heads, head_dim]`: prefill (empty or cached
prefix), chunked prefill, decode, and any mix of them in one call; and the one way the
engines turn a forward's output into frame rows (`frames`, `frames_device`) and end a
stream (`ends_stream`). Must never allocate or free pool slots (the pool and the prefix
cache do), never hold sampling rules (engine/model/sampling.py does), never read a
prompt's validity (the LB validated it), and never know which family it serves.
Architecture, paths and precisions: the comments above `TTSModel` and its methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdunit.engine.model.config import ModelConfig, torch_dtype
from pdunit.engine.model.sampling import (
    SamplingBatch,
    SamplingParams,
    is_eos,
    sample_frames,
    sample_frames_device,
    sampling_batch,
)
from pdunit.engine.settings import GemmPrecision
from pdunit.kernels.kv_dtype import FP8_KV, index_copy_kv, kv_storage_dtype, to_kv

if TYPE_CHECKING:
    from pdunit.engine.model.request_rules import RowRule
    from pdunit.kernels.fp8_gemm import Fp8Rows, Fp8Weight
    from pdunit.kernels.prefill_attention import PrefillPlan

GEMM_PRECISIONS: tuple[str, ...] = get_args(GemmPrecision)  # set_prefill_gemm, set_decode_gemm


class FrameGraphs(Protocol):
    """What `frames_device` (and bench step) reads of `TTSModel.frame_graphs`, frame_graphs.py's
    FrameGraphRunner: it imports this module, so this one names none of it, not even for types."""

    @property
    def sizes(self) -> list[int]: ...
    @property
    def stats(self) -> dict[str, int]: ...

    def run(self, hidden: torch.Tensor, sb: SamplingBatch) -> torch.Tensor | None: ...
    def bucket_for(self, n: int) -> int | None: ...
    def replay_staged(self, size: int, top_k_cap: int | None) -> None: ...


@dataclass
class ForwardBatch:
    tokens: torch.Tensor  # [T, C] int64: the NEW tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64 absolute positions
    write_slots: torch.Tensor  # [T] int64: pool slots receiving the new tokens' K/V
    query_lens: list[int]  # per sequence: number of new tokens (sum == T)
    # per sequence: int64 slots of ALL its tokens so far in position order (cached prefix
    # + the new ones, which come last)
    context_slots: list[torch.Tensor]

    @classmethod
    def from_sequences(
        cls,
        new_tokens: Sequence[np.ndarray | torch.Tensor],
        context_slots: Sequence[np.ndarray | torch.Tensor],
        device: str | torch.device = "cpu",
    ) -> ForwardBatch:
        """Build a batch from, per sequence, its new token rows `[n_i, C]` and the slots of
        all its tokens so far (the new ones last). Positions and write slots follow:
        the new tokens sit at positions `[len(ctx) - n_i, len(ctx))`."""
        if len(new_tokens) != len(context_slots):
            raise ValueError(
                f"{len(new_tokens)} token blocks but {len(context_slots)} context slot lists"
            )
        toks, pos, writes, qlens, ctxs = [], [], [], [], []
        for i, (t, c) in enumerate(zip(new_tokens, context_slots, strict=True)):
            t, c = _as_int64(t), _as_int64(c)
            n = int(t.shape[0])
            if n < 1 or n > c.numel():
                raise ValueError(
                    f"sequence {i}: {n} new tokens but {c.numel()} context slots "
                    "(need 1 <= new tokens <= context slots)"
                )
            toks.append(t)
            pos.append(torch.arange(c.numel() - n, c.numel(), dtype=torch.int64))
            writes.append(c[-n:])
            qlens.append(n)
            ctxs.append(c.to(device))
        return cls(
            tokens=torch.cat(toks).to(device),
            positions=torch.cat(pos).to(device),
            write_slots=torch.cat(writes).to(device),
            query_lens=qlens,
            context_slots=ctxs,
        )


    def to(self, device: str | torch.device) -> ForwardBatch:
        """The same batch with every tensor on `device`."""
        return ForwardBatch(
            tokens=self.tokens.to(device),
            positions=self.positions.to(device),
            write_slots=self.write_slots.to(device),
            query_lens=list(self.query_lens),
            context_slots=[c.to(device) for c in self.context_slots],
        )


def _as_int64(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(torch.int64)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least float32: bf16 squares lose too much.
        nd = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(nd)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(nd)).to(x.dtype)


class Linear(nn.Module):
    """A bias-free linear layer whose weight is allocated, not initialised: the loader
    fills every weight (random init of a 4B model by torch would waste minutes)."""

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in, dtype=dtype, device=device))
        self.fp8: Fp8Weight | None = None  # set by TTSModel.set_prefill_gemm("fp8")

    def forward(self, x: torch.Tensor, fp8: bool = False) -> torch.Tensor:
        if fp8:
            from pdunit.kernels.fp8_gemm import fp8_linear

            assert self.fp8 is not None, "fp8 forward before set_prefill_gemm('fp8')"
            return fp8_linear(x, self.fp8)
        return F.linear(x, self.weight)


@dataclass
class _AttentionPlan:
    """Index tensors shared by every layer of one forward."""

    # Sequences with one new token (decode), attended as one padded batch.
    decode_tokens: torch.Tensor | None  # [B] rows of the batch
    decode_context: torch.Tensor | None  # [B, L_max] pool slots (padding: slot 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, L_max] bool
    # Sequences with several new tokens (prefill, chunked prefill), one by one:
    # (first row, n rows, context slots [L], mask [1, 1, n, L]).
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]


def _plan(batch: ForwardBatch, device: torch.device) -> _AttentionPlan:
    starts = np.concatenate([[0], np.cumsum(batch.query_lens)[:-1]]).tolist()
    dec_rows: list[int] = []
    dec_ctx: list[torch.Tensor] = []
    prefills = []
    for start, n, ctx in zip(starts, batch.query_lens, batch.context_slots, strict=True):
        ctx = ctx.to(device=device, dtype=torch.int64)
        if n == 1:
            dec_rows.append(start)
            dec_ctx.append(ctx)
            continue
        entry = torch.arange(ctx.numel(), device=device)
        mask = entry[None, :] <= batch.positions[start : start + n, None]
        prefills.append((start, n, ctx, mask[None, None]))
    if not dec_rows:
        return _AttentionPlan(None, None, None, prefills)
    rows = torch.tensor(dec_rows, dtype=torch.int64, device=device)
    lengths = torch.tensor([c.numel() for c in dec_ctx], dtype=torch.int64, device=device)
    context = nn.utils.rnn.pad_sequence(dec_ctx, batch_first=True, padding_value=0)
    entry = torch.arange(context.shape[1], device=device)[None, :]
    mask = (entry < lengths[:, None]) & (entry <= batch.positions[rows][:, None])
    return _AttentionPlan(rows, context, mask[:, None, None, :], prefills)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, H, D]; cos/sin [T, 1, D/2] in the rope dtype."""
    xf = x.to(cos.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_tables(
    head_dim: int,
    theta: float,
    n_positions: int,
    llama3: tuple[float, float, float, int] | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n_positions, head_dim / 2], computed in float64 and returned in
    `dtype`; `llama3` = (factor, low_freq_factor, high_freq_factor, original max
    positions) scales the frequencies as Llama 3 does (none: plain RoPE)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if llama3 is not None:
        factor, low, high, original = llama3
        wavelen = 2 * torch.pi / inv
        scaled = torch.where(wavelen > original / low, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        mixed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        inv = torch.where(medium, mixed, scaled)
    ang = torch.arange(n_positions, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(device, dtype), ang.sin().to(device, dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden, q_dim, dtype, device)
        self.k_proj = Linear(cfg.hidden, kv_dim, dtype, device)
        self.v_proj = Linear(cfg.hidden, kv_dim, dtype, device)
        self.o_proj = Linear(q_dim, cfg.hidden, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        write_slots: torch.Tensor,
        plan: _AttentionPlan,
        fp8: bool = False,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x, fp8).view(t, self.n_heads, self.head_dim)
        k = self.k_proj(x, fp8).view(t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x, fp8).view(t, self.n_kv_heads, self.head_dim)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        # Write first, then read everything (new rows included) back from the pool: a
        # token's K/V takes the same path whether it was computed now or cached earlier,
        # which is what makes cached-prefix prefill equal full prefill.
        index_copy_kv(kv_layer[0], 0, write_slots, to_kv(k, kv_layer.dtype))
        index_copy_kv(kv_layer[1], 0, write_slots, to_kv(v, kv_layer.dtype))
        out = _paged_attention(q, kv_layer, plan)
        return self.o_proj(out.reshape(t, self.n_heads * self.head_dim), fp8)


def _paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, plan: _AttentionPlan) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; K/V gathered from `kv_layer` [2, S, Hkv, D]."""
    out = torch.empty_like(q)
    dt = q.dtype
    if plan.decode_tokens is not None:
        assert plan.decode_context is not None and plan.decode_mask is not None
        qd = q[plan.decode_tokens].unsqueeze(2)  # [B, Hq, 1, D]
        k = kv_layer[0][plan.decode_context].transpose(1, 2).to(dt)  # [B, Hkv, L, D]
        v = kv_layer[1][plan.decode_context].transpose(1, 2).to(dt)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan.decode_mask, enable_gqa=True)
        out[plan.decode_tokens] = o.squeeze(2)
    for start, n, ctx, mask in plan.prefills:
        qs = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        k = kv_layer[0][ctx].transpose(0, 1).unsqueeze(0).to(dt)  # [1, Hkv, L, D]
        v = kv_layer[1][ctx].transpose(0, 1).unsqueeze(0).to(dt)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
        out[start : start + n] = o.squeeze(0).transpose(0, 1)
    return out


def _prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
    """The GPU path's prompt rows: the paged prefill kernel over `plan` into a new [T, Hq, D]."""
    from pdunit.kernels.prefill_attention import paged_prefill_attention

    return paged_prefill_attention(q, kv_layer, plan["table"], plan["ctx_len"], plan["q_len"], plan["q_start"],
                                   plan["max_q_len"], torch.empty_like(q))


_HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class _FusedWeights:
    qkv: list[torch.Tensor]  # per layer [(Hq + 2 Hkv) * D, hidden]
    gate_up: list[torch.Tensor]  # per layer [2 * ffn_hidden, hidden]


@dataclass
class _LayerGemms:
    """The four GEMM weights of one layer on the GPU path, in one precision."""

    qkv: torch.Tensor | Fp8Weight
    o: torch.Tensor | Fp8Weight
    gate_up: torch.Tensor | Fp8Weight
    down: torch.Tensor | Fp8Weight


def gpu_layer_stack(
    x: torch.Tensor,
    h: torch.Tensor | Fp8Rows,
    layers: Sequence[Any],
    gemms: Sequence[_LayerGemms],
    final_norm: torch.Tensor,
    c: ModelConfig,
    dt: torch.dtype,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    positions: torch.Tensor,
    write_slots: torch.Tensor,
    kv_of: Callable[[int], torch.Tensor],
    attend: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    fp8: bool = False,
) -> torch.Tensor:
    """The GPU path's layers (the backbone's and csm's depth decoder's, one loop) over
    residual x [T, hidden] and its first norm h, then `final_norm`: the final states [T,
    hidden]. Layer i's K/V pool is kv_of(i); each residual add is fused with the norm that
    follows it; q/k norm only where a layer's attention has it."""
    from pdunit.kernels.fused_ops import add_rms_norm, qk_norm_rope_store, silu_mul

    t, eps, n = x.shape[0], c.rms_eps, len(layers)
    for i, layer in enumerate(layers):
        a, g = layer.attn, gemms[i]
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        kv = kv_of(i)
        q = qk_norm_rope_store(
            _gemm(h, g.qkv, dt), qn.weight if qn is not None else None, kn.weight if kn is not None else None, eps,
            rope_cos, rope_sin, positions, write_slots, kv, c.n_heads, c.n_kv_heads, c.head_dim,
        )
        o = attend(q, kv).view(t, c.n_heads * c.head_dim)
        x, h = add_rms_norm(x, _gemm(o, g.o, dt), layer.mlp_norm.weight, eps, fp8)
        m = _gemm(silu_mul(_gemm(h, g.gate_up, dt), fp8), g.down, dt)
        following = layers[i + 1].attn_norm.weight if i + 1 < n else final_norm
        # the final norm feeds the head (bf16), the others the next layer's GEMM
        x, h = add_rms_norm(x, m, following, eps, fp8 and i + 1 < n)
    assert isinstance(h, torch.Tensor)  # the final norm's output is never quantised
    return h


def _gemm(x: torch.Tensor | Fp8Rows, w: torch.Tensor | Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """x @ w.T: in the model dtype, or in e4m3 for an Fp8Weight (x already quantised by
    the kernel that produced it, or quantised here)."""
    if isinstance(w, torch.Tensor):
        assert isinstance(x, torch.Tensor)
        return F.linear(x, w)
    from pdunit.kernels.fp8_gemm import fp8_gemm, quantize_rows

    return fp8_gemm(quantize_rows(x) if isinstance(x, torch.Tensor) else x, w, out_dtype)


@torch.no_grad()
def _fuse_rows(linears: list[Linear]) -> torch.Tensor:
    fused = torch.cat([m.weight.data for m in linears], dim=0)
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = fused[row : row + n]
        row += n
    return fused


@torch.no_grad()
def quantise_layer(layer: Any, qkv: torch.Tensor, gate_up: torch.Tensor) -> _LayerGemms:
    """One layer's four GEMMs in e4m3 (per output channel) from its fused q|k|v and gate|up
    weights (the backbone's and csm's depth decoder's layers alike). Its separate Linears'
    `.fp8` become row views of them, for the reference path: per-row scales make them
    equal to quantising each matrix alone."""
    from pdunit.kernels.fp8_gemm import Fp8Weight

    a, m = layer.attn, layer.mlp
    q_kv, gu = Fp8Weight.quantize(qkv), Fp8Weight.quantize(gate_up)
    o, down = Fp8Weight.quantize(a.o_proj.weight), Fp8Weight.quantize(m.down_proj.weight)
    row = 0
    for proj in (a.q_proj, a.k_proj, a.v_proj):
        proj.fp8 = q_kv.rows(row, row + proj.weight.shape[0])
        row += proj.weight.shape[0]
    f = m.gate_proj.weight.shape[0]
    m.gate_proj.fp8, m.up_proj.fp8 = gu.rows(0, f), gu.rows(f, 2 * f)
    a.o_proj.fp8, m.down_proj.fp8 = o, down
    return _LayerGemms(q_kv, o, gu, down)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden, cfg.ffn_hidden, dtype, device)
        self.up_proj = Linear(cfg.hidden, cfg.ffn_hidden, dtype, device)
        self.down_proj = Linear(cfg.ffn_hidden, cfg.hidden, dtype, device)

    def forward(self, x: torch.Tensor, fp8: bool = False) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x, fp8)) * self.up_proj(x, fp8), fp8)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.rms_eps, dtype, device)
        self.attn = Attention(cfg, dtype, device)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.rms_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        write_slots: torch.Tensor,
        plan: _AttentionPlan,
        fp8: bool = False,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, kv_layer, write_slots, plan, fp8)
        return x + self.mlp(self.mlp_norm(x), fp8)


class FrameGenerator(nn.Module, ABC):
    """A family's frame generator: what turns the backbone's final-norm hidden state of a
    sequence's last row into its next frame row, and the family's end of stream."""

    @abstractmethod
    def frames_device(self, model: TTSModel, hidden: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """hidden [n, hidden] -> int32 frame rows [n, C] on hidden's device (C: the row
        width, so a frame is the next step's input row), sampled per `sb`."""

    @abstractmethod
    def ends_stream(self, frame: np.ndarray) -> bool:
        """True iff this frame row ends its stream (the family's EOS frame)."""

    @property
    @abstractmethod
    def codec_books(self) -> tuple[int, int]:
        """(codebooks, ids per codebook) of the codec that turns these frames into audio."""

    @abstractmethod
    def codec_codes(self, frames: np.ndarray) -> np.ndarray:
        """Frame rows [n, C] -> the codec's codes, int64 [codebooks, n]."""

    @property
    def frame_rate_hz(self) -> float | None:
        """Frames per second of audio, when the family's config names it (None: it does not)."""
        return None

    # True where codebooks 1.. come from a depth decoder that takes a request's
    # `depth_decoder_temperature` / `depth_decoder_top_k` (engine/model/sampling.py).
    depth_sampling = False

    # The capture-safe form (engine/model/frame_graphs.py records it per batch bucket,
    # after the backbone's decode graph); a generator without one (`capture_safe`
    # False) runs eagerly.
    capture_safe = False

    def quantise_gemms(self, what: str) -> None:
        """Its own GEMMs' e4m3 weights, once, for `TTSModel.set_decode_gemm("fp8")` (csm's
        depth decoder has some; none by default); ValueError naming `what` and the
        reason where the device cannot."""

    def static_work(self, size: int, device: torch.device) -> torch.Tensor:
        """Preallocated buffers for `frames_static` of up to `size` rows."""
        raise NotImplementedError(f"{type(self).__name__} has no capture-safe form")

    def frames_static(self, model: TTSModel, hidden: torch.Tensor, rows: torch.Tensor, work: torch.Tensor,
                      top_k_cap: int | None = None) -> torch.Tensor:
        """`frames_device`'s frames with no host sync and shapes fixed by hidden's rows:
        `rows` is `SamplingBatch.packed` on the device (engine/model/sampling.py
        `sample_frames_static`, whose `top_k_cap` bounds the rows' top_k)."""
        raise NotImplementedError(f"{type(self).__name__} has no capture-safe form")


# Architecture (ARCHITECTURE.md 4, Qwen3-like): input embedding = sum of the row's
# `n_codebooks` embeddings; per layer RMSNorm -> GQA attention with per-head q/k RMSNorm
# (Qwen3's qk-norm) and RoPE (rotate-half) -> residual, RMSNorm -> SwiGLU -> residual;
# final RMSNorm; one linear head per codebook.
#
# Config options for other backbones (engine/model/config.py; defaults are the above):
# q/k norm off (`qk_norm`), a head over the first `head_codebooks` columns only, Llama 3
# RoPE scaling. A model family (engine/model/family.py) may also give `TTSModel` its row
# embedding (`row_embedding`) and attach a `FrameGenerator`. A forward returns the head's
# logits `[n, C, V]`, or, for a model with a frame generator, the final-norm hidden states
# `[n, hidden]` that the generator reads (`frames` takes either). Both paths (and the CUDA
# graphs) serve every form: the fused kernel skips q/k norm where the model has none, the
# family's row embedding runs as device ops (no host sync: capture-safe), and the GPU
# path returns what the reference path returns. The frame generator runs after the
# forward (`frames`, `frames_device`): eagerly, or, where D's decode graphs were
# captured and it has a capture-safe form, as a second graph (`frame_graphs`).
#
# KV precision: the pool holds the model dtype, or fp8 e4m3 (`new_kv_storage(...,
# "fp8_e4m3")`); both paths store through kernels/kv_dtype.py's saturating cast and
# widen on read, so an fp8 pool gives the same frames whichever engine wrote it.
class TTSModel(nn.Module):
    """Weights are allocated uninitialised; `loader.load_model` fills them.

    `row_embedding` (a family's): a module called as `row_embedding(embed, tokens,
    offsets)` -> [T, hidden] in place of the sum of the row's embeddings.
    `frame_generator` (a family's, attached after construction): what turns a hidden
    state into a frame (None: the head gives every column). `frame_graphs`: its graphs
    (engine/model/frame_graphs.py; D's decode graphs attach them), replayed by
    `frames`/`frames_device` for a batch they cover."""

    codebook_offsets: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    frame_generator: FrameGenerator | None
    frame_graphs: FrameGraphs | None
    row_rule: RowRule | None  # the family's (engine/model/request_rules.py); None: no rule

    def __init__(
        self,
        config: ModelConfig,
        device: str | torch.device = "cpu",
        dtype: str | None = None,
        row_embedding: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.row_embedding = row_embedding
        self.frame_generator = None
        self.frame_graphs = None
        self.row_rule = None
        self.dtype = torch_dtype(dtype or config.dtype)
        dev = torch.device(device)
        c = config
        # All codebook tables in one matrix, column j's ids offset by sum(vocab[:j]): one
        # gather embeds a whole row.
        self.embed = nn.Embedding(
            sum(c.vocab_sizes),
            c.hidden,
            device=dev,
            dtype=self.dtype,
            _weight=torch.empty(sum(c.vocab_sizes), c.hidden, device=dev, dtype=self.dtype),
        )
        self.layers = nn.ModuleList(DecoderLayer(c, self.dtype, dev) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.hidden, c.rms_eps, self.dtype, dev)
        # All heads in one matrix [sum(vocab), hidden]: one matmul for every codebook.
        self.head = Linear(c.hidden, sum(c.head_vocab_sizes), self.dtype, dev)
        offsets = np.concatenate([[0], np.cumsum(c.vocab_sizes)[:-1]])
        self.register_buffer(
            "codebook_offsets",
            torch.tensor(offsets, dtype=torch.int64, device=dev),
            persistent=False,
        )
        # RoPE tables computed in float64 and kept in the rope dtype (float64 for float64
        # models, float32 otherwise, as Qwen3 does).
        rope_dt = torch.float64 if self.dtype == torch.float64 else torch.float32
        cos, sin = rope_tables(c.head_dim, c.rope_theta, c.max_positions, c.rope_llama3, rope_dt, dev)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._uniform_vocab = len(set(c.head_vocab_sizes)) == 1
        # GPU path state: "triton" takes the kernels for a CUDA bf16/fp16 model,
        # "reference" forces the torch reference there (baselines, tests).
        self.attention_backend = "triton"
        self.prefill_gemm = "bf16"
        self.fp8_min_rows = 0
        self.decode_gemm = "bf16"
        self._fused: _FusedWeights | None = None
        self._gemms: dict[bool, list[_LayerGemms]] = {}
        self._sm_count = 0

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def new_kv_storage(
        self, n_slots: int, device: str | torch.device = "cpu", kv_cache_dtype: str = "auto"
    ) -> torch.Tensor:
        """A zeroed pool [n_layers, 2, n_slots, n_kv_heads, head_dim] in the model's dtype,
        or fp8 (`kv_cache_dtype`, kernels/kv_dtype.py)."""
        c = self.config
        return torch.zeros(
            (c.n_layers, 2, n_slots, c.n_kv_heads, c.head_dim),
            dtype=kv_storage_dtype(kv_cache_dtype, self.dtype), device=device,
        )

    # Two paths behind the same `forward`:
    # - the torch reference (CPU, and any float32/float64 model): K/V rows are gathered from
    #   the pool by `context_slots`. Context entry j of a sequence is its token at position j,
    #   so a new token at position p attends to entries j <= p. Every CPU test and the
    #   PD-vs-monolith frame identity rely on this path; it must stay bit-for-bit as it is.
    # - the GPU path (a CUDA model in bf16/fp16, `gpu_path` says whether it is taken): the
    #   same math through Triton kernels (kernels/paged_attention.py for decode rows,
    #   kernels/prefill_attention.py for multi-token rows, kernels/fused_ops.py for norms,
    #   RoPE + KV store and SwiGLU) and fused q|k|v and gate|up projections, about ten
    #   launches per layer. `decode_step` is its capture-safe decode-only form, which
    #   engine/model/cuda_graphs.py records per batch size; `prefill_step` its capture-safe
    #   prefill-only form (every prefill-only batch runs it), which
    #   engine/model/prefill_graphs.py records per row bucket; `mixed_step` its capture-safe
    #   form of decode rows plus prompt chunks, which engine/model/mixed_graphs.py records
    #   per (decode rows, prompt rows) bucket pair.
    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv: torch.Tensor) -> torch.Tensor:
        """Writes the new tokens' K/V into kv[:, 0/1, write_slots] and returns the output of
        each sequence's LAST new token, one row per sequence, which `frames` turns into
        frame rows: the logits [n_seqs, C, V_max] float32 (columns with a smaller vocab
        padded with -inf), or with a frame generator the final-norm hidden states
        [n_seqs, hidden] in the model dtype."""
        self._check(batch, kv)
        if self.gpu_path:
            return self._forward_gpu(batch, kv)
        if batch.tokens.device != self.device:  # a GPU model on the reference path
            batch = batch.to(self.device)
        t = batch.tokens.shape[0]
        x = self._reference_layers(batch, kv)
        last = torch.tensor(np.cumsum(batch.query_lens) - 1, dtype=torch.int64, device=x.device)
        assert int(last[-1]) == t - 1
        return self._output(self.norm(x[last]))

    def frames(self, out: torch.Tensor, params: list[SamplingParams], frame_index: list[int]) -> np.ndarray:
        """A forward's output rows -> int32 frame rows [n, C] on the host: row i sampled
        with params[i] as frame number frame_index[i] of its stream (engine/model/
        sampling.py's rules; the frame generator's codebooks each draw their own column's
        uniform). P, D and the monolith call this and nothing else to make frames."""
        if self.frame_generator is None:
            return sample_frames(out, params, frame_index, self.config.eos_id)
        sb = sampling_batch(params, frame_index, self.config.n_codebooks, out.device)
        return self.frames_device(out, sb).cpu().numpy()

    def frames_device(self, out: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """`frames` on the output's device with no host sync (D's overlap scheduler):
        int32 [n, C], the same frames; a replay of `frame_graphs` when they cover it."""
        if self.frame_generator is None:
            return sample_frames_device(out, sb, self.config.eos_id)
        if self.frame_graphs is not None:
            frames = self.frame_graphs.run(out, sb)
            if frames is not None:
                return frames
        return self.frame_generator.frames_device(self, out, sb)

    @property
    def depth_sampling(self) -> bool:
        """True iff requests may set `depth_decoder_temperature` / `_top_k` (a depth decoder)."""
        return self.frame_generator is not None and self.frame_generator.depth_sampling

    def ends_stream(self, frame: np.ndarray) -> bool:
        """True iff this frame row is the model's end of stream: column 0 is `eos_id`, or
        the frame generator's EOS frame."""
        if self.frame_generator is None:
            return is_eos(frame, self.config.eos_id)
        return self.frame_generator.ends_stream(frame)

    @property
    def codec_books(self) -> tuple[int, int]:
        """(codebooks, ids per codebook) a codec of this model's frames must have
        (`--codec` is checked against it): every column of the head, of the widest
        vocabulary, or the frame generator's codec."""
        if self.frame_generator is None:
            return self.config.n_codebooks, self.config.vocab_max
        return self.frame_generator.codec_books

    @property
    def frame_rate_hz(self) -> float | None:
        """Frames per second of audio as the model's config names it (CSM: its
        codec_config's), None when it names none: the rate floor's default without a
        loaded codec (engine/decode/admission.py `resolve_floor`)."""
        if self.frame_generator is None:
            return None
        return self.frame_generator.frame_rate_hz

    def codec_codes(self, frames: np.ndarray) -> np.ndarray:
        """Frame rows [n, C] (as `frames` makes them) -> the codec's codes int64
        [codebooks, n]: every column, or what the frame generator says. The engines'
        codec stage calls this and nothing else; it never looks at the family."""
        if self.frame_generator is None:
            return np.ascontiguousarray(np.asarray(frames, dtype=np.int64).T)
        return self.frame_generator.codec_codes(frames)

    @torch.no_grad()
    def hidden_states(self, batch: ForwardBatch, kv: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden state of every new row, [T, hidden] in the model dtype,
        on the torch reference path (what a frame generator reads); writes K/V as
        `forward` does."""
        self._check(batch, kv)
        batch = batch.to(self.device)
        return self.norm(self._reference_layers(batch, kv))

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T, C] -> [T, hidden]: the family's row embedding, or the sum of the
        row's C embeddings. Both paths and the CUDA graphs run it, so a family's must be
        device ops with shapes known on the host (no host sync, no data-dependent shape)."""
        if self.row_embedding is not None:
            return self.row_embedding(self.embed, tokens, self.codebook_offsets)
        return self.embed(tokens + self.codebook_offsets).sum(dim=1)

    def _reference_layers(self, batch: ForwardBatch, kv: torch.Tensor) -> torch.Tensor:
        """Every layer of the torch reference path for every row: [T, hidden], before
        the final norm."""
        x = self.embed_rows(batch.tokens)  # [T, hidden]
        cos = self.rope_cos[batch.positions].unsqueeze(1)
        sin = self.rope_sin[batch.positions].unsqueeze(1)
        plan = _plan(batch, x.device)
        fp8 = self._fp8_forward(batch)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv[i], batch.write_slots, plan, fp8)
        return x

    # "bf16" (the default) runs every GEMM in the model dtype; "fp8" runs the four
    # per-layer GEMMs of every forward that has a sequence of more than one new row (a
    # prefill, a chunk, a mixed monolith step) and at least `min_rows` rows in all in e4m3
    # with per-channel weight and per-row activation scales (kernels/fp8_gemm.py), on both
    # paths (the reference dequantises and multiplies in float32). With min_rows > 0 a
    # prompt's numerics depend on what it was batched with.
    @torch.no_grad()
    def set_prefill_gemm(self, mode: str, min_rows: int = 0) -> None:
        """"bf16" or "fp8" for the GEMMs of forwards with prompt rows and at least
        `min_rows` rows (the comment above). "fp8" quantises every layer's weights
        once (+1 byte per weight in memory) and raises ValueError, naming the reason,
        where the device cannot."""
        if mode not in GEMM_PRECISIONS:
            raise ValueError(f"prefill_gemm {mode!r}: expected one of {', '.join(GEMM_PRECISIONS)}")
        if min_rows < 0:
            raise ValueError(f"prefill_gemm min_rows {min_rows} must be >= 0")
        if mode == "fp8":
            self._quantise_gemms("prefill_gemm")
        self.prefill_gemm, self.fp8_min_rows = mode, min_rows

    # Decode-only forwards (`decode_step`, the decode CUDA graphs, the reference path's
    # one-row sequences) run their four GEMMs in the model dtype ("bf16", the default) or in
    # e4m3 ("fp8", the same weights and scales as the prefill's); what fp8 gains is in
    # docs/performance.md (Kernel notes). A forward with prompt rows (a monolith's mixed step
    # included) follows the prefill rule. A frame generator's own GEMMs (csm's depth
    # decoder's) follow decode_gemm wherever it runs (`FrameGenerator.quantise_gemms`).
    @torch.no_grad()
    def set_decode_gemm(self, mode: str) -> None:
        """"bf16" or "fp8" for the GEMMs of decode-only forwards (the comment above).
        Set it before decode graphs are captured: they record the GEMMs of the mode
        live at capture. "fp8" quantises the weights as set_prefill_gemm does (once,
        shared) and raises ValueError, naming the reason, where the device cannot."""
        if mode not in GEMM_PRECISIONS:
            raise ValueError(f"decode_gemm {mode!r}: expected one of {', '.join(GEMM_PRECISIONS)}")
        if mode == "fp8":
            self._quantise_gemms("decode_gemm")
            if self.frame_generator is not None:  # its own GEMMs follow decode_gemm
                self.frame_generator.quantise_gemms("decode_gemm")
        self.decode_gemm = mode

    def _quantise_gemms(self, what: str) -> None:
        """Every layer's e4m3 weights (per output channel), built once for both modes."""
        if self._gemms.get(True):
            return
        from pdunit.kernels.fp8_gemm import fp8_unsupported

        c = self.config
        q_dim = c.n_heads * c.head_dim
        dims = {"hidden": c.hidden, "n_heads * head_dim": q_dim, "n_kv_heads * head_dim":
                c.n_kv_heads * c.head_dim, "ffn_hidden": c.ffn_hidden}
        why = fp8_unsupported(self.device, dims)
        if why:
            raise ValueError(f"{what} fp8: {why}")
        w = self.fused_weights()
        layers = [quantise_layer(layer, w.qkv[i], w.gate_up[i]) for i, layer in enumerate(self._decoder_layers())]
        self._gemms[True] = layers

    def _fp8_forward(self, batch: ForwardBatch) -> bool:
        q = batch.query_lens
        if max(q) == 1:
            return self.decode_gemm == "fp8"
        return self.prefill_gemm == "fp8" and sum(q) >= self.fp8_min_rows

    def gemm_weight_bytes(self, fp8: bool) -> int:
        """Bytes of the four per-layer GEMM weights in one precision (fp8: values and
        scales; built by set_prefill_gemm / set_decode_gemm)."""
        total = 0
        for g in self._layer_gemms(fp8):
            for w in (g.qkv, g.o, g.gate_up, g.down):
                parts = (w,) if isinstance(w, torch.Tensor) else (w.q, w.scale)
                total += sum(t.numel() * t.element_size() for t in parts)
        return total

    def _layer_gemms(self, fp8: bool) -> list[_LayerGemms]:
        if fp8 not in self._gemms:  # only bf16 is built here; fp8 by _quantise_gemms
            w = self.fused_weights()
            self._gemms[False] = [
                _LayerGemms(w.qkv[i], layer.attn.o_proj.weight, w.gate_up[i], layer.mlp.down_proj.weight)
                for i, layer in enumerate(self._decoder_layers())
            ]
        return self._gemms[fp8]

    # ------------------------------------------------------------------ GPU path
    @property
    def gpu_path(self) -> bool:
        """True when `forward` runs the Triton kernels: a CUDA model in bf16 or fp16 with
        attention_backend "triton", of any family. Otherwise the torch reference runs (CPU
        always)."""
        return self.device.type == "cuda" and self.dtype in _HALF_DTYPES and self.attention_backend == "triton"

    def sm_count(self) -> int:
        if not self._sm_count:
            self._sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        return self._sm_count

    def fused_weights(self) -> _FusedWeights:
        """q|k|v and gate|up weights in one matrix each, built once: the separate
        Linear weights become row views of them (no second copy in memory), so the
        state dict, loaders and the reference path see the same values."""
        if self._fused is None:
            qkv, gate_up = [], []
            for layer in self._decoder_layers():
                a, m = layer.attn, layer.mlp
                qkv.append(_fuse_rows([a.q_proj, a.k_proj, a.v_proj]))
                gate_up.append(_fuse_rows([m.gate_proj, m.up_proj]))
            self._fused = _FusedWeights(qkv, gate_up)
        return self._fused

    def _forward_gpu(self, batch: ForwardBatch, kv: torch.Tensor) -> torch.Tensor:
        from pdunit.kernels.paged_attention import (
            build_slot_table,
            choose_splits,
            paged_decode_attention,
        )
        from pdunit.kernels.prefill_attention import prefill_plan

        dev = self.device
        tokens = batch.tokens.to(dev, non_blocking=True)
        positions = batch.positions.to(dev, non_blocking=True)
        write_slots = batch.write_slots.to(dev, non_blocking=True)
        qlens = batch.query_lens
        starts = np.concatenate([[0], np.cumsum(qlens)[:-1]]).astype(np.int64)
        dec = [i for i, n in enumerate(qlens) if n == 1]
        pre = [i for i, n in enumerate(qlens) if n > 1]
        ctx = batch.context_slots
        n_kv = self.config.n_kv_heads
        if dec:
            table, lengths = build_slot_table([ctx[i] for i in dec])
            splits = choose_splits(len(dec), n_kv, self.sm_count(), int(table.shape[1]))
            table, lengths = table.to(dev, non_blocking=True), lengths.to(dev, non_blocking=True)
        if not pre:
            return self.decode_step(tokens, positions, write_slots, table, lengths, kv, splits)
        pf = prefill_plan([qlens[i] for i in pre], [ctx[i] for i in pre], starts[pre].tolist(), dev, non_blocking=True)
        last = torch.from_numpy(np.cumsum(qlens) - 1).to(dev, non_blocking=True)
        if not dec:
            return self.prefill_step(tokens, positions, write_slots, pf, last, kv, self._fp8_forward(batch))
        dec_rows = torch.from_numpy(starts[dec]).to(dev, non_blocking=True)

        def attend(q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
            out = _prefill_attention(q, kv_layer, pf)
            o = paged_decode_attention(q[dec_rows], kv_layer, table, lengths, splits)
            out.index_copy_(0, dec_rows, o)
            return out

        h = self._gpu_layers(tokens, positions, write_slots, kv, attend, self._fp8_forward(batch))
        return self._output(h[last])

    def prefill_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        plan: PrefillPlan,
        last: torch.Tensor,
        kv: torch.Tensor,
        fp8: bool,
    ) -> torch.Tensor:
        """The GPU forward of prefill sequences (no decode rows) on device tensors only:
        no host sync, no host copy, so engine/model/prefill_graphs.py can capture it per
        row bucket. tokens [T, C], positions and write_slots [T] int64 (a negative slot
        writes no K/V: padding rows); `plan` the attention plan of
        kernels/prefill_attention.py (a sequence with q_len 0 is padding; its max_q_len
        sizes the attention grid); last [S] int64, the row whose logits each sequence
        returns; `fp8` picks the GEMM precision. Returns what `forward`
        returns for S sequences: logits [S, C, V_max] float32, or with a frame generator
        the final-norm hidden states [S, hidden]. Rows that belong to no sequence are
        computed and never read."""

        def attend(q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
            return _prefill_attention(q, kv_layer, plan)

        return self._output(self._gpu_layers(tokens, positions, write_slots, kv, attend, fp8)[last])

    def mixed_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        dec_table: torch.Tensor,
        dec_lengths: torch.Tensor,
        n_splits: int,
        plan: PrefillPlan,
        last: torch.Tensor,
        kv: torch.Tensor,
        fp8: bool,
    ) -> torch.Tensor:
        """The GPU forward of a mixed step on device tensors only (no host sync: safe to
        capture, engine/model/mixed_graphs.py records it per bucket pair). Rows [0, B),
        B = dec_table's rows, are decode rows (one per sequence, attended by the paged
        decode kernel over dec_table/dec_lengths, `n_splits` splits, as `decode_step`);
        the rows after them belong to the prompt chunks of `plan` (q_start >= B; q_len 0:
        padding), as `prefill_step`. A negative write slot stores no K/V (padding rows).
        last [B + S]: the rows whose output is returned; `fp8` the GEMMs."""
        from pdunit.kernels.paged_attention import paged_decode_attention

        b = dec_table.shape[0]

        def attend(q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
            out = _prefill_attention(q, kv_layer, plan)
            paged_decode_attention(q[:b], kv_layer, dec_table, dec_lengths, n_splits, out=out[:b])
            return out

        return self._output(self._gpu_layers(tokens, positions, write_slots, kv, attend, fp8)[last])

    def decode_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        table: torch.Tensor,
        lengths: torch.Tensor,
        kv: torch.Tensor,
        n_splits: int,
    ) -> torch.Tensor:
        """The GPU decode step on device tensors only (no host sync, no host copies: safe
        to capture in a CUDA graph): one new token per sequence, tokens [B, C] int64,
        positions and write_slots [B] int64 (a negative slot writes no K/V: padding),
        table int32 [B, W] and lengths int32 [B] (the new token included). Returns what
        `forward` returns: the logits [B, C, V_max] float32, or with a frame generator the
        final-norm hidden states [B, hidden] (its frames are made after the step)."""
        from pdunit.kernels.paged_attention import paged_decode_attention

        def attend(q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
            return paged_decode_attention(q, kv_layer, table, lengths, n_splits)

        fp8 = self.decode_gemm == "fp8"
        return self._output(self._gpu_layers(tokens, positions, write_slots, kv, attend, fp8))

    def _gpu_layers(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        kv: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        fp8: bool = False,
    ) -> torch.Tensor:
        """Every layer, then the final norm, for every row: [T, hidden]. Each residual
        add is fused with the norm that follows it; q/k norm only where the model has it.
        The row embedding (`embed_rows`, a family's included) is device ops only."""
        from pdunit.kernels.fused_ops import rms_norm

        gemms = self._layer_gemms(fp8)
        x = self.embed_rows(tokens)
        layers = self._decoder_layers()
        # fp8: every GEMM input but the attention output comes quantised from its producer
        h = rms_norm(x, layers[0].attn_norm.weight, self.config.rms_eps, fp8)
        return gpu_layer_stack(x, h, layers, gemms, self.norm.weight, self.config, self.dtype, self.rope_cos,
                               self.rope_sin, positions, write_slots, lambda i: kv[i], attend, fp8)

    def _decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's logits of final-norm states [n, hidden] (from `hidden_states`):
        [n, head columns, V_max] float32, as `forward` returns them."""
        return self._logits(h)

    def _output(self, h: torch.Tensor) -> torch.Tensor:
        """A forward's output of final-norm last-row states h [n, hidden], on either
        path: the head's logits, or h itself for the frame generator."""
        return h if self.frame_generator is not None else self._logits(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[n, hidden] last-row states -> logits [n, C, V_max] float32; columns with a
        smaller vocabulary are padded with -inf (never sampled)."""
        vocab = self.config.head_vocab_sizes
        flat = self.head(h).float()  # [n, sum(vocab)]
        n = h.shape[0]
        if self._uniform_vocab:
            return flat.view(n, len(vocab), vocab[0])
        out = flat.new_full((n, len(vocab), max(vocab)), float("-inf"))
        offset = 0
        for j, v in enumerate(vocab):
            out[:, j, :v] = flat[:, offset : offset + v]
            offset += v
        return out

    def _check(self, batch: ForwardBatch, kv: torch.Tensor) -> None:
        """Shape checks always; value checks (positions and write slots follow the
        context) only on CPU, where they cost no device sync."""
        c = self.config
        t = batch.tokens.shape[0] if batch.tokens.dim() == 2 else -1
        problems = []
        if batch.tokens.dim() != 2 or batch.tokens.shape[1] != c.n_codebooks:
            problems.append(
                f"tokens has shape {tuple(batch.tokens.shape)}, expected [T, {c.n_codebooks}]"
            )
        if tuple(batch.positions.shape) != (t,):
            problems.append(f"positions has shape {tuple(batch.positions.shape)}, expected [{t}]")
        if tuple(batch.write_slots.shape) != (t,):
            problems.append(
                f"write_slots has shape {tuple(batch.write_slots.shape)}, expected [{t}]"
            )
        if sum(batch.query_lens) != t or not batch.query_lens:
            problems.append(f"query_lens {batch.query_lens} must be non-empty and sum to T={t}")
        if len(batch.context_slots) != len(batch.query_lens):
            problems.append(
                f"{len(batch.context_slots)} context slot lists for {len(batch.query_lens)} sequences"
            )
        for i, (n, ctx) in enumerate(zip(batch.query_lens, batch.context_slots, strict=False)):
            if n < 1 or ctx.numel() < n:
                problems.append(f"sequence {i}: {n} new tokens, {ctx.numel()} context slots")
        want = (c.n_layers, 2, c.n_kv_heads, c.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
            problems.append(
                f"kv has shape {tuple(kv.shape)}, expected [{c.n_layers}, 2, n_slots, "
                f"{c.n_kv_heads}, {c.head_dim}]"
            )
        elif kv.dtype not in (self.dtype, FP8_KV):
            problems.append(f"kv dtype {kv.dtype} is neither the model dtype {self.dtype} nor {FP8_KV}")
        if problems:
            raise ValueError("invalid forward batch: " + "; ".join(problems))
        if batch.tokens.device.type != "cpu":
            return
        qlens = torch.tensor(batch.query_lens, dtype=torch.int64)
        ctx_lens = torch.tensor([x.numel() for x in batch.context_slots], dtype=torch.int64)
        first = torch.repeat_interleave(ctx_lens - qlens, qlens)
        seq_start = torch.repeat_interleave(torch.cumsum(qlens, 0) - qlens, qlens)
        expected = first + torch.arange(t) - seq_start
        if not torch.equal(batch.positions.cpu(), expected):
            raise ValueError(
                "invalid forward batch: positions must be the last query_len entries of each "
                "sequence's context (context entry j is position j)"
            )
        tails = torch.cat(
            [x[-n:] for x, n in zip(batch.context_slots, batch.query_lens, strict=True)]
        )
        if not torch.equal(batch.write_slots.cpu(), tails.cpu()):
            raise ValueError(
                "invalid forward batch: write_slots must equal the last query_len context "
                "slots of each sequence"
            )
        every = torch.cat([x.cpu() for x in batch.context_slots])
        if int(every.min()) < 0 or int(every.max()) >= kv.shape[2]:
            raise ValueError(
                f"invalid forward batch: a context slot is outside the pool [0, {kv.shape[2]})"
            )
