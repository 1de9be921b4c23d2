"""The `csm` family: Sesame CSM as `transformers` saves CsmForConditionalGeneration.

Owns CSM's config parsing, tensor-name map, row embedding (a row is K codebooks then a
text column; `audio_token_id` there makes it an audio frame, its K embeddings summed,
else a text token) and frame generator: codebook 0 from the backbone's head, 1..K-1
from the depth decoder (a small Llama over one frame), a frame being an audio-frame row.
Must never hold backbone math (engine/model/transformer.py runs it) nor load the Mimi
codec (`codec_model.*`), and must keep the depth decoder's KV inside one frame, never
paged: only the backbone's KV moves P -> D. docs/models.md describes the layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast, get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdunit.engine.model.checkpoint import WeightMap
from pdunit.engine.model.config import ModelConfig, torch_dtype
from pdunit.engine.model.depth_fused import FusedDepthPass, codebook_logits
from pdunit.engine.model.family import ModelFamily, ParsedConfig
from pdunit.engine.model.request_rules import RowRule
from pdunit.engine.model.sampling import (
    SamplingBatch,
    SamplingParams,
    sample_frames_static,
    to_device,
)
from pdunit.engine.model.transformer import (
    MLP,
    ForwardBatch,
    FrameGenerator,
    Linear,
    RMSNorm,
    TTSModel,
    _LayerGemms,
    _rope,
    quantise_layer,
    rope_tables,
)
from pdunit.engine.settings import DepthKernels

DEPTH_MODEL_TYPE = "csm_depth_decoder_model"
DEPTH_KERNELS: tuple[str, ...] = get_args(DepthKernels)  # set_depth_kernels

# Fields both configs share that the engine reads ...
_SHAPE_FIELDS = {
    "num_codebooks", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta",
    "rope_scaling", "attention_bias", "mlp_bias", "model_type", "dtype", "torch_dtype",
}
# ... and those that do not change inference (training, generation defaults, bookkeeping).
_INERT_FIELDS = {
    "architectures", "transformers_version", "initializer_range", "use_cache",
    "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    "output_hidden_states", "output_attentions", "return_dict", "_name_or_path",
}
_BACKBONE_FIELDS = _SHAPE_FIELDS | _INERT_FIELDS | {
    "text_vocab_size", "codebook_pad_token_id", "codebook_eos_token_id", "audio_token_id",
    "audio_eos_token_id", "tie_codebooks_embeddings", "depth_decoder_config",
    "codec_config",  # the Mimi codec: `--codec checkpoint` loads it (engine/audio/codec_spec.py)
}
_DEPTH_FIELDS = _SHAPE_FIELDS | _INERT_FIELDS | {"backbone_hidden_size"}
_REQUIRED = (
    "num_codebooks", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class DepthConfig:
    """The depth decoder's shape (from `depth_decoder_config`)."""

    n_codebooks: int
    vocab_size: int
    backbone_hidden: int
    backbone: ModelConfig  # its transformer shape in ModelConfig's terms (rows unused)


@dataclass(frozen=True)
class CsmExtras:
    n_audio: int  # K codebooks per frame
    audio_token_id: int
    audio_eos_token_id: int | None
    codebook_pad_token_id: int
    tied_codebook_embeddings: bool
    depth: DepthConfig
    # ids per codebook of the checkpoint's codec (codec_config's codebook_size; without a
    # codec_config the codebook vocabulary): CSM's vocabulary holds a few ids more (2051
    # vs Mimi's 2048: eos, pad) that no audio frame carries
    codec_codebook_size: int = 0
    # frames per second of audio of the checkpoint's codec (codec_config; None without
    # one): the rate floor's default is twice it (engine/decode/admission.py)
    codec_frame_rate_hz: float | None = None


