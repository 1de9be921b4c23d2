"""The Mimi codec for CSM: encode a clip to codes, and decode frames to PCM as they come.

Owns each stream's codec state in place, in slot-indexed pools (`MimiStreamDecoder`): a KV
ring per slot for the decoder transformer, the convolutions' left contexts (mimi_conv.py).
A push writes only what it adds and attends over the rings by slot, so the chunks equal
`MimiModel.decode` of all the frames (CUDA graphs of the same push: mimi_graphs.py). It runs
transformers' weights (the convolutions' and codebooks' snapshotted as GEMM matrices,
channels-last from the codebooks to the PCM); it must never decode overlapping windows and
cross-fade them (the stutter it exists to prevent), nor let a slot's next stream see the
last one (a slot is reset at `open`). transformers is imported only when a codec is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdunit.engine.audio.mimi_conv import StreamConv
from pdunit.engine.audio.mimi_mask import BLOCK_M, ring_attention
from pdunit.kernels import codec_fused

if TYPE_CHECKING:
    from transformers import MimiModel


class MimiCodec:
    """A transformers `MimiModel` (encoder needed for voices, decoder for audio out)."""

    def __init__(self, model: MimiModel) -> None:
        self.model = model.eval()
        cfg = model.config
        self.sample_rate = int(cfg.sampling_rate)
        self.frame_rate = float(cfg.frame_rate)
        self.num_codebooks = int(cfg.num_quantizers)
        self.codebook_size = int(cfg.codebook_size)
        # sampling rate / frame rate: transformers before 5.2x has no `latent_stride` (the
        # same figure x the upsampling ratios); both versions' models decode this many a frame
        self.samples_per_frame = round(self.sample_rate / self.frame_rate)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def from_directory(cls, path: str, device: str = "cpu") -> MimiCodec:
        """Load a codec saved with `save_pretrained` (local files only, never a download)."""
        from transformers import MimiModel

        model: Any = MimiModel.from_pretrained(path, local_files_only=True)
        return cls(model.to(device))

    def encode(self, samples: np.ndarray) -> np.ndarray:
        """Mono float samples at `sample_rate` -> codes [num_codebooks, frames] (int64)."""
        device = next(self.model.parameters()).device
        dtype = next(self.model.parameters()).dtype
        x = torch.as_tensor(np.asarray(samples, dtype=np.float32), device=device)
        with torch.inference_mode():
            codes = self.model.encode(x.to(dtype)[None, None, :]).audio_codes
        return codes[0].to(torch.int64).cpu().numpy()

    def stream_decoder(self, graphs: bool = False, slots: int = 8, buckets: tuple[int, ...] | None = None,
                       graph_frames: int = 4, kernels: str = "auto") -> MimiStreamDecoder:
        """`graphs`: replay CUDA graphs of the push (meant for a codec on CUDA; on a CPU
        the same path runs uncaptured); `slots`: the streams it holds before its pools
        grow (growth drops the captured graphs); `buckets`, `graph_frames`: the graphs'
        batch sizes and the most frames a captured call takes; `kernels`: the push's
        kernels (`MimiStreamDecoder`'s)."""
        return MimiStreamDecoder(self, slots=slots, graphs=graphs, buckets=buckets, graph_frames=graph_frames,
                                 kernels=kernels)


class MimiStreamDecoder:
    """Decodes many streams' frames with each stream's own codec state, batched per call.

    `decode(slots, codes [B, K, n])` decodes the new frames of the streams in `slots` (the
    slot `open` gave each) in one batch: PCM [B, n x samples_per_frame], float32 on the
    host (the codec stage's call); `push_many({id: codes [K, n]})` is its per-stream form.
    A stream holds a slot of the pools from `open` to `close` (the slot is reset when the
    next stream opens it); the pools grow by doubling from `slots`.

    The pools, one row per slot: `kv` [layers, 2, slots, ring, kv heads, head dim], each
    slot's ring of the last `ring` positions (position p at entry p % ring; `ring` is the
    window's `sliding_window - 1` past positions plus the most positions one transformer
    pass adds, so writing a pass never overwrites a position the pass still attends);
    `conv` [slots, context], every convolution's left context (its last input rows,
    channels-last; a transposed conv's are its last input frames), flat; `seen` [slots],
    the positions each stream has made.

    `graphs=True`: a call of at most `graph_frames` frames a stream runs as a CUDA graph
    captured per (batch bucket, frames), the batch padded to its bucket with a scratch
    slot (engine/audio/mimi_graphs.py); `use_graphs` turns it off and on per call (the
    benchmark's eager rows). `attention`: "triton" (CUDA: the kernel reads the rings in
    place), "torch" (gathers the batch's rings; any device) or "auto" (triton on CUDA).
    `kernels`: "fused" (CUDA, or Triton's interpreter: each convolution one Triton launch
    with its ELU, bias, residual and context update, the transformer's q|k|v one GEMM, RoPE
    and the ring store one launch, the layer scales folded into o_proj and fc2, whose GEMMs
    add the residual in place, int16 PCM one launch: kernels/codec_fused.py), "torch" (the
    reference: transformers' modules and torch ops; any device) or "auto" (fused on CUDA)."""

    def __init__(self, codec: MimiCodec, slots: int = 8, graphs: bool = False,
                 buckets: tuple[int, ...] | None = None, graph_frames: int = 4, attention: str = "auto",
                 kernels: str = "auto") -> None:
        self.codec = codec
        model = codec.model
        cfg = model.config
        if model.decoder is None:
            raise ValueError("codec has no decoder (decoder_config=None): it cannot make audio")
        for name, value, wanted in (
            ("use_causal_conv", cfg.use_causal_conv, True),
            ("trim_right_ratio", cfg.trim_right_ratio, 1.0),
            ("pad_mode", cfg.pad_mode, "constant"),
        ):
            if value != wanted:
                raise ValueError(
                    f"codec config {name}={value!r} is not streamable here; Mimi's is {wanted!r}"
                )
        if not isinstance(cfg.sliding_window, int) or cfg.sliding_window < 2:
            raise ValueError(
                f"codec config sliding_window={cfg.sliding_window!r}: streaming keeps the last "
                "sliding_window - 1 positions' KV, so it needs an integer >= 2 (Mimi's is 250)"
            )
        if slots < 1 or graph_frames < 1:
            raise ValueError(f"a stream decoder needs slots >= 1 and graph_frames >= 1 (got {slots}, {graph_frames})")
        self._decoder = model.decoder
        self._dtype = next(model.parameters()).dtype
        self._device = next(model.parameters()).device
        if attention == "auto":
            attention = "triton" if self._device.type == "cuda" else "torch"
        if attention not in ("triton", "torch") or (attention == "triton" and self._device.type != "cuda"):
            raise ValueError(f"codec attention {attention!r} on {self._device.type}: triton needs CUDA; "
                             "torch runs anywhere")
        self.attention = attention
        if kernels == "auto":
            kernels = "fused" if self._device.type == "cuda" else "torch"
        if kernels not in ("fused", "torch") or (kernels == "fused" and not codec_fused.available(self._device)):
            raise ValueError(f"codec kernels {kernels!r} on {self._device.type}: fused needs CUDA (or Triton's "
                             "interpreter, TRITON_INTERPRET=1); torch runs anywhere")
        self.kernels = kernels
        self.window = int(cfg.sliding_window)
        upsample = self._decoder.upsample
        per_frame = int(upsample.conv.stride[0]) if upsample is not None else 1  # transformer positions a frame
        self.pass_positions = min(BLOCK_M, per_frame * graph_frames)  # a longer call runs in passes
        self.ring = self.window - 1 + self.pass_positions
        self._codebooks = _Codebooks(model.quantizer, self.codec.num_codebooks)
        self._upsample, self._seanet, width = _plan(self._decoder)
        self._fused_layers = [_FusedLayer(layer) for layer in self._decoder.decoder_transformer.layers] \
            if kernels == "fused" else []
        pool = dict(device=self._device, dtype=self._dtype)
        self._kv = torch.zeros(cfg.num_hidden_layers, 2, slots, self.ring, cfg.num_key_value_heads, cfg.head_dim,
                               **pool)  # type: ignore[arg-type]
        self._conv = torch.zeros(slots, width, **pool)  # type: ignore[arg-type]
        self._seen = torch.zeros(slots, dtype=torch.int64, device=self._device)
        self._slot: dict[str, int] = {}
        self._ids: list[str | None] = [None] * slots  # slot -> its open stream (errors name it)
        self._open = torch.zeros(slots, dtype=torch.bool)  # host: which slots hold an open stream
        self._free = list(range(slots - 1, -1, -1))
        self.state_version = 0  # bumped when the pools are replaced (growth)
        self._graphs: Any = None
        self.use_graphs = graphs
        self.scratch_slot = -1  # with graphs: the slot a bucket's padded rows use
        if graphs:
            from pdunit.engine.audio.mimi_graphs import DEFAULT_BUCKETS, MimiGraphs

            if slots < 2:
                raise ValueError(f"graphs need >= 2 slots (one is the padding's scratch slot; got {slots})")
            self.scratch_slot = self._free.pop()  # padded rows of a bucket read and write it
            self._graphs = MimiGraphs(self, buckets or DEFAULT_BUCKETS, graph_frames)

    @property
    def open_streams(self) -> int:
        return len(self._slot)

    @property
    def slots(self) -> int:
        return int(self._seen.shape[0])

    @property
    def pool_bytes(self) -> int:
        """Device bytes of the pools (every slot's ring, contexts and positions)."""
        return sum(t.numel() * t.element_size() for t in (self._kv, self._conv, self._seen))

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._slot

    def open(self, stream_id: str) -> int:
        """A slot for the stream (its row in `decode`'s `slots`), reset."""
        if stream_id in self._slot:
            raise ValueError(f"stream {stream_id!r} is already open")
        if not self._free:
            n = self.slots
            self._kv = torch.cat([self._kv, torch.zeros_like(self._kv)], dim=2)
            self._conv = torch.cat([self._conv, torch.zeros_like(self._conv)])
            self._seen = torch.cat([self._seen, torch.zeros_like(self._seen)])
            self._ids += [None] * n
            self._open = torch.cat([self._open, torch.zeros_like(self._open)])
            self._free = list(range(2 * n - 1, n - 1, -1))
            self.state_version += 1  # captured graphs read the old pools
        slot = self._free.pop()
        self._kv[:, :, slot].zero_()  # masked by position anyway; zeros keep a NaN of the last stream out
        self._conv[slot].zero_()
        self._seen[slot] = 0
        self._slot[stream_id] = slot
        self._ids[slot] = stream_id
        self._open[slot] = True
        return slot

    def close(self, stream_id: str) -> None:
        """Free the stream's slot (idempotent: a stream closed twice is not an error)."""
        slot = self._slot.pop(stream_id, None)
        if slot is not None:
            self._ids[slot] = None
            self._open[slot] = False
            self._free.append(slot)

    def push(self, stream_id: str, codes: np.ndarray | torch.Tensor) -> np.ndarray:
        return self.push_many({stream_id: codes})[stream_id]

    @property
    def graphs(self) -> Any:
        """The decoder's `MimiGraphs` (None without `graphs=True`): its buckets and counters."""
        return self._graphs

    def decode(self, slots: np.ndarray | torch.Tensor, codes: np.ndarray | torch.Tensor,
               pcm16: bool = False) -> torch.Tensor:
        """The batched push: `codes` [B, K, n] (integers, host or device) for the open
        streams in `slots` [B] (host ints, `open`'s), checked once for the batch (shape,
        open and distinct slots, ids in the codec's range: the error names the first
        offending stream), decoded in one launch sequence (the graph's replay where
        `graphs` handles n) -> PCM [B, n x samples_per_frame] on the host, copied out once
        (pinned and async on CUDA, then one sync), a row a stream: float32, or with `pcm16`
        int16 made on the device (`to_pcm16`: half the bytes out, no host pass)."""
        s, c = self._validated(slots, codes)
        return self._decode(s, c, pcm16)

    def push_many(self, frames: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, np.ndarray]:
        """`decode`'s per-stream form ({id: codes [K, n]} -> {id: PCM}; tests, benchmarks,
        `push`): one `decode` per distinct n, every batch checked before any is decoded."""
        k = self.codec.num_codebooks
        groups: dict[int, tuple[list[str], list[int], list[torch.Tensor]]] = {}
        for stream_id, codes in frames.items():
            slot = self._slot.get(stream_id)
            if slot is None:
                raise KeyError(f"stream {stream_id!r} is not open")
            c = torch.as_tensor(codes)
            if c.ndim != 2 or c.shape[0] != k or c.shape[1] < 1:
                raise ValueError(
                    f"stream {stream_id!r}: codes of shape {tuple(c.shape)}, expected ({k}, frames >= 1)"
                )
            ids, slots, cs = groups.setdefault(c.shape[1], ([], [], []))
            ids.append(stream_id)
            slots.append(slot)
            cs.append(c)
        checked = [(ids, self._validated(slots, torch.stack(cs))) for ids, slots, cs in groups.values()]
        out: dict[str, np.ndarray] = {}
        for ids, (s, c) in checked:
            out.update(zip(ids, self._decode(s, c, False).numpy(), strict=True))
        return out

    def _validated(self, slots: np.ndarray | torch.Tensor | list[int],
                   codes: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode`'s checks, vectorised over the batch: (slots int64 host, codes int64)."""
        k, size = self.codec.num_codebooks, self.codec.codebook_size
        s = torch.as_tensor(slots, device="cpu")
        c = torch.as_tensor(codes)
        if (s.ndim != 1 or c.ndim != 3 or c.shape[0] != s.shape[0] or c.shape[1] != k or c.shape[2] < 1
                or s.is_floating_point() or c.is_floating_point()):
            raise ValueError(f"codes {c.dtype} of shape {tuple(c.shape)} for slots of shape {tuple(s.shape)}: "
                             f"expected integer codes (streams, {k}, frames >= 1), one slot a stream")
        s = s.to(torch.int64)
        if s.numel():
            if int(s.min()) < 0 or int(s.max()) >= self.slots or not bool(self._open[s].all()):
                i = next(i for i, v in enumerate(s.tolist()) if not 0 <= v < self.slots or not self._open[v])
                raise KeyError(f"slot {int(s[i])} (row {i}) holds no open stream")
            if torch.unique(s).numel() != s.numel():
                raise ValueError(f"a slot appears twice in one call (slots {s.tolist()})")
        c = c.to(torch.int64)
        bad = ((c < 0) | (c >= size)).flatten(1).any(1)  # [B]; on the device: one sync
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            row = c[i].cpu()
            book, frame = (int(j) for j in ((row < 0) | (row >= size)).nonzero()[0])
            raise ValueError(
                f"stream {self._ids[int(s[i])]!r} frame {frame} codebook {book} has id {int(row[book, frame])}, "
                f"outside [0, {size})"
            )
        return s, c

    def _decode(self, slots: torch.Tensor, codes: torch.Tensor, pcm16: bool) -> torch.Tensor:
        """`decode` of checked inputs."""
        with torch.inference_mode():
            if self._graphs is not None and self.use_graphs and self._graphs.handles(codes.shape[2]):
                pcm = self._graphs.run(slots, codes)
            else:
                pcm = self.push_slots(slots.to(self._device, non_blocking=True),
                                      codes.to(self._device, non_blocking=True))
            if pcm16:
                pcm = codec_fused.pcm16(pcm) if self.kernels == "fused" else to_pcm16(pcm)
            else:
                pcm = pcm.float()
            if pcm.device.type == "cpu":
                return pcm
            host = torch.empty(pcm.shape, dtype=pcm.dtype, pin_memory=True)
            host.copy_(pcm, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            return host

    def push_slots(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The push of `codes` [B, K, n] (device, int64) for the streams in `slots` [B]
        (device; a repeated slot is only ever the graphs' scratch one): PCM [B, n x
        samples_per_frame]. Tensor ops only, no host sync: a CUDA graph captures it."""
        fused = self.kernels == "fused"
        contexts = self._conv.index_select(0, slots)  # the batch's conv state: a few kB a stream
        # the fused convolutions write the next contexts apart (their programs read the old ones)
        updated = torch.empty_like(contexts) if fused else contexts
        x = self._codebooks(codes).to(self._dtype)  # channels-last from here on: [B, n, hidden]
        if self._upsample is not None:
            x = self._upsample(x, contexts, updated, fused)
        x = self._transformer_fused(x, slots) if fused else self._transformer(x, slots)
        for step in self._seanet:
            x = step(x, contexts, updated, fused)
        self._conv.index_copy_(0, slots, updated)  # every conv's new context, one write by slot
        return x[:, :, 0]  # mono: [B, n x samples_per_frame]

    def _transformer(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The decoder transformer over the new positions (`x` [B, q, hidden]), in passes of
        at most `pass_positions`: each pass writes its keys and values into the slots'
        rings, then attends over the rings (the window of each query, by position)."""
        model = self._decoder.decoder_transformer
        h = x
        q = h.shape[1]
        seen = self._seen.index_select(0, slots)
        steps = torch.arange(q, device=h.device)
        parts = []
        for start in range(0, q, self.pass_positions):
            part = h[:, start : start + self.pass_positions]
            positions = seen[:, None] + steps[None, start : start + part.shape[1]]  # [B, m]
            cos, sin = model.rotary_emb(part, positions)
            for i, layer in enumerate(model.layers):
                part = self._layer(i, layer, part, (cos, sin), slots, positions)
            parts.append(part)
        self._seen.index_copy_(0, slots, seen + q)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _transformer_fused(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`_transformer` on the fused path: the residual stream `x` [B, q, hidden] is
        updated in place (a pass of every position: no copy), RoPE's tables made once a
        pass for all layers (rows of the pass, in the model dtype as transformers rounds
        them), every layer's K and V stored at entry slot x ring + position % ring of its
        pool seen flat."""
        from pdunit.kernels.fused_ops import qk_norm_rope_store

        cfg = self.codec.model.config
        heads, kv_heads, dim = int(cfg.num_attention_heads), int(cfg.num_key_value_heads), int(cfg.head_dim)
        rotary = self._decoder.decoder_transformer.rotary_emb
        b, q, hidden = x.shape
        seen = self._seen.index_select(0, slots)
        steps = torch.arange(q, device=x.device)
        pools = self._kv.view(self._kv.shape[0], 2, -1, kv_heads, dim)  # [layers, 2, slots x ring, Hkv, D]
        parts = []
        for start in range(0, q, self.pass_positions):
            part = x[:, start : start + self.pass_positions]
            m = part.shape[1]
            h = part.reshape(b * m, hidden)  # a view of x when one pass takes every position
            positions = seen[:, None] + steps[None, start : start + m]  # [B, m]
            cos, sin = (c.reshape(b * m, dim)[:, : dim // 2].float().contiguous() for c in rotary(part, positions))
            rows = torch.arange(b * m, device=x.device)  # row r's tables are row r's
            entries = (slots[:, None] * self.ring + positions % self.ring).reshape(-1)
            last = positions[:, -1].contiguous()
            for i, layer in enumerate(self._fused_layers):
                y = F.layer_norm(h, (hidden,), *layer.norm1)
                query = qk_norm_rope_store(torch.mm(y, layer.qkv), None, None, 0.0, cos, sin, rows, entries, pools[i],
                                           heads, kv_heads, dim)
                out = ring_attention(query.view(b, m, heads, dim).transpose(1, 2), self._kv[i, 0], self._kv[i, 1],
                                     slots, last, self.window, layer.scaling, self.attention)
                h.addmm_(out.reshape(b * m, heads * dim), layer.o)  # + scale x o_proj(out), the scale folded
                y = F.layer_norm(h, (hidden,), *layer.norm2)
                h.addmm_(layer.act(torch.mm(y, layer.fc1)), layer.fc2)
            parts.append(h.view(b, m, hidden))
        self._seen.index_copy_(0, slots, seen + q)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _layer(self, index: int, layer: Any, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One `MimiTransformerLayer` (its modules and weights; its attention's keys and
        values go to the ring, RoPE'd at their absolute positions as transformers caches them)."""
        from transformers.models.mimi.modeling_mimi import apply_rotary_pos_emb

        attn = layer.self_attn
        b, m, _ = h.shape
        y = layer.input_layernorm(h)
        shape = (b, m, -1, attn.head_dim)
        query = attn.q_proj(y).view(shape).transpose(1, 2)
        key = attn.k_proj(y).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *rope)
        keys, values = self._kv[index, 0], self._kv[index, 1]  # [slots, ring, kv heads, head dim]
        entries = positions % self.ring
        keys[slots[:, None], entries] = key.transpose(1, 2)
        values[slots[:, None], entries] = attn.v_proj(y).view(shape)
        out = ring_attention(query, keys, values, slots, positions[:, -1], self.window, attn.scaling, self.attention)
        h = h + layer.self_attn_layer_scale(attn.o_proj(out.reshape(b, m, -1)))
        return h + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(h)))


def to_pcm16(pcm: torch.Tensor) -> torch.Tensor:
    """pcm.py's `float_to_pcm16` samples as int16, on the PCM's device, bit for bit the
    same: NaN is silence, out-of-range values clip, x 32767 rounded half to even."""
    x = torch.nan_to_num(pcm.float(), nan=0.0, posinf=1.0, neginf=-1.0)
    return x.clamp_(-1.0, 1.0).mul_(32767.0).round_().to(torch.int16)


class _Codebooks:
    """The split residual quantizer's decode as one gather: every codebook's table (its
    module's `embed`) stacked, the semantic and the acoustic codebooks' sums, both output
    projections as one GEMM (the quantizer's own decode is ~70 small kernels a call)."""

    def __init__(self, quantizer: Any, books: int) -> None:
        split = min(int(quantizer.num_semantic_quantizers), books)
        tables: list[torch.Tensor] = []
        projections: list[torch.Tensor] = []
        self.groups: list[tuple[int, int]] = []
        for rvq, first, count in ((quantizer.semantic_residual_vector_quantizer, 0, split),
                                  (quantizer.acoustic_residual_vector_quantizer, split, books - split)):
            if count == 0:
                continue
            tables += [layer.codebook.embed.detach() for layer in rvq.layers[:count]]
            dim = tables[-1].shape[1]
            proj = rvq.output_proj  # a 1x1 conv without bias, or none where the sizes match
            projections.append(torch.eye(dim, dtype=tables[-1].dtype, device=tables[-1].device) if proj is None
                               else proj.weight.detach()[:, :, 0].T)
            self.groups.append((first, first + count))
        size = tables[0].shape[0]
        self.table = torch.cat(tables)  # [books x size, dim]
        self.offsets = torch.arange(books, device=self.table.device)[:, None] * size  # [books, 1]
        self.projection = torch.cat(projections).contiguous()  # [groups x dim, hidden]

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        """`codes` [B, K, n] (int64) -> [B, n, hidden]."""
        e = F.embedding(codes + self.offsets, self.table)  # [B, K, n, dim]
        sums = [e[:, a:b].sum(1) for a, b in self.groups]
        x = sums[0] if len(sums) == 1 else torch.cat(sums, dim=-1)
        return x @ self.projection


class _FusedLayer:
    """A `MimiTransformerLayer`'s weights as the fused path runs them, snapshotted: q|k|v
    one matrix, every matrix [in, out] (`rows @ W`), the layer scales folded into o_proj's
    and fc2's columns (scale x (a @ W) = a @ (W x scale)), the norms' (weight, bias, eps)."""

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.fc1, mlp.fc2)
        if any(lin.bias is not None for lin in linears):
            raise ValueError("codec kernels 'fused': the decoder transformer's projections have biases "
                             "(attention_bias=True), which the fused path does not add; use kernels='torch'")
        with torch.no_grad():
            self.qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).T.contiguous()
            self.o = (attn.o_proj.weight * layer.self_attn_layer_scale.scale[:, None]).T.contiguous()
            self.fc1 = mlp.fc1.weight.detach().T.contiguous()
            self.fc2 = (mlp.fc2.weight * layer.mlp_layer_scale.scale[:, None]).T.contiguous()
        self.act = mlp.activation_fn
        self.scaling = float(attn.scaling)
        self.norm1 = _norm(layer.input_layernorm)
        self.norm2 = _norm(layer.post_attention_layernorm)


def _norm(norm: nn.LayerNorm) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    w = None if norm.weight is None else norm.weight.detach()
    b = None if norm.bias is None else norm.bias.detach()
    return w, b, float(norm.eps)


@dataclass
class _Conv:
    """A decoder convolution in the push: its `StreamConv`, its state's columns of the conv
    pool and the ELU (alpha) the decoder applies to its input first."""

    conv: StreamConv
    cols: slice
    elu: float | None = None

    def __call__(self, x: torch.Tensor, contexts: torch.Tensor, updated: torch.Tensor, fused: bool,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        if not self.conv.state_values:
            return self.conv(x, None, None, self.elu, residual, fused)
        return self.conv(x, contexts[:, self.cols], updated[:, self.cols], self.elu, residual, fused)


@dataclass
class _Residual:
    """A `MimiResnetBlock` as its forward runs it: the block's convolutions, plus the
    shortcut (a convolution, or the input itself)."""

    block: list[_Conv]
    shortcut: _Conv | None

    def __call__(self, x: torch.Tensor, contexts: torch.Tensor, updated: torch.Tensor, fused: bool) -> torch.Tensor:
        skip = x if self.shortcut is None else self.shortcut(x, contexts, updated, fused)
        h = x
        for conv in self.block[:-1]:
            h = conv(h, contexts, updated, fused)
        return self.block[-1](h, contexts, updated, fused, residual=skip)  # the add in its epilogue


def _plan(decoder: Any) -> tuple[_Conv | None, list[_Conv | _Residual], int]:
    """The decoder's upsampling and SEANet as streamed steps, each convolution given its
    columns of the conv pool: (upsample, steps, pool width). Refuses, naming it, a layer
    the stream decoder cannot run exactly."""
    from transformers.models.mimi.modeling_mimi import (
        MimiConv1d,
        MimiConvTranspose1d,
        MimiResnetBlock,
    )

    width = 0

    def step(module: Any, elu: float | None) -> _Conv:
        nonlocal width
        if isinstance(module, MimiConvTranspose1d):
            if module.padding_left != 0:
                raise ValueError("codec transposed convolution is not a causal Mimi one")
            conv = StreamConv.transposed(module.conv)
        else:
            conv = StreamConv.conv1d(module.conv)
        cols = slice(width, width + conv.state_values)
        width += conv.state_values
        return _Conv(conv, cols, elu)

    def refuse(layer: Any, where: str) -> ValueError:
        return ValueError(f"codec decoder layer {type(layer).__name__} ({where}) is not one the stream decoder "
                          "runs: Mimi's are ELUs, each followed by a causal (transposed) convolution, and residual blocks")

    upsample = step(decoder.upsample, None) if decoder.upsample is not None else None
    steps: list[_Conv | _Residual] = []
    elu: float | None = None
    for i, layer in enumerate(decoder.decoder_seanet.layers):
        if isinstance(layer, nn.ELU) and elu is None:
            elu = float(layer.alpha)
        elif isinstance(layer, (MimiConv1d, MimiConvTranspose1d)):
            steps.append(step(layer, elu))
            elu = None
        elif isinstance(layer, MimiResnetBlock) and elu is None:
            block: list[_Conv] = []
            inner: float | None = None
            for sub in layer.block:
                if isinstance(sub, nn.ELU) and inner is None:
                    inner = float(sub.alpha)
                elif isinstance(sub, MimiConv1d):
                    block.append(step(sub, inner))
                    inner = None
                else:
                    raise refuse(sub, f"in residual block {i}")
            if inner is not None or not block:
                raise refuse(layer, f"layer {i}")
            if isinstance(layer.shortcut, MimiConv1d):
                steps.append(_Residual(block, step(layer.shortcut, None)))
            elif isinstance(layer.shortcut, nn.Identity):
                steps.append(_Residual(block, None))
            else:
                raise refuse(layer.shortcut, f"shortcut of layer {i}")
        else:
            raise refuse(layer, f"layer {i}")
    if elu is not None:
        raise ValueError("codec decoder ends with an ELU and no convolution after it: not a Mimi decoder")
    return upsample, steps, width
