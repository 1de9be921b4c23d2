"""The Mimi codec for CSM: encode a clip to codes, and decode frames to PCM as they come.

Owns each stream's codec state (`MimiStreamDecoder`): the transposed convolutions' pending
overlap, the causal convolutions' left context (transformers' MimiConv1dPaddingCache) and
the decoder transformer's KV (transformers' DynamicCache, cropped to its sliding window),
so the concatenated chunks equal `MimiModel.decode` of all the frames. It runs
transformers' modules and weights; it must never re-implement a codec layer, nor decode
overlapping windows and cross-fade them (the audible stutter it exists to prevent).
transformers is imported only when a codec is built, so `import pdunit.engine` stays light.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

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
        self.samples_per_frame = int(cfg.latent_stride) * math.prod(cfg.upsampling_ratios or ())

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

    def stream_decoder(self) -> MimiStreamDecoder:
        return MimiStreamDecoder(self)


@dataclass
class _Stream:
    tokens: int = 0  # decoder-transformer positions seen (frames x latent_stride)
    pending: list[torch.Tensor] = field(default_factory=list)  # per transposed conv [C, k-s]
    context: list[torch.Tensor] = field(default_factory=list)  # per causal conv [C, pad]
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer


class MimiStreamDecoder:
    """Decodes many streams' frames with each stream's own codec state, batched per call.

    `push_many({id: codes [K, n]})` decodes the new frames of several streams in one batch
    per distinct `n` and returns each stream's PCM chunk (float32, n x samples_per_frame).
    A stream exists from `open` to `close`; `close` frees its state."""

    def __init__(self, codec: MimiCodec) -> None:
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
        impl = cfg._attn_implementation
        if impl not in ("eager", "sdpa"):
            raise ValueError(
                f"codec attention {impl!r}: streaming needs a padded 4-D mask; load the codec "
                "with attn_implementation='sdpa' or 'eager'"
            )
        self._decoder = model.decoder
        self._quantizer = model.quantizer
        self._window = cfg.sliding_window
        self._dtype = next(model.parameters()).dtype
        self._device = next(model.parameters()).device
        self._convs, self._transposed = self._index_layers()
        self._streams: dict[str, _Stream] = {}

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
        return len(self._streams)

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._streams

    def open(self, stream_id: str) -> None:
        if stream_id in self._streams:
            raise ValueError(f"stream {stream_id!r} is already open")
        zeros = dict(device=self._device, dtype=self._dtype)
        self._streams[stream_id] = _Stream(
            pending=[
                torch.zeros(m.conv.out_channels, m.conv.kernel_size[0] - m.conv.stride[0], **zeros)
                for m in self._transposed
            ],
            context=[torch.zeros(c.in_channels, int(c.padding_total), **zeros) for c in self._convs],
        )

    def close(self, stream_id: str) -> None:
        """Free the stream's state (idempotent: a stream closed twice is not an error)."""
        self._streams.pop(stream_id, None)

    def push(self, stream_id: str, codes: np.ndarray | torch.Tensor) -> np.ndarray:
        return self.push_many({stream_id: codes})[stream_id]

    def push_many(self, frames: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, np.ndarray]:
        groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for stream_id, codes in frames.items():
            if stream_id not in self._streams:
                raise KeyError(f"stream {stream_id!r} is not open")
            c = self._check(stream_id, codes)
            groups.setdefault(c.shape[1], []).append((stream_id, c))
        out: dict[str, np.ndarray] = {}
        with torch.inference_mode():
            for group in groups.values():
                pcm = self._decode([s for s, _ in group], torch.stack([c for _, c in group]))
                for (stream_id, _), chunk in zip(group, pcm.float().cpu().numpy(), strict=True):
                    out[stream_id] = chunk
        return out

    def _check(self, stream_id: str, codes: np.ndarray | torch.Tensor) -> torch.Tensor:
        c = torch.as_tensor(codes).to(self._device, torch.int64)
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

    def _decode(self, ids: list[str], codes: torch.Tensor) -> torch.Tensor:
        from transformers.models.mimi.modeling_mimi import (
            MimiConv1d,
            MimiConv1dPaddingCache,
            MimiConvTranspose1d,
            MimiResnetBlock,
        )

        streams = [self._streams[i] for i in ids]
        x = self._quantizer.decode(codes).to(self._dtype)
        t = 0
        if self._decoder.upsample is not None:
            x, t = self._transpose(0, x, streams), 1
        x = self._transformer(x, streams)
        cache = MimiConv1dPaddingCache(
            num_layers=len(self._convs),
            per_layer_padding=[int(c.padding_total) for c in self._convs],
            per_layer_padding_mode=[c.pad_mode for c in self._convs],
            per_layer_in_channels=[c.in_channels for c in self._convs],
        )
        contexts = [torch.stack([s.context[i] for s in streams]) for i in range(len(self._convs))]
        cache.padding_cache = contexts  # type: ignore[assignment]  # updated in place per layer
        for layer in self._decoder.decoder_seanet.layers:
            if isinstance(layer, MimiConvTranspose1d):
                x, t = self._transpose(t, x, streams), t + 1
            elif isinstance(layer, (MimiConv1d, MimiResnetBlock)):
                x = layer(x, padding_cache=cache)
            else:
                x = layer(x)
        for i, ctx in enumerate(contexts):
            for s, row in zip(streams, ctx, strict=True):
                s.context[i] = row
        return x[:, 0, :]  # mono: [B, n x samples_per_frame]

    def _transpose(self, index: int, x: torch.Tensor, streams: list[_Stream]) -> torch.Tensor:
        """A causal transposed conv streamed: the tail of each output (k - s samples, which
        the next frames still add to) waits in the stream's pending sums."""
        conv = self._transposed[index].conv
        y = F.conv_transpose1d(x, conv.weight, None, conv.stride, 0, 0, conv.groups, 1)
        tail = conv.kernel_size[0] - conv.stride[0]
        emit = x.shape[-1] * conv.stride[0]
        y[..., :tail] += torch.stack([s.pending[index] for s in streams])
        for s, row in zip(streams, y[..., emit:], strict=True):
            s.pending[index] = row
        out = y[..., :emit]
        return out if conv.bias is None else out + conv.bias[None, :, None]

    def _transformer(self, x: torch.Tensor, streams: list[_Stream]) -> torch.Tensor:
        """The decoder transformer over the new positions, each stream's past KV left-padded
        to the batch's longest and masked (causal, sliding window, padding)."""
        from transformers import DynamicCache

        b, q = x.shape[0], x.shape[-1]
        past = [s.kv[0][0].shape[1] if s.kv else 0 for s in streams]
        longest = max(past)
        start = torch.tensor([s.tokens for s in streams], device=self._device)
        steps = torch.arange(q, device=self._device)
        position_ids = start[:, None] + steps[None, :]  # [B, q]
        kv_pos = start[:, None] - longest + torch.arange(longest + q, device=self._device)[None, :]
        real = kv_pos >= (start - torch.tensor(past, device=self._device))[:, None]
        allowed = real[:, None, :] & (kv_pos[:, None, :] <= position_ids[:, :, None])
        if self._window is not None:
            allowed &= kv_pos[:, None, :] > position_ids[:, :, None] - self._window
        mask = torch.zeros(b, 1, q, longest + q, device=self._device, dtype=self._dtype)
        mask.masked_fill_(~allowed[:, None], torch.finfo(self._dtype).min)
        cache = DynamicCache()
        if longest:
            ref = next(s.kv for s in streams if s.kv)
            cache = DynamicCache(ddp_cache_data=[
                tuple(torch.stack([_left_padded(s, layer, j, ref, longest) for s in streams]) for j in (0, 1))
                for layer in range(len(ref))
            ])
        out = self._decoder.decoder_transformer(
            x.transpose(1, 2), attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True
        )
        for i, s in enumerate(streams):
            lo = longest - past[i]
            if self._window is not None:  # a later position never sees further back than this
                lo = max(lo, longest + q - (self._window - 1))
            s.kv = [(layer.keys[i, :, lo:], layer.values[i, :, lo:]) for layer in out.cache.layers]
            s.tokens += q
        return out.last_hidden_state.transpose(1, 2)


def _left_padded(
    stream: _Stream, layer: int, j: int, ref: list[tuple[torch.Tensor, torch.Tensor]], length: int
) -> torch.Tensor:
    """A stream's past keys (j=0) or values (j=1) of a layer, left-padded with zeros to
    `length` (a new stream: all zeros, shaped as `ref`'s)."""
    if not stream.kv:
        return ref[layer][j].new_zeros(ref[layer][j].shape[0], length, ref[layer][j].shape[2])
    t = stream.kv[layer][j]
    return F.pad(t, (0, 0, length - t.shape[1], 0))