class CsmRowEmbedding(nn.Module):
    """A row [audio 0..K-1, text] -> the audio frame's summed embedding or the text
    token's, by whether the text column holds `audio_token_id` (module docstring)."""

    def __init__(self, n_audio: int, audio_token_id: int) -> None:
        super().__init__()
        self.n_audio, self.audio_token_id = n_audio, audio_token_id

    def forward(self, embed: nn.Embedding, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        k = self.n_audio
        audio = embed(tokens[:, :k] + offsets[:k]).sum(dim=1)
        text = embed(tokens[:, k] + offsets[k])
        return torch.where((tokens[:, k] == self.audio_token_id)[:, None], audio, text)


@dataclass
class _StaticKV:
    """One layer's K and V of a frame's positions in preallocated buffers [B, K, n_kv,
    head_dim] (`DepthDecoder.static_work`): positions start.. are written there and
    attention reads positions 0..; the shapes depend on the codebook only."""

    k: torch.Tensor
    v: torch.Tensor
    start: int


_Cache = list[torch.Tensor] | _StaticKV


class _DepthAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden, q_dim, dtype, device)
        self.k_proj = Linear(cfg.hidden, kv_dim, dtype, device)
        self.v_proj = Linear(cfg.hidden, kv_dim, dtype, device)
        self.o_proj = Linear(q_dim, cfg.hidden, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: _Cache,
                fp8: bool = False) -> torch.Tensor:
        """x [B, n, hidden]: the frame's next n positions; `cache` holds this layer's K and
        V of the positions before them ([] at position 0) and is extended in place, or is
        a `_StaticKV` whose buffers take them at their positions (capture-safe). `fp8`:
        the projections in e4m3 (`DepthDecoder.quantise_gemms`)."""
        b, n, _ = x.shape
        q = _rope(_project(self.q_proj, x, fp8).view(b, n, self.n_heads, self.head_dim), cos, sin)
        k = _rope(_project(self.k_proj, x, fp8).view(b, n, self.n_kv_heads, self.head_dim), cos, sin)
        v = _project(self.v_proj, x, fp8).view(b, n, self.n_kv_heads, self.head_dim)
        if isinstance(cache, _StaticKV):
            end = cache.start + n
            cache.k[:, cache.start : end].copy_(k)
            cache.v[:, cache.start : end].copy_(v)
            k, v = cache.k[:, :end], cache.v[:, :end]
        else:
            if cache:
                k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
            cache[:] = [k, v]
        # causal among the new positions; every earlier position is visible (one new
        # position after the first call: no mask)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=n > 1, enable_gqa=True
        )
        return _project(self.o_proj, o.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim), fp8)


def _project(proj: Linear, x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """proj(x) over x's last dimension; `fp8`: in e4m3 on the rows [B * n, d] (a
    quantised row is one position of one stream, as the fused pass multiplies it)."""
    if not fp8:
        return proj(x)
    return proj(x.reshape(-1, x.shape[-1]), True).view(*x.shape[:-1], -1)


class _DepthLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.rms_eps, dtype, device)
        self.attn = _DepthAttention(cfg, dtype, device)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.rms_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: _Cache,
                fp8: bool = False) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, fp8)
        h = self.mlp_norm(x)
        if not fp8:
            return x + self.mlp(h)
        return x + self.mlp(h.reshape(-1, h.shape[-1]), True).view(h.shape)


