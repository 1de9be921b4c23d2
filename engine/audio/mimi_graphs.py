"""CUDA graphs of the streaming Mimi decode: one capture per (batch bucket, frames a call).

Owns the capture-safe push (`static_push`: static codes and slot tensors in; the state
gathered and written back on the device; transformers' own layer modules run with a window
cache object in place of DynamicCache and a mask built from tensors; each SEANet
convolution's module fed its left context by one `torch.cat`; no host sync, no Python
branch on a tensor's value) and `MimiGraphs`, its buckets and captures. A batch is padded
to its bucket with the decoder's scratch slot, whose state no real stream reads. On a CPU
the same path runs uncaptured (the tests compare it with the eager push). It must never
change the eager push's math (`MimiStreamDecoder._decode`): the two agree to rounding."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pdunit.engine.audio.mimi_mask import window_mask

if TYPE_CHECKING:
    from pdunit.engine.audio.mimi_stream import MimiStreamDecoder

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (lazy buffers, cuBLAS handles)


class _WindowCache:
    """What transformers' `MimiAttention` calls on its cache (`update(keys, values,
    layer_idx)` -> the layer's KV with the new rows appended, DynamicCache's torch.cat),
    keeping each layer's last `past` rows in `kv` (keys, values per layer) for the slots."""

    def __init__(self, kv: list[torch.Tensor], past: int) -> None:
        self.kv = kv
        self.past = past

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int,
               kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([self.kv[2 * layer_idx], keys], dim=-2)
        v = torch.cat([self.kv[2 * layer_idx + 1], values], dim=-2)
        self.kv[2 * layer_idx] = k[:, :, -self.past :]
        self.kv[2 * layer_idx + 1] = v[:, :, -self.past :]
        return k, v


def static_push(dec: MimiStreamDecoder, slots: torch.Tensor, codes: torch.Tensor,
                pads: list[int]) -> torch.Tensor:
    """The push of `codes` [B, K, n] for the streams in `slots` [B] (device tensors; a
    repeated slot is only ever the scratch one): the eager push's steps in capture-safe
    form. `pads[i]`: the left context of the decoder's i-th convolution (Python ints)."""
    from transformers.models.mimi.modeling_mimi import (
        MimiConv1d,
        MimiConvTranspose1d,
        MimiResnetBlock,
    )

    n_conv, n_trans = len(dec._convs), len(dec._transposed)
    state = [t.index_select(0, slots) for t in dec._state]
    x = dec._quantizer.decode(codes).to(dec._dtype)
    t = 0
    if dec._decoder.upsample is not None:
        x, t = dec._transpose(0, x, state[n_conv]), 1
    x, state[n_conv + n_trans :] = _transformer(dec, x, slots, state[n_conv + n_trans :])
    contexts = state[:n_conv]

    def conv(layer: Any, h: torch.Tensor) -> torch.Tensor:
        # MimiConv1d.forward with a padding cache: the context, then the new samples
        i = layer.layer_idx
        h = torch.cat([contexts[i], h], dim=-1)
        contexts[i] = h[..., h.shape[-1] - pads[i] :]
        return layer.conv(h)

    for layer in dec._decoder.decoder_seanet.layers:
        if isinstance(layer, MimiConvTranspose1d):
            x, t = dec._transpose(t, x, state[n_conv + t]), t + 1
        elif isinstance(layer, MimiConv1d):
            x = conv(layer, x)
        elif isinstance(layer, MimiResnetBlock):  # MimiResnetBlock.forward
            h = x
            for sub in layer.block:
                h = conv(sub, h) if isinstance(sub, MimiConv1d) else sub(h)
            res = conv(layer.shortcut, x) if isinstance(layer.shortcut, MimiConv1d) else layer.shortcut(x)
            x = res + h
        else:
            x = layer(x)
    state[:n_conv] = contexts
    for full, rows in zip(dec._state, state, strict=True):
        full.index_copy_(0, slots, rows)
    return x[:, 0, :]


def _transformer(dec: MimiStreamDecoder, x: torch.Tensor, slots: torch.Tensor,
                 kv: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """MimiTransformerModel.forward's layers over the new positions, after each slot's
    window of KV: its rotary embedding and layer modules, the window mask of the eager
    push. Returns the output and the new windows (keys, values per layer)."""
    model = dec._decoder.decoder_transformer
    h = x.transpose(1, 2)
    seen = dec._seen.index_select(0, slots)
    position_ids, mask = window_mask(seen, h.shape[1], dec._past, dec._dtype)
    cache = _WindowCache(list(kv), dec._past)
    position_embeddings = model.rotary_emb(h, position_ids)
    for layer in model.layers:
        h = layer(h, attention_mask=mask, position_ids=position_ids, cache=cache,
                  position_embeddings=position_embeddings)
    dec._seen.index_copy_(0, slots, seen + h.shape[1])
    return h.transpose(1, 2), cache.kv


@dataclass
class _Entry:
    slots: torch.Tensor  # [bucket] int64, the static input
    codes: torch.Tensor  # [bucket, K, n] int64, the static input
    graph: Any = None  # torch.cuda.CUDAGraph; None on a CPU (run uncaptured)
    out: torch.Tensor | None = None  # the captured output [bucket, n x samples_per_frame]


class MimiGraphs:
    """Per (bucket, frames) static inputs and, on CUDA, a graph captured at first use. A
    batch over the largest bucket runs in pieces of it; the decoder's state tensors being
    replaced (slot growth) drops every graph (recaptured at next use)."""

    def __init__(self, decoder: MimiStreamDecoder, buckets: tuple[int, ...], max_frames: int) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"graph buckets must be >= 1 (got {buckets})")
        if max_frames < 1:
            raise ValueError(f"graph frames must be >= 1 (got {max_frames})")
        self.decoder = decoder
        self.buckets = tuple(sorted(set(buckets)))
        self.max_frames = max_frames
        self.capture = decoder._device.type == "cuda"
        self.pads = [int(c.padding_total) for c in decoder._convs]
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._version = decoder.state_version
        self._pool: Any = None
        self.captures = 0  # graphs captured (recaptures after growth included)
        self.capture_seconds = 0.0
        self.replays = 0  # graph launches (on a CPU: static runs)

    def handles(self, frames: int) -> bool:
        return frames <= self.max_frames

    def bucket(self, batch: int) -> int:
        return next((b for b in self.buckets if b >= batch), self.buckets[-1])

    def prepare(self, frames: tuple[int, ...] = (1, 2), max_batch: int | None = None) -> int:
        """Capture now (at engine start, not in a step) every bucket up to the one holding
        `max_batch` for each frames-a-call in `frames`; returns the graphs made. Slot growth
        drops them: give the decoder its slots up front."""
        top = self.bucket(max_batch) if max_batch else self.buckets[-1]
        made = 0
        with torch.inference_mode():
            for n in frames:
                for bucket in self.buckets:
                    if bucket <= top and self.handles(n) and (bucket, n) not in self._entries:
                        self._entry(bucket, n)
                        made += 1
        return made

    def decode(self, slots: list[int], codes: torch.Tensor) -> torch.Tensor:
        """PCM [B, n x samples_per_frame] of `codes` [B, K, n] (int64, host) for the
        streams in `slots`, as the eager push returns it (a tensor the caller owns)."""
        dec = self.decoder
        if self._version != dec.state_version:
            self._entries.clear()
            self._pool = None
            self._version = dec.state_version
        n, out = codes.shape[-1], []
        largest = self.buckets[-1]
        for start in range(0, len(slots), largest):
            part = slots[start : start + largest]
            bucket = self.bucket(len(part))
            entry = self._entry(bucket, n)
            host_slots = torch.full((bucket,), dec.scratch_slot, dtype=torch.int64)
            host_slots[: len(part)] = torch.tensor(part, dtype=torch.int64)
            host_codes = torch.zeros(entry.codes.shape, dtype=torch.int64)
            host_codes[: len(part)] = codes[start : start + len(part)]
            entry.slots.copy_(host_slots)
            entry.codes.copy_(host_codes)
            if entry.graph is not None:
                entry.graph.replay()
            else:
                entry.out = static_push(dec, entry.slots, entry.codes, self.pads)
            self.replays += 1
            assert entry.out is not None
            out.append(entry.out[: len(part)].clone())
        return out[0] if len(out) == 1 else torch.cat(out)

    def _entry(self, bucket: int, frames: int) -> _Entry:
        entry = self._entries.get((bucket, frames))
        if entry is not None:
            return entry
        dec = self.decoder
        device = dec._device
        entry = _Entry(
            slots=torch.full((bucket,), dec.scratch_slot, dtype=torch.int64, device=device),
            codes=torch.zeros(bucket, dec.codec.num_codebooks, frames, dtype=torch.int64, device=device),
        )
        if self.capture:
            t0 = time.perf_counter()
            # warm-up on a side stream: every row is the scratch slot, so only its state moves
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    static_push(dec, entry.slots, entry.codes, self.pads)
            torch.cuda.current_stream(device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                entry.out = static_push(dec, entry.slots, entry.codes, self.pads)
            entry.graph = graph
            torch.cuda.synchronize(device)
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
        self._entries[(bucket, frames)] = entry
        return entry
