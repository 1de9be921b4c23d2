"""CUDA graphs for a frame generator (csm's depth decoder): one captured `frames_static`
per batch bucket (and top-k cap where the sampler's cost depends on it), replayed right
after the backbone's decode graph (D) or the prefill forward (P's first frames).

Owns the static inputs (hidden states, the packed sampling rows), the generator's
preallocated work buffers, the capture and the replay. Must never change the model or
its weights (a graph holds their addresses; a runner refuses to run once the model's
decode_gemm changed), and runs on one thread, as the decode graphs do. `capture=False`
runs `frames_static` eagerly on the same padded buffers: what a graph replays,
checkable on the CPU and against the captured graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from pdunit.engine.model.sampling import ROW_UNIFORMS, SamplingBatch, to_device
from pdunit.engine.model.transformer import TTSModel

# The torch form of `sample_frames_static` (a plain CPU) costs more the larger its cap:
# each bucket is captured once per cap, 0 (no sampled row filters: greedy and plain
# temperature), a top-k of at most 64 (`torch.topk(64)`), any top-k (a full sort). The
# fused sampler (kernels/sampling_fused.py: CUDA, Triton's interpreter) takes the cap as
# a launch argument at one cost: each bucket once, at the cap that covers every row.
TOP_K_CAPS: tuple[int | None, ...] = (0, 64, None)


def captured_caps(device: torch.device) -> tuple[int | None, ...]:
    """The top-k caps FrameGraphRunner captures each bucket at on `device`: (None,) where
    `sample_frames_static` runs the fused sampler, TOP_K_CAPS where it runs the torch form."""
    from pdunit.kernels import sampling_fused  # Triton is imported at the first call

    return (None,) if sampling_fused.available(device) else TOP_K_CAPS


def frame_graphs_supported(model: TTSModel) -> bool:
    """True when the model's frame generator has a capture-safe form."""
    return model.frame_generator is not None and model.frame_generator.capture_safe


# A batch of n rows runs in the smallest bucket >= n: rows n.. are padding (hidden and
# sampling rows zero: greedy, nothing suppressed), their frames dropped. The cap is the
# smallest of `caps` >= the batch's largest top_k. More rows than the largest bucket,
# or an output on another device, run eagerly (`run` returns None), counted in
# `stats["eager"]`.
class FrameGraphRunner:
    """`run(hidden, sb) -> frames` with the frames of `frame_generator.frames_device`."""

    def __init__(self, model: TTSModel, buckets: Sequence[int], capture: bool = True) -> None:
        fg = model.frame_generator
        if fg is None or not frame_graphs_supported(model):
            raise ValueError("the model's frame generator has no capture-safe form (frames_static)")
        sizes = sorted({int(b) for b in buckets})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {list(buckets)}")
        if capture and model.device.type != "cuda":
            raise ValueError(f"frame graphs need a CUDA model (got device {model.device})")
        self.model, self.sizes = model, sizes
        self.caps = captured_caps(model.device)
        # what `_capture` records, largest bucket first (the others reuse its memory)
        self.keys = [(size, cap) for size in reversed(sizes) for cap in self.caps]
        self.stats = {"replays": 0, "eager": 0}
        self.decode_gemm = model.decode_gemm  # the depth decoder's GEMMs the graphs record
        dev, big = model.device, sizes[-1]
        self._work = fg.static_work(big, dev)
        # Shared by every bucket and cap: bucket b reads rows [:b] (one replay at a time).
        self._hidden = torch.zeros((big, model.config.hidden), dtype=model.dtype, device=dev)
        self._rows = torch.zeros((big, ROW_UNIFORMS + model.config.n_codebooks), dtype=torch.float64, device=dev)
        self._graphs: dict[tuple[int, int | None], torch.cuda.CUDAGraph] = {}
        self._out: dict[tuple[int, int | None], torch.Tensor] = {}
        if capture:
            self._capture()

    def _step(self, size: int, cap: int | None) -> Callable[[], torch.Tensor]:
        fg = self.model.frame_generator
        assert fg is not None
        return lambda: fg.frames_static(self.model, self._hidden[:size], self._rows[:size], self._work, cap)

    def _capture(self) -> None:
        dev = self.model.device
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size, cap in self.keys:
                step = self._step(size, cap)
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    step()  # cuBLAS handles, SDPA's kernels
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._out[(size, cap)] = step()
                self._graphs[(size, cap)] = graph
        torch.cuda.synchronize(dev)

    def replay_staged(self, size: int, top_k_cap: int | None) -> None:
        """Replays bucket `size` at the captured cap covering `top_k_cap` on the inputs the
        last `run` staged (benchmarks time the frame generation alone this way; it writes
        only the runner's own buffers)."""
        self._graphs[(size, self._cover(top_k_cap))].replay()

    def bucket_for(self, n: int) -> int | None:
        """The smallest captured batch size >= n, or None when n is too large."""
        return next((b for b in self.sizes if b >= n), None)

    def cap_for(self, sb: SamplingBatch) -> int | None:
        """The smallest of `caps` that covers every sampled row's top_k."""
        return self._cover(sb.max_top_k)

    def _cover(self, k: int | None) -> int | None:
        """The smallest of `caps` that covers a top-k of `k` (None: any)."""
        return next((c for c in self.caps if c is None or (k is not None and c >= k)), None)

    def run(self, hidden: torch.Tensor, sb: SamplingBatch) -> torch.Tensor | None:
        """Frames int32 [n, C] (a fresh tensor) of hidden [n, hidden] sampled per `sb`,
        or None when no bucket covers them (counted; the caller runs them eagerly). No
        host sync: `sb.packed` goes to the device by one async copy. ValueError once the
        model's decode_gemm is not the one the graphs recorded."""
        if self.model.decode_gemm != self.decode_gemm:
            raise ValueError(f"the model's decode_gemm is {self.model.decode_gemm!r}, the frame graphs recorded "
                             f"{self.decode_gemm!r} GEMMs: build a new runner after set_decode_gemm")
        n = hidden.shape[0]
        size = self.bucket_for(n)
        if size is None or n == 0 or hidden.device != self.model.device or sb.packed is None:
            self.stats["eager"] += 1
            return None
        if sb.n_rows != n:
            raise ValueError(f"{n} hidden rows but a sampling batch of {sb.n_rows}")
        cap = self.cap_for(sb)
        rows = to_device(np.ascontiguousarray(sb.packed), hidden.device)
        with torch.inference_mode():
            self._hidden[:n].copy_(hidden)
            self._hidden[n:size].zero_()
            self._rows[:n].copy_(rows)
            self._rows[n:size].zero_()
            if (size, cap) in self._graphs:
                self._graphs[(size, cap)].replay()
                out = self._out[(size, cap)]
            else:  # capture=False: what the graph would replay
                out = self._step(size, cap)()
            self.stats["replays"] += 1
            return out[:n].clone()