class DepthDecoder(FrameGenerator):
    """CSM's frame generator: codebook 0 from the backbone's head, codebooks 1..K-1 from
    the depth decoder, batched across streams; the frame row is the K codebooks then
    `audio_token_id` (an audio-frame row: the next backbone input as it is)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    # --depth-kernels fused (engine/model/depth_fused.py set_depth_kernels): every pass of
    # frames_static and frames_device on the GPU path's kernels; None: the torch modules
    fused: FusedDepthPass | None = None
    # decode_gemm fp8 (`quantise_gemms`): each layer's four GEMMs in e4m3, which both forms
    # multiply (the Linears' `.fp8` are row views of them); None: the model dtype only
    fp8_gemms: list[_LayerGemms] | None = None
    capture_safe = True  # frames_static: engine/model/frame_graphs.py captures it
    depth_sampling = True  # codebooks 1.. may take the request's depth_decoder_* params

    def __init__(self, d: DepthConfig, audio_token_id: int, dtype: torch.dtype, device: torch.device,
                 codec_codebook_size: int = 0, frame_rate_hz: float | None = None) -> None:
        super().__init__()
        c = d.backbone
        self.cfg = c
        self._frame_rate_hz = frame_rate_hz
        self.n_codebooks, self.vocab_size = d.n_codebooks, d.vocab_size
        self.codec_codebook_size = codec_codebook_size or d.vocab_size
        self.audio_token_id, self.eos_id = audio_token_id, c.eos_id
        self.embed = nn.Embedding(
            d.n_codebooks * d.vocab_size, d.backbone_hidden, device=device, dtype=dtype,
            _weight=torch.empty(d.n_codebooks * d.vocab_size, d.backbone_hidden, device=device, dtype=dtype),
        )
        self.project = Linear(d.backbone_hidden, c.hidden, dtype, device)
        self.layers = nn.ModuleList(_DepthLayer(c, dtype, device) for _ in range(c.n_layers))
        self._kv_shape = (c.n_kv_heads, c.head_dim)
        self.norm = RMSNorm(c.hidden, c.rms_eps, dtype, device)
        # one [hidden, vocab] head per codebook 1..K-1
        self.heads = nn.Parameter(torch.empty(d.n_codebooks - 1, c.hidden, d.vocab_size, dtype=dtype, device=device))
        rope_dt = torch.float64 if dtype == torch.float64 else torch.float32
        cos, sin = rope_tables(c.head_dim, c.rope_theta, d.n_codebooks, c.rope_llama3, rope_dt, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """hidden [B, backbone_hidden] (the backbone's final-norm state of the frame's
        position), codes [B, n] = codebooks 0..n-1 (1 <= n <= K-1) -> logits [B, n, V]
        float32 for codebooks 1..n (teacher-forced: the whole frame in one pass)."""
        b, n = codes.shape
        if not 1 <= n < self.n_codebooks:
            raise ValueError(f"depth decoder: {n} codebooks given, expected 1..{self.n_codebooks - 1}")
        offsets = torch.arange(n, device=codes.device) * self.vocab_size
        x = torch.cat([hidden[:, None, :].to(self.embed.weight.dtype), self.embed(codes + offsets)], dim=1)
        return self._extend(x, 0, [[] for _ in self.layers])

    def _extend(self, x: torch.Tensor, start: int, caches: list[_Cache], fp8: bool = False) -> torch.Tensor:
        """The frame's positions start.. (x [B, n, backbone_hidden] inputs) over the K/V
        of those before (`caches`, extended) -> logits [B, n', V] float32 of the codebooks
        they predict (position p predicts codebook p; position 0 predicts none). `fp8`:
        the layers' GEMMs in e4m3 (the projection and the heads stay in the model dtype)."""
        n = x.shape[1]
        x = self.project(x)
        cos = self.rope_cos[start : start + n].unsqueeze(1)
        sin = self.rope_sin[start : start + n].unsqueeze(1)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, fp8)
        first = 1 if start == 0 else 0
        x = self.norm(x)[:, first:]
        return codebook_logits(x, self.heads[start + first - 1 : start + n - 1])

    @torch.no_grad()
    def frames_device(self, model: TTSModel, hidden: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """Codebook j sampled from its logits with column j's uniform (greedy: argmax per
        codebook, as transformers' greedy generate), codebooks 1.. with the request's
        depth_decoder_* params where it sets them; EOS suppression (min_frames) applies
        to codebook 0, the backbone's. Each codebook is one `sample_frames_static` call on
        the batch's rows (`sb.packed`, sent once), its top-k cap the batch's largest k.
        The depth decoder's K/V of the frame's positions lives in `caches` (--depth-kernels
        fused: in a work buffer as frames_static's) for this call only; its GEMMs follow
        the model's decode_gemm (`fp8_passes`)."""
        assert sb.packed is not None
        eos, cap, fp8 = self.eos_id, sb.max_top_k, self.fp8_passes(model)
        rows = to_device(sb.packed, hidden.device)
        codes = sample_frames_static(model.logits(hidden), rows, eos, 0, cap).to(torch.int64)
        caches: list[_Cache] = [[] for _ in self.layers]
        fused = self.fused  # its K/V is never read before written: empty (of 0 rows for the torch form)
        n_rows = hidden.shape[0] if fused is not None else 0
        work = torch.empty(self._work_shape(n_rows), dtype=self.embed.weight.dtype, device=hidden.device)
        x = torch.cat([hidden[:, None, :].to(self.embed.weight.dtype), self.embed(codes)], dim=1)
        for j in range(1, self.n_codebooks):
            start = 0 if j == 1 else j
            logits = self._extend(x, start, caches, fp8) if fused is None else fused.extend(x, start, work, fp8)
            nxt = sample_frames_static(logits[:, -1:], rows, eos, j, cap, depth=True)
            codes = torch.cat([codes, nxt.to(torch.int64)], dim=1)
            x = self.embed(codes[:, -1:] + j * self.vocab_size)  # position j + 1: codebook j's embedding
        text = torch.full_like(codes[:, :1], self.audio_token_id)
        return torch.cat([codes, text], dim=1).to(torch.int32)

    @torch.no_grad()
    def quantise_gemms(self, what: str) -> None:
        """Every depth layer's q|k|v, o, gate|up and down in e4m3 (per output channel,
        activations per row at run time), built once by `TTSModel.set_decode_gemm("fp8")`:
        the fused pass multiplies them and the torch modules' Linears take row views of
        them, so both forms run the same quantised weights. The projection from the
        backbone's width and the codebook heads stay in the model dtype. ValueError,
        naming `what` and the reason, where the device cannot."""
        if self.fp8_gemms is not None:
            return
        from pdunit.kernels.fp8_gemm import fp8_unsupported

        c = self.cfg
        dims = {"depth hidden": c.hidden, "depth n_heads * head_dim": c.n_heads * c.head_dim,
                "depth n_kv_heads * head_dim": c.n_kv_heads * c.head_dim, "depth ffn_hidden": c.ffn_hidden}
        why = fp8_unsupported(self.embed.weight.device, dims)
        if why:
            raise ValueError(f"{what} fp8 (the depth decoder's GEMMs): {why}")
        gemms = []
        for layer in self._depth_layers():
            a, m = layer.attn, layer.mlp
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])  # dropped once quantised
            gemms.append(quantise_layer(layer, qkv, torch.cat([m.gate_proj.weight, m.up_proj.weight])))
        self.fp8_gemms = gemms

    def fp8_passes(self, model: TTSModel) -> bool:
        """Whether the passes run their GEMMs in e4m3: the model's decode_gemm, wherever
        the depth decoder runs (D's steps, the monolith's, a first frame)."""
        if model.decode_gemm != "fp8":
            return False
        if self.fp8_gemms is None:
            raise ValueError("decode_gemm fp8 but the depth decoder has no e4m3 weights: set it with "
                             "TTSModel.set_decode_gemm, which quantises them")
        return True

    def gemm_weight_bytes(self, fp8: bool) -> int:
        """Bytes of the depth layers' four GEMM weights in one precision (fp8: e4m3
        values and scales, built by `quantise_gemms`)."""
        if not fp8:
            return sum(p.numel() * p.element_size() for la in self._depth_layers()
                       for p in (la.attn.q_proj.weight, la.attn.k_proj.weight, la.attn.v_proj.weight,
                                 la.attn.o_proj.weight, la.mlp.gate_proj.weight, la.mlp.up_proj.weight,
                                 la.mlp.down_proj.weight))
        if self.fp8_gemms is None:
            raise ValueError("no e4m3 depth weights: TTSModel.set_decode_gemm('fp8') builds them")
        total = 0
        for g in self.fp8_gemms:
            for w in (g.qkv, g.o, g.gate_up, g.down):
                parts = (w,) if isinstance(w, torch.Tensor) else (w.q, w.scale)
                total += sum(t.numel() * t.element_size() for t in parts)
        return total

    def _depth_layers(self) -> list[_DepthLayer]:
        return [cast(_DepthLayer, layer) for layer in self.layers]

    def static_work(self, size: int, device: torch.device) -> torch.Tensor:
        """The depth decoder's K/V of one frame for up to `size` rows, preallocated:
        [layers, 2, size, K, n_kv_heads, head_dim] in the weights' dtype (a frame's K
        positions: the backbone state, then codebooks 0..K-2)."""
        if self.fused is not None:  # its index tensors too, before a capture reads them
            self.fused.reserve(size, device)
        return torch.zeros(self._work_shape(size), dtype=self.embed.weight.dtype, device=device)

    def _work_shape(self, size: int) -> tuple[int, ...]:
        return (len(self.layers), 2, size, self.n_codebooks, *self._kv_shape)

    @torch.no_grad()
    def frames_static(self, model: TTSModel, hidden: torch.Tensor, rows: torch.Tensor, work: torch.Tensor,
                      top_k_cap: int | None = None) -> torch.Tensor:
        """`frames_device` in a form a CUDA graph records: the same frames for hidden [B,
        backbone_hidden] and `rows` (`SamplingBatch.packed` on the device), sampled by
        `sample_frames_static`; the depth decoder's K/V in `work` (`static_work` of >= B
        rows, its contents never read before written). No host sync, every shape fixed
        by B and the codebook: rows do not touch each other, so padding rows (any
        hidden, zero `rows`) leave the real rows' frames as they are."""
        b, eos, fp8 = hidden.shape[0], self.eos_id, self.fp8_passes(model)
        code = sample_frames_static(model.logits(hidden), rows, eos, 0, top_k_cap)
        codes = [code]
        x = torch.cat([hidden[:, None, :].to(self.embed.weight.dtype), self.embed(code.to(torch.int64))], dim=1)
        for j in range(1, self.n_codebooks):
            start = 0 if j == 1 else j
            if self.fused is not None:
                logits = self.fused.extend(x, start, work, fp8)
            else:
                caches: list[_Cache] = [_StaticKV(work[i, 0, :b], work[i, 1, :b], start)
                                        for i in range(len(self.layers))]
                logits = self._extend(x, start, caches, fp8)
            code = sample_frames_static(logits[:, -1:], rows, eos, j, top_k_cap, depth=True)
            codes.append(code)
            x = self.embed(code.to(torch.int64) + j * self.vocab_size)  # position j + 1: codebook j's embedding
        codes.append(torch.full_like(code, self.audio_token_id))
        return torch.cat(codes, dim=1)

    def ends_stream(self, frame: np.ndarray) -> bool:
        """CSM's EOS frame: codebooks 0..K-2 all `codebook_eos_token_id` (transformers'
        generate stops on it; the frame itself is the stream's last)."""
        return bool((np.asarray(frame)[: self.n_codebooks - 1] == self.eos_id).all())

    @property
    def codec_books(self) -> tuple[int, int]:
        return self.n_codebooks, self.codec_codebook_size

    @property
    def frame_rate_hz(self) -> float | None:
        """codec_config's frame rate (Mimi: 12.5 Hz), None when the config has no codec_config."""
        return self._frame_rate_hz

    def codec_codes(self, frames: np.ndarray) -> np.ndarray:
        """A frame row's K codebooks (the text column, `audio_token_id`, is not audio)."""
        return np.ascontiguousarray(np.asarray(frames, dtype=np.int64)[:, : self.n_codebooks].T)


