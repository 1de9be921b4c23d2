"""The Mimi codec for CSM: encode a clip to codes, and decode frames to PCM as they come.

Owns each stream's codec state in place, in slot-indexed pools (`MimiStreamDecoder`): a KV
ring per slot for the decoder transformer, the convolutions' left contexts and pending
overlaps. A push writes only what it adds and attends over the rings by slot, so the chunks
equal `MimiModel.decode` of all the frames (CUDA graphs of the same push: mimi_graphs.py).
It runs transformers' modules and weights; it must never decode overlapping windows and
cross-fade them (the stutter it exists to prevent), nor let a slot's next stream see the
last one (a slot is reset at `open`). transformers is imported only when a codec is built."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from pdunit.engine.audio.mimi_mask import BLOCK_M, ring_attention

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
                       graph_frames: int = 4) -> MimiStreamDecoder:
        """`graphs`: replay CUDA graphs of the push (meant for a codec on CUDA; on a CPU
        the same path runs uncaptured); `slots`: the streams it holds before its pools
        grow (growth drops the captured graphs); `buckets`, `graph_frames`: the graphs'
        batch sizes and the most frames a captured call takes."""
        return MimiStreamDecoder(self, slots=slots, graphs=graphs, buckets=buckets, graph_frames=graph_frames)


class MimiStreamDecoder:
    """Decodes many streams' frames with each stream's own codec state, batched per call.

    `push_many({id: codes [K, n]})` decodes the new frames of several streams in one batch
    per distinct `n` and returns each stream's PCM chunk (float32, n x samples_per_frame).
    A stream holds a slot of the pools from `open` to `close` (the slot is reset when the
    next stream opens it); the pools grow by doubling from `slots`.

    The pools, one row per slot: `kv` [layers, 2, slots, ring, kv heads, head dim], each
    slot's ring of the last `ring` positions (position p at entry p % ring; `ring` is the
    window's `sliding_window - 1` past positions plus the most positions one transformer
    pass adds, so writing a pass never overwrites a position the pass still attends);
    `conv` [slots, context], every convolution's left context and every transposed
    convolution's pending tail, flat; `seen` [slots], the positions each stream has made.

    `graphs=True`: a call of at most `graph_frames` frames a stream runs as a CUDA graph
    captured per (batch bucket, frames), the batch padded to its bucket with a scratch
    slot (engine/audio/mimi_graphs.py); `use_graphs` turns it off and on per call (the
    benchmark's eager rows). `attention`: "triton" (CUDA: the kernel reads the rings in
    place), "torch" (gathers the batch's rings; any device) or "auto" (triton on CUDA)."""

    def __init__(self, codec: MimiCodec, slots: int = 8, graphs: bool = False,
                 buckets: tuple[int, ...] | None = None, graph_frames: int = 4, attention: str = "auto") -> None:
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
        self._quantizer = model.quantizer
        self._dtype = next(model.parameters()).dtype
        self._device = next(model.parameters()).device
        if attention == "auto":
            attention = "triton" if self._device.type == "cuda" else "torch"
        if attention not in ("triton", "torch") or (attention == "triton" and self._device.type != "cuda"):
            raise ValueError(f"codec attention {attention!r} on {self._device.type}: triton needs CUDA; "
                             "torch runs anywhere")
        self.attention = attention
        self._convs, self._transposed = self._index_layers()
        self.window = int(cfg.sliding_window)
        upsample = self._decoder.upsample
        per_frame = int(upsample.conv.stride[0]) if upsample is not None else 1  # transformer positions a frame
        self.pass_positions = min(BLOCK_M, per_frame * graph_frames)  # a longer call runs in passes
        self.ring = self.window - 1 + self.pass_positions
        layout: list[tuple[int, int, int]] = []  # (offset, channels, length) in the conv pool
        offset = 0
        for channels, length in (
            [(c.in_channels, int(c.padding_total)) for c in self._convs]  # left context
            + [(m.conv.out_channels, m.conv.kernel_size[0] - m.conv.stride[0]) for m in self._transposed]
        ):
            layout.append((offset, channels, length))
            offset += channels * length
        self._layout = layout
        pool = dict(device=self._device, dtype=self._dtype)
        self._kv = torch.zeros(cfg.num_hidden_layers, 2, slots, self.ring, cfg.num_key_value_heads, cfg.head_dim,
                               **pool)  # type: ignore[arg-type]
        self._conv = torch.zeros(slots, offset, **pool)  # type: ignore[arg-type]
        self._seen = torch.zeros(slots, dtype=torch.int64, device=self._device)
        self._slot: dict[str, int] = {}
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

    def _index_layers(self) -> tuple[list[Any], list[Any]]:
        from transformers.models.mimi.modeling_mimi import MimiConv1d, MimiConvTranspose1d

        transposed = [self._decoder.upsample] if self._decoder.upsample is not None else []
        convs: list[Any] = []
        for module in self._decoder.decoder_seanet.modules():
            if isinstance(module, MimiConvTranspose1d):
                transposed.append(module)
            elif isinstance(module, MimiConv1d):
                # the SEANet decoder leaves layer_idx unset (it never streams by itself);
                # here it is the layer's place in the conv pool
                module.layer_idx = len(convs)
                convs.append(module)
        for module in transposed:
            conv = module.conv
            if module.padding_left != 0 or conv.padding[0] or conv.dilation[0] != 1 or conv.output_padding[0]:
                raise ValueError("codec transposed convolution is not a causal Mimi one")
        for module in convs:
            if module.conv.stride[0] != 1:
                raise ValueError("codec decoder convolution with stride != 1 is not a streamable Mimi one")
        return convs, transposed

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

    def open(self, stream_id: str) -> None:
        if stream_id in self._slot:
            raise ValueError(f"stream {stream_id!r} is already open")
        if not self._free:
            n = self.slots
            self._kv = torch.cat([self._kv, torch.zeros_like(self._kv)], dim=2)
            self._conv = torch.cat([self._conv, torch.zeros_like(self._conv)])
            self._seen = torch.cat([self._seen, torch.zeros_like(self._seen)])
            self._free = list(range(2 * n - 1, n - 1, -1))
            self.state_version += 1  # captured graphs read the old pools
        slot = self._free.pop()
        self._kv[:, :, slot].zero_()  # masked by position anyway; zeros keep a NaN of the last stream out
        self._conv[slot].zero_()
        self._seen[slot] = 0
        self._slot[stream_id] = slot

    def close(self, stream_id: str) -> None:
        """Free the stream's slot (idempotent: a stream closed twice is not an error)."""
        slot = self._slot.pop(stream_id, None)
        if slot is not None:
            self._free.append(slot)

    def push(self, stream_id: str, codes: np.ndarray | torch.Tensor) -> np.ndarray:
        return self.push_many({stream_id: codes})[stream_id]

    @property
    def graphs(self) -> Any:
        """The decoder's `MimiGraphs` (None without `graphs=True`): its buckets and counters."""
        return self._graphs

    def push_many(self, frames: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, np.ndarray]:
        """Every stream's codes are checked (shape, range) before anything is decoded."""
        k = self.codec.num_codebooks
        groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for stream_id, codes in frames.items():
            if stream_id not in self._slot:
                raise KeyError(f"stream {stream_id!r} is not open")
            c = torch.as_tensor(codes)
            if c.ndim != 2 or c.shape[0] != k or c.shape[1] < 1:
                raise ValueError(
                    f"stream {stream_id!r}: codes of shape {tuple(c.shape)}, expected ({k}, frames >= 1)"
                )
            groups.setdefault(c.shape[1], []).append((stream_id, c))
        stacked = {}
        for n, group in groups.items():  # one range check per group (per stream, 10s of us each)
            batch = torch.stack([c for _, c in group]).to(torch.int64)
            if bool(((batch < 0) | (batch >= self.codec.codebook_size)).any()):
                for stream_id, c in group:
                    self._check(stream_id, c)
            stacked[n] = batch
        out: dict[str, np.ndarray] = {}
        with torch.inference_mode():
            for n, group in groups.items():
                slots = [self._slot[s] for s, _ in group]
                if self._graphs is not None and self.use_graphs and self._graphs.handles(n):
                    pcm = self._graphs.decode(slots, stacked[n])
                else:
                    pcm = self.push_slots(torch.tensor(slots, device=self._device), stacked[n].to(self._device))
                for (stream_id, _), chunk in zip(group, pcm.float().cpu().numpy(), strict=True):
                    out[stream_id] = chunk
        return out

    def _check(self, stream_id: str, codes: np.ndarray | torch.Tensor) -> torch.Tensor:
        c = torch.as_tensor(codes).to(torch.int64)
        k, size = self.codec.num_codebooks, self.codec.codebook_size
        if c.ndim != 2 or c.shape[0] != k or c.shape[1] < 1:
            raise ValueError(
                f"stream {stream_id!r}: codes of shape {tuple(c.shape)}, expected ({k}, frames >= 1)"
            )
        bad = (c < 0) | (c >= size)
        if bool(bad.any()):
            book, frame = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"stream {stream_id!r} frame {frame} codebook {book} has id {int(c[book, frame])}, "
                f"outside [0, {size})"
            )
        return c

    def push_slots(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The push of `codes` [B, K, n] (device, int64) for the streams in `slots` [B]
        (device; a repeated slot is only ever the graphs' scratch one): PCM [B, n x
        samples_per_frame]. Tensor ops only, no host sync: a CUDA graph captures it."""
        from transformers.models.mimi.modeling_mimi import (
            MimiConv1d,
            MimiConvTranspose1d,
            MimiResnetBlock,
        )

        contexts = self._conv.index_select(0, slots)  # the batch's conv state: a few kB a stream
        x = self._quantizer.decode(codes).to(self._dtype)
        t = 0
        if self._decoder.upsample is not None:
            x, t = self._transpose(0, x, slots, contexts), 1
        x = self._transformer(x, slots)
        for layer in self._decoder.decoder_seanet.layers:
            if isinstance(layer, MimiConvTranspose1d):
                x, t = self._transpose(t, x, slots, contexts), t + 1
            elif isinstance(layer, MimiConv1d):
                x = self._conv1d(layer, x, slots, contexts)
            elif isinstance(layer, MimiResnetBlock):  # its forward, each conv given its context
                h = x
                for sub in layer.block:
                    h = self._conv1d(sub, h, slots, contexts) if isinstance(sub, MimiConv1d) else sub(h)
                shortcut = layer.shortcut
                x = (self._conv1d(shortcut, x, slots, contexts) if isinstance(shortcut, MimiConv1d)
                     else shortcut(x)) + h
            else:
                x = layer(x)
        return x[:, 0, :]  # mono: [B, n x samples_per_frame]

    def _state(self, index: int, contexts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entry `index` of the conv pool: its rows of the batch [B, C, L] (read) and its
        columns of the pool [slots, C x L] (written by slot)."""
        offset, channels, length = self._layout[index]
        cols = slice(offset, offset + channels * length)
        return contexts[:, cols].view(-1, channels, length), self._conv[:, cols]

    def _conv1d(self, layer: Any, x: torch.Tensor, slots: torch.Tensor, contexts: torch.Tensor) -> torch.Tensor:
        """A causal `MimiConv1d` streamed (its forward with a padding cache): the left
        context, then the new samples; the last samples become the next context."""
        index = layer.layer_idx
        if self._layout[index][2] == 0:
            return layer.conv(x)
        context, pool = self._state(index, contexts)
        h = torch.cat([context, x], dim=-1)
        pool.index_copy_(0, slots, h[..., h.shape[-1] - context.shape[-1] :].reshape(h.shape[0], -1))
        return layer.conv(h)

    def _transpose(self, index: int, x: torch.Tensor, slots: torch.Tensor, contexts: torch.Tensor) -> torch.Tensor:
        """A causal transposed conv streamed: the tail of each output (k - s samples, which
        the next frames still add to) waits in the pool."""
        conv = self._transposed[index].conv
        pending, pool = self._state(len(self._convs) + index, contexts)
        y = F.conv_transpose1d(x, conv.weight, None, conv.stride, 0, 0, conv.groups, 1)
        emit = x.shape[-1] * conv.stride[0]
        y[..., : pending.shape[-1]] += pending
        pool.index_copy_(0, slots, y[..., emit:].reshape(y.shape[0], -1))
        out = y[..., :emit]
        return out if conv.bias is None else out + conv.bias[None, :, None]

    def _transformer(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The decoder transformer over the new positions (`x` [B, hidden, q]), in passes of
        at most `pass_positions`: each pass writes its keys and values into the slots'
        rings, then attends over the rings (the window of each query, by position)."""
        model = self._decoder.decoder_transformer
        h = x.transpose(1, 2)
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
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out.transpose(1, 2)

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
