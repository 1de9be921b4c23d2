"""The Mimi codec for CSM: encode a clip to codes, and decode frames to PCM as they come.

Owns each stream's codec state (`MimiStreamDecoder`, a slot of batched tensors): the
transposed convolutions' pending overlap, the causal convolutions' left context (through
transformers' MimiConv1dPaddingCache) and the decoder transformer's KV of its sliding
window (through transformers' DynamicCache), so the concatenated chunks equal
`MimiModel.decode` of all the frames; `graphs=True` replays CUDA graphs of the same push
(engine/audio/mimi_graphs.py). It runs transformers' modules and weights; it must never
decode overlapping windows and cross-fade them (the audible stutter it exists to prevent).
transformers is imported only when a codec is built, so `import pdunit.engine` stays light."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from pdunit.engine.audio.mimi_mask import window_mask

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

    def stream_decoder(self, graphs: bool = False, slots: int = 8) -> MimiStreamDecoder:
        """`graphs`: replay CUDA graphs of the push (meant for a codec on CUDA; on a CPU
        the same static-shape path runs uncaptured); `slots`: the streams it holds before
        its state grows (growth drops the captured graphs)."""
        return MimiStreamDecoder(self, slots=slots, graphs=graphs)


class MimiStreamDecoder:
    """Decodes many streams' frames with each stream's own codec state, batched per call.

    `push_many({id: codes [K, n]})` decodes the new frames of several streams in one batch
    per distinct `n` and returns each stream's PCM chunk (float32, n x samples_per_frame).
    A stream holds a slot of the batched state tensors from `open` to `close` (its slot
    is then free for the next stream); slots grow by doubling from `slots`.

    `graphs=True`: a call of at most `graph_frames` frames a stream runs as a CUDA graph
    captured per (batch bucket, frames), the batch padded to its bucket with a scratch
    slot (engine/audio/mimi_graphs.py); the same samples as the eager push to rounding.
    `use_graphs` turns it off and on per call (the benchmark's eager rows)."""

    def __init__(self, codec: MimiCodec, slots: int = 8, graphs: bool = False,
                 buckets: tuple[int, ...] | None = None, graph_frames: int = 4) -> None:
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
        impl = cfg._attn_implementation
        if impl not in ("eager", "sdpa"):
            raise ValueError(
                f"codec attention {impl!r}: streaming needs a padded 4-D mask; load the codec "
                "with attn_implementation='sdpa' or 'eager'"
            )
        self._decoder = model.decoder
        self._quantizer = model.quantizer
        self._past = cfg.sliding_window - 1  # KV positions a stream keeps
        self._dtype = next(model.parameters()).dtype
        self._device = next(model.parameters()).device
        self._convs, self._transposed = self._index_layers()
        heads, dim = cfg.num_key_value_heads, cfg.head_dim
        # The state, one row per slot: [slots, ...] each.
        self._shapes = (
            [(c.in_channels, int(c.padding_total)) for c in self._convs]  # left context
            + [(m.conv.out_channels, m.conv.kernel_size[0] - m.conv.stride[0]) for m in self._transposed]
            + [(heads, self._past, dim)] * (2 * cfg.num_hidden_layers)  # keys, values per layer
        )
        self._state = [torch.zeros(slots, *shape, device=self._device, dtype=self._dtype) for shape in self._shapes]
        self._seen = torch.zeros(slots, dtype=torch.int64, device=self._device)  # positions
        self._slot: dict[str, int] = {}
        self._free = list(range(slots - 1, -1, -1))
        self.state_version = 0  # bumped when the state tensors are replaced (growth)
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
                # MimiConv1dPaddingCache finds a layer's context by it
                module.layer_idx = len(convs)
                convs.append(module)
        for module in transposed:
            conv = module.conv
            if module.padding_left != 0 or conv.padding[0] or conv.dilation[0] != 1 or conv.output_padding[0]:
                raise ValueError("codec transposed convolution is not a causal Mimi one")
        return convs, transposed

    @property
    def open_streams(self) -> int:
        return len(self._slot)

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._slot

    def open(self, stream_id: str) -> None:
        if stream_id in self._slot:
            raise ValueError(f"stream {stream_id!r} is already open")
        if not self._free:
            n = self._seen.shape[0]
            self._state = [torch.cat([t, torch.zeros_like(t)]) for t in self._state]
            self._seen = torch.cat([self._seen, torch.zeros_like(self._seen)])
            self._free = list(range(2 * n - 1, n - 1, -1))
            self.state_version += 1  # captured graphs read the old tensors
        slot = self._free.pop()
        for t in self._state:
            t[slot].zero_()
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
                    pcm = self._decode(torch.tensor(slots, device=self._device), stacked[n].to(self._device))
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

    def _decode(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        from transformers.models.mimi.modeling_mimi import (
            MimiConv1d,
            MimiConv1dPaddingCache,
            MimiConvTranspose1d,
            MimiResnetBlock,
        )

        n_conv, n_trans = len(self._convs), len(self._transposed)
        state = [t.index_select(0, slots) for t in self._state]  # this batch's rows
        x = self._quantizer.decode(codes).to(self._dtype)
        t = 0
        if self._decoder.upsample is not None:
            x, t = self._transpose(t, x, state[n_conv + t]), 1
        x = self._transformer(x, slots, state[n_conv + n_trans :])
        cache = MimiConv1dPaddingCache(
            num_layers=n_conv,
            per_layer_padding=[int(c.padding_total) for c in self._convs],
            per_layer_padding_mode=[c.pad_mode for c in self._convs],
            per_layer_in_channels=[c.in_channels for c in self._convs],
        )
        contexts = state[:n_conv]
        cache.padding_cache = contexts  # type: ignore[assignment]  # it replaces each entry
        for layer in self._decoder.decoder_seanet.layers:
            if isinstance(layer, MimiConvTranspose1d):
                x, t = self._transpose(t, x, state[n_conv + t]), t + 1
            elif isinstance(layer, (MimiConv1d, MimiResnetBlock)):
                x = layer(x, padding_cache=cache)
            else:
                x = layer(x)
        state[:n_conv] = contexts  # the cache replaced each layer's context
        for full, rows in zip(self._state, state, strict=True):
            full.index_copy_(0, slots, rows)
        return x[:, 0, :]  # mono: [B, n x samples_per_frame]

    def _transpose(self, index: int, x: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        """A causal transposed conv streamed: the tail of each output (k - s samples, which
        the next frames still add to) waits in `pending`, updated in place."""
        conv = self._transposed[index].conv
        y = F.conv_transpose1d(x, conv.weight, None, conv.stride, 0, 0, conv.groups, 1)
        tail = conv.kernel_size[0] - conv.stride[0]
        emit = x.shape[-1] * conv.stride[0]
        y[..., :tail] += pending
        pending.copy_(y[..., emit:])
        out = y[..., :emit]
        return out if conv.bias is None else out + conv.bias[None, :, None]

    def _transformer(self, x: torch.Tensor, slots: torch.Tensor, kv: list[torch.Tensor]) -> torch.Tensor:
        """The decoder transformer over the new positions after each stream's last
        `sliding_window - 1` positions' KV (`kv`: keys, values per layer, updated in place);
        the mask is causal, the sliding window, and hides the slots of positions before 0."""
        from transformers import DynamicCache

        q, p = x.shape[-1], self._past
        seen = self._seen.index_select(0, slots)
        position_ids, mask = window_mask(seen, q, p, self._dtype)
        cache = DynamicCache(ddp_cache_data=list(zip(kv[0::2], kv[1::2], strict=True)))
        out = self._decoder.decoder_transformer(
            x.transpose(1, 2), attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True
        )
        for i, layer in enumerate(out.cache.layers):
            kv[2 * i].copy_(layer.keys[:, :, -p:])
            kv[2 * i + 1].copy_(layer.values[:, :, -p:])
        self._seen.index_copy_(0, slots, seen + q)
        return out.last_hidden_state.transpose(1, 2)