@torch.no_grad()
def greedy_frames(model: TTSModel, prompts: list[np.ndarray], max_frames: int) -> list[np.ndarray]:
    """Offline greedy generation through the serving methods (`forward`, `frames`,
    `ends_stream`) on a private pool, all streams batched: for each prompt [T_i, K+1]
    (csm rows), up to `max_frames` frames [n_i, K] (the codebooks; the row's text column
    dropped). A stream stops after its EOS frame, as transformers' CSM generate does."""
    if not isinstance(model.frame_generator, DepthDecoder):
        raise ValueError("greedy_frames needs a model loaded by the csm family")
    k = model.frame_generator.n_codebooks
    greedy = SamplingParams(max_frames=max_frames)
    pool = model.new_kv_storage(sum(len(p) for p in prompts) + len(prompts) * max_frames, model.device)
    slots, start = [], 0
    for p in prompts:
        slots.append(np.arange(start, start + len(p) + max_frames))
        start += len(p) + max_frames
    lengths = [len(p) for p in prompts]
    new = [np.asarray(p, dtype=np.int64) for p in prompts]
    live = list(range(len(prompts)))
    out: list[list[np.ndarray]] = [[] for _ in prompts]
    for step in range(max_frames):
        batch = ForwardBatch.from_sequences([new[i] for i in live], [slots[i][: lengths[i]] for i in live])
        frames = model.frames(model(batch, pool), [greedy] * len(live), [step] * len(live))
        still = []
        for i, frame in zip(live, frames, strict=True):
            out[i].append(frame[:k])
            if not model.ends_stream(frame):
                still.append(i)
                new[i] = frame[None, :].astype(np.int64)
                lengths[i] += 1
        live = still
        if not live:
            break
    return [np.stack(f) for f in out]


