"""CUDA graphs of the streaming Mimi decode: one capture per (batch bucket, frames a call).

Owns `MimiGraphs`: per bucket and frames a call, static codes and slot tensors and the
graph of the decoder's push over them (`MimiStreamDecoder.push_slots`, which reads and
writes the slot-indexed pools on the device with no host sync). A batch is padded to its
bucket with the decoder's scratch slot, whose state no real stream reads. On a CPU the
same push runs uncaptured. It must never change the push's math (a replay equals the
uncaptured push to rounding), and never capture in a step when `prepare` ran at start
(captures take ~0.1 s each).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (lazy buffers, cuBLAS handles, Triton compiles)


def capped_buckets(max_batch: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """`buckets` below `max_batch`, then `max_batch` itself (an engine's batch never exceeds it)."""
    if max_batch < 1:
        raise ValueError(f"max batch must be >= 1 (got {max_batch})")
    return tuple(sorted({b for b in buckets if b < max_batch} | {max_batch}))


class _Codebooks(Protocol):
    @property
    def num_codebooks(self) -> int: ...


class SlotDecoder(Protocol):
    """What `MimiGraphs` reads of its decoder (mimi_stream.py's MimiStreamDecoder, which
    imports this module: so this one names none of it, not even for types)."""

    _device: torch.device
    state_version: int
    scratch_slot: int

    @property
    def codec(self) -> _Codebooks: ...

    def push_slots(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor: ...


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

    def __init__(self, decoder: SlotDecoder, buckets: tuple[int, ...], max_frames: int) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"graph buckets must be >= 1 (got {buckets})")
        if max_frames < 1:
            raise ValueError(f"graph frames must be >= 1 (got {max_frames})")
        self.decoder = decoder
        self.buckets = tuple(sorted(set(buckets)))
        self.max_frames = max_frames
        self.capture = decoder._device.type == "cuda"
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

    def captured(self, bucket: int, frames: int) -> Any:
        """The CUDA graph of (bucket, frames) if captured, else None (a benchmark times
        its replay alone: a call's time less the copies in and out around it)."""
        entry = self._entries.get((bucket, frames))
        return None if entry is None else entry.graph

    def run(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """PCM [B, n x samples_per_frame] on the device of `codes` [B, K, n] (int64, checked;
        host or device) for the streams in `slots` [B] (int64): each piece of at most the
        largest bucket copied into its bucket's static inputs on the device (the padded
        rows the scratch slot's), then replayed. A one-piece call's PCM is a view of the
        graph's static output: copy it out before the next replay (`decode` does)."""
        dec = self.decoder
        if self._version != dec.state_version:
            self._entries.clear()
            self._pool = None
            self._version = dec.state_version
        slots = slots.to(dec._device, non_blocking=True)
        codes = codes.to(dec._device, non_blocking=True)
        batch, n, out = codes.shape[0], codes.shape[-1], []
        largest = self.buckets[-1]
        for start in range(0, batch, largest):
            m = min(largest, batch - start)
            entry = self._entry(self.bucket(m), n)
            entry.slots[:m].copy_(slots[start : start + m])
            entry.slots[m:].fill_(dec.scratch_slot)
            entry.codes[:m].copy_(codes[start : start + m])
            entry.codes[m:].zero_()
            if entry.graph is not None:
                entry.graph.replay()
            else:
                entry.out = dec.push_slots(entry.slots, entry.codes)
            self.replays += 1
            assert entry.out is not None
            out.append(entry.out[:m] if batch <= largest else entry.out[:m].clone())
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
                    dec.push_slots(entry.slots, entry.codes)
            torch.cuda.current_stream(device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                entry.out = dec.push_slots(entry.slots, entry.codes)
            entry.graph = graph
            torch.cuda.synchronize(device)
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
        self._entries[(bucket, frames)] = entry
        return entry