def depth_kernels_refusal(model: TTSModel) -> str | None:
    """Why `--depth-kernels fused` cannot run on `model` (naming the flag), or None: it
    runs the GPU path's Triton kernels (on CUDA, or on the CPU under Triton's interpreter)."""
    from pdunit.kernels.paged_attention import INTERPRET

    fg = model.frame_generator
    if not isinstance(fg, DepthDecoder):
        return ("--depth-kernels fused runs a depth decoder's passes (the csm family) and this model has none: "
                "drop --depth-kernels fused")
    if model.dtype not in (torch.bfloat16, torch.float16) or (model.device.type != "cuda" and not INTERPRET):
        return ("--depth-kernels fused runs the GPU path's Triton kernels: a CUDA model in bfloat16 or float16 "
                f"(got device {model.device}, dtype {model.dtype}): drop --depth-kernels fused")
    hd = fg.cfg.head_dim
    if hd < 16 or hd & (hd - 1):
        return f"--depth-kernels fused: the depth decoder's head_dim {hd} is not a power of two >= 16: drop the flag"
    return None


def set_depth_kernels(model: TTSModel, mode: str) -> str:
    """"torch", "fused" (engine/model/depth_fused.py) or "auto" for every pass of `model`'s
    depth decoder, eager and captured; returns the kernels it set ("auto": fused where
    the model has a depth decoder on CUDA that fused can run, else torch). Set it before
    frame graphs are captured: they record the kernels live at capture. ValueError, naming
    the flag and the reason, where an explicit "fused" cannot run; "torch" is a no-op on
    any model until "fused" was set."""
    if mode not in DEPTH_KERNELS:
        raise ValueError(f"--depth-kernels {mode!r}: expected one of {', '.join(DEPTH_KERNELS)}")
    fg = model.frame_generator
    if mode == "auto":  # the interpreter's CPU path is for tests: auto never picks it
        mode = "fused" if model.device.type == "cuda" and depth_kernels_refusal(model) is None else "torch"
    if mode == "torch":
        if isinstance(fg, DepthDecoder) and fg.fused is not None:
            raise ValueError("--depth-kernels torch after fused: load the model again")
        return mode
    refusal = depth_kernels_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    if model.frame_graphs is not None:
        raise ValueError("--depth-kernels fused after the frame graphs were captured: set it before the decode "
                         "graphs are built (they record the depth decoder's kernels)")
    assert isinstance(fg, DepthDecoder)
    if fg.fused is None:
        fg.fused = FusedDepthPass(fg)
    return mode


class CsmFamily(ModelFamily):
    model_type = "csm"

    def parse_config(self, raw: dict[str, Any], name: str) -> ParsedConfig:
        _check_fields(raw, _BACKBONE_FIELDS, "config.json")
        depth_raw = raw.get("depth_decoder_config")
        if not isinstance(depth_raw, dict):
            raise ValueError("config.json: depth_decoder_config must be an object (CSM's depth decoder)")
        _check_fields(depth_raw, _DEPTH_FIELDS, "config.json depth_decoder_config")
        if depth_raw.get("model_type", DEPTH_MODEL_TYPE) != DEPTH_MODEL_TYPE:
            raise ValueError(
                f"config.json depth_decoder_config.model_type is {depth_raw['model_type']!r}, "
                f"expected {DEPTH_MODEL_TYPE!r}"
            )
        k, v = int(raw["num_codebooks"]), int(raw["vocab_size"])
        if "text_vocab_size" not in raw:
            raise ValueError("config.json is missing field(s) ['text_vocab_size']")
        eos = raw.get("codebook_eos_token_id", 0)
        if not isinstance(eos, int):
            raise ValueError(f"config.json codebook_eos_token_id must be one integer (got {eos!r})")
        dtype = _dtype(raw, "config.json")
        backbone = _llama_shape(
            raw, "config.json", name=name, dtype=dtype, n_codebooks=k + 1,
            vocab_sizes=(v,) * k + (int(raw["text_vocab_size"]),), eos_id=eos, head_codebooks=1,
        )
        dk, dv = int(depth_raw["num_codebooks"]), int(depth_raw["vocab_size"])
        backbone_hidden = int(depth_raw.get("backbone_hidden_size", backbone.hidden))
        for field, got, want in (
            ("num_codebooks", dk, k), ("vocab_size", dv, v), ("backbone_hidden_size", backbone_hidden, backbone.hidden),
        ):
            if got != want:
                raise ValueError(
                    f"config.json depth_decoder_config.{field} is {got}, the backbone's is {want}; "
                    "they must agree"
                )
        depth = DepthConfig(
            n_codebooks=k, vocab_size=v, backbone_hidden=backbone_hidden,
            backbone=_llama_shape(
                depth_raw, "config.json depth_decoder_config", name=f"{name}-depth", dtype=dtype,
                n_codebooks=k, vocab_sizes=(v,) * k, eos_id=eos, head_codebooks=None,
            ),
        )
        audio_token = raw.get("audio_token_id")
        if not isinstance(audio_token, int) or not 0 <= audio_token < int(raw["text_vocab_size"]):
            raise ValueError(
                f"config.json audio_token_id must be a text id in [0, {raw['text_vocab_size']}) "
                f"(got {audio_token!r}): it marks a row as an audio frame"
            )
        tied = raw.get("tie_codebooks_embeddings", True)
        extras = CsmExtras(
            n_audio=k, audio_token_id=audio_token, audio_eos_token_id=raw.get("audio_eos_token_id"),
            codebook_pad_token_id=int(raw.get("codebook_pad_token_id", v - 1)),
            tied_codebook_embeddings=bool(tied), depth=depth, codec_codebook_size=_codec_codebook_size(raw, v),
            codec_frame_rate_hz=_codec_frame_rate(raw),
        )
        return ParsedConfig(backbone, extras)

    def build(self, parsed: ParsedConfig, device: str | torch.device) -> TTSModel:
        extras: CsmExtras = parsed.extras
        model = TTSModel(
            parsed.model, device=device,
            row_embedding=CsmRowEmbedding(extras.n_audio, extras.audio_token_id),
        )
        model.frame_generator = DepthDecoder(extras.depth, extras.audio_token_id, model.dtype, torch.device(device),
                                             extras.codec_codebook_size, extras.codec_frame_rate_hz)
        model.row_rule = self.row_rule(parsed)
        return model

    def row_rule(self, parsed: ParsedConfig) -> RowRule:
        """CSM's rows as `CsmRowEmbedding` reads them: text column `audio_token_id` -> an
        audio frame of codec codes; else a text row, its codebook columns empty (0, as
        Sesame writes them, or `codebook_pad_token_id`); `audio_eos_token_id` only as
        transformers embeds it, an audio-frame row of `codebook_eos_token_id`s."""
        extras: CsmExtras = parsed.extras
        k = extras.n_audio
        eos_row = extras.audio_eos_token_id if extras.audio_eos_token_id is not None else -1
        return RowRule(
            marker_column=k, marker_id=extras.audio_token_id, frame_columns=k,
            code_limit=extras.codec_codebook_size, empty_ids=tuple(sorted({0, extras.codebook_pad_token_id})),
            frame_end_id=eos_row, frame_end_code=parsed.model.eos_id,
        )

    def weight_map(self, parsed: ParsedConfig, checkpoint_names: set[str]) -> WeightMap:
        extras: CsmExtras = parsed.extras
        audio = "backbone_model.embed_tokens.embed_audio_tokens.weight"
        depth_embed = "depth_decoder.model.embed_tokens.weight"
        if audio not in checkpoint_names and extras.tied_codebook_embeddings:
            audio = depth_embed  # tied: transformers saves the table once
        out: dict[str, tuple[str, ...]] = {
            "embed.weight": (audio, "embed_text_tokens.weight"),
            "norm.weight": ("backbone_model.norm.weight",),
            "head.weight": ("lm_head.weight",),
            "frame_generator.embed.weight": (depth_embed,),
            "frame_generator.project.weight": ("depth_decoder.model.inputs_embeds_projector.weight",),
            "frame_generator.norm.weight": ("depth_decoder.model.norm.weight",),
            "frame_generator.heads": ("depth_decoder.codebooks_head.weight",),
        }
        out.update(_layer_map("layers", "backbone_model.layers", parsed.model.n_layers))
        out.update(_layer_map(
            "frame_generator.layers", "depth_decoder.model.layers", extras.depth.backbone.n_layers
        ))
        return out

    def ignored(self, checkpoint_name: str) -> bool:
        return checkpoint_name.startswith("codec_model.")

    def random_shapes(self) -> dict[str, ParsedConfig]:
        # csm-tiny: CPU tests and `pdunit local`; float64 as pdunit's tiny (frames that do
        # not depend on the batch's composition)
        tiny = self.parse_config(_CSM_TINY, "csm-tiny")
        # the GPU benchmarks' shapes (random weights, bf16): Sesame's CSM-1B as
        # transformers' CsmConfig defaults describe it, and the source articles' dual-AR
        # model written as this family (its backbone has q/k norm, which no CsmConfig says)
        dualar = self.parse_config(_DUALAR_4B, "dualar-4b-shape")
        return {
            "csm-tiny": ParsedConfig(dataclasses.replace(tiny.model, dtype="float64"), tiny.extras),
            "csm-1b-shape": self.parse_config(_CSM_1B, "csm-1b-shape"),
            "dualar-4b-shape": ParsedConfig(dataclasses.replace(dualar.model, qk_norm=True), dualar.extras),
        }


# A tiny CSM written as transformers' CsmConfig would save it: 4 codebooks of 32 ids and
# 64 text ids (a row is 5 ids), backbone 2 x 64, depth decoder 2 x 32.
_CSM_TINY: dict[str, Any] = {
    "model_type": "csm", "num_codebooks": 4, "vocab_size": 32, "text_vocab_size": 64,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "audio_token_id": 62, "audio_eos_token_id": 61, "codebook_pad_token_id": 31, "codebook_eos_token_id": 0,
    "tie_codebooks_embeddings": False,  # random tables: the backbone's and the depth decoder's differ
    "depth_decoder_config": {
        "model_type": DEPTH_MODEL_TYPE, "num_codebooks": 4, "vocab_size": 32, "backbone_hidden_size": 64,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 5, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    },
}


_ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Sesame CSM-1B's shape (transformers' CsmConfig defaults, Llama-3.2-1B's RoPE): backbone
# 16 x 2048 (32 q / 8 kv heads of 64: 32 KiB of bf16 KV a token), depth decoder 4 x 1024
# (8 q / 2 kv of 128) over 32 codebooks of 2051 ids, text vocabulary 128256; Mimi at 12.5 Hz.
_CSM_1B: dict[str, Any] = {
    "model_type": "csm", "num_codebooks": 32, "vocab_size": 2051, "text_vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_parameters": _ROPE_LLAMA3, "dtype": "bfloat16",
    "audio_token_id": 128002, "audio_eos_token_id": 128003, "codebook_pad_token_id": 2050,
    "codebook_eos_token_id": 0, "tie_codebooks_embeddings": True,
    "codec_config": {"frame_rate": 12.5, "codebook_size": 2048},
    "depth_decoder_config": {
        "model_type": DEPTH_MODEL_TYPE, "num_codebooks": 32, "vocab_size": 2051, "backbone_hidden_size": 2048,
        "hidden_size": 1024, "intermediate_size": 8192, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 33, "rms_norm_eps": 1e-5,
        "rope_parameters": _ROPE_LLAMA3,
    },
}

# The source articles' dual-AR model as this family: the qwen3-4b-shape backbone (36 x
# 2560, 32 q / 8 kv heads of 128: 144 KiB of bf16 KV a token; q/k norm set after parsing)
# whose head gives the semantic column, and a 4-layer fast decoder for the 10 codebooks
# after it (10 dependent steps a frame). A row is 11 audio ids + the text column, as this
# family writes rows; 4096 ids a column (as qwen3-4b-shape); 21 frames a second.
_DUALAR_4B: dict[str, Any] = {
    "model_type": "csm", "num_codebooks": 11, "vocab_size": 4096, "text_vocab_size": 151936,
    "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "dtype": "bfloat16",
    "audio_token_id": 151646, "audio_eos_token_id": 151647, "codebook_pad_token_id": 4095,
    "codebook_eos_token_id": 0, "tie_codebooks_embeddings": True,
    "codec_config": {"frame_rate": 21.0, "codebook_size": 4096},
    "depth_decoder_config": {
        "model_type": DEPTH_MODEL_TYPE, "num_codebooks": 11, "vocab_size": 4096, "backbone_hidden_size": 2560,
        "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 12, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
}


def _layer_map(engine: str, ckpt: str, n_layers: int) -> dict[str, tuple[str, ...]]:
    names = {
        "attn_norm.weight": "input_layernorm.weight",
        "mlp_norm.weight": "post_attention_layernorm.weight",
        **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
        **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    }
    return {f"{engine}.{i}.{e}": (f"{ckpt}.{i}.{c}",) for i in range(n_layers) for e, c in names.items()}


def _codec_codebook_size(raw: dict[str, Any], vocab: int) -> int:
    """codec_config's codebook_size (at most the codebook vocabulary), else the vocabulary."""
    codec = raw.get("codec_config")
    if not isinstance(codec, dict) or "codebook_size" not in codec:
        return vocab
    size = codec["codebook_size"]
    if not isinstance(size, int) or not 1 <= size <= vocab:
        raise ValueError(
            f"config.json codec_config.codebook_size must be an integer in [1, vocab_size={vocab}] "
            f"(got {size!r}): the codec decodes the codebooks' ids"
        )
    return size


def _codec_frame_rate(raw: dict[str, Any]) -> float | None:
    """codec_config's frames per second: its `frame_rate` when saved (older transformers
    write it; newer ones `_frame_rate`, null unless it was given), else Mimi's own formula (transformers' MimiConfig.frame_rate: sampling_rate
    over twice the product of upsampling_ratios, MimiConfig's defaults for a missing
    field: 24000 / (2 x 960) = 12.5); None without a codec_config."""
    codec = raw.get("codec_config")
    if not isinstance(codec, dict):
        return None
    rate = codec.get("frame_rate", codec.get("_frame_rate"))
    if rate is None:
        ratios = codec.get("upsampling_ratios") or [8, 6, 5, 4]
        sampling = codec.get("sampling_rate", 24000)
        if not (isinstance(ratios, list) and all(isinstance(r, int) and r > 0 for r in ratios)
                and isinstance(sampling, int | float) and not isinstance(sampling, bool)):
            raise ValueError(f"config.json codec_config: sampling_rate {sampling!r} and upsampling_ratios "
                             f"{ratios!r} must be a number and positive integers (the codec's frame rate)")
        rate = sampling / (2 * int(np.prod(ratios)))
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < float("inf"):
        raise ValueError(f"config.json codec_config.frame_rate must be a number > 0 (got {rate!r})")
    return float(rate)


def _check_fields(raw: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(
            f"{where} has unknown field(s) {unknown} for model_type 'csm'; the csm family "
            "reads the fields of transformers' CsmConfig (docs/models.md)"
        )
    missing = [f for f in _REQUIRED if f not in raw]
    if missing:
        raise ValueError(f"{where} is missing field(s) {missing}")


def _dtype(raw: dict[str, Any], where: str) -> str:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if str(name).removeprefix("torch.") not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{where} dtype {name!r}: expected float32, bfloat16 or float16")
    torch_dtype(str(name))
    return str(name).removeprefix("torch.")


def _rope_config(raw: dict[str, Any], where: str) -> tuple[float, tuple[float, float, float, int] | None]:
    """rope_parameters (transformers 5) or rope_theta + rope_scaling (4.x) -> (theta, llama3)."""
    params = raw.get("rope_parameters") or {
        "rope_theta": raw.get("rope_theta", 500000.0), **(raw.get("rope_scaling") or {})
    }
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", raw.get("rope_theta", 500000.0)))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        try:
            return theta, (
                float(params["factor"]), float(params["low_freq_factor"]),
                float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ValueError(f"{where} rope_parameters of type llama3 lacks {e.args[0]!r}") from None
    raise ValueError(f"{where} rope_parameters.rope_type {kind!r} is not supported: default or llama3")


def _llama_shape(raw: dict[str, Any], where: str, **fields: Any) -> ModelConfig:
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"{where} {flag} is true: biased projections are not supported yet")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where} hidden_act {raw['hidden_act']!r}: only silu is supported")
    heads = int(raw["num_attention_heads"])
    theta, llama3 = _rope_config(raw, where)
    return ModelConfig(
        n_layers=int(raw["num_hidden_layers"]),
        hidden=int(raw["hidden_size"]),
        n_heads=heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        ffn_hidden=int(raw["intermediate_size"]),
        rope_theta=theta,
        rope_llama3=llama3,
        rms_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_positions=int(raw.get("max_position_embeddings", 2048)),
        qk_norm=False,
        **fields,
    )
