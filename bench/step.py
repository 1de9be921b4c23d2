"""`pdunit bench step`: decode step time vs batch and context against its roofline
(BENCHMARKS.md section 3), without and with D's overlap scheduling, for any family.

Owns one measurement of D's whole decode step as D runs it (backbone, and a family's
frame generation: csm's depth decoder and sampling, graphs where D captures them) over
D's own paged pool fragmented by churn, `DecodeBatcher` and `StepForward`; per row step,
host, wait and device times (backbone and frames apart), the roofline from the family's
bytes and FLOPs (`step_work`; the columns: docs/performance.md). Must never be run for
a claim without writing its results file, and never re-implements the engine's step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import functools
import math
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdunit.bench import report
from pdunit.bench.cuda_timing import event_times_ms, kernel_ms, times_ms
from pdunit.engine.decode.step_model import StepCoefficients
from pdunit.engine.loadgen.summary import Column, machine_info, text_table
from pdunit.engine.model.config import CONFIGS
from pdunit.engine.model.family_csm import DEPTH_KERNELS, set_depth_kernels
from pdunit.engine.model.registry import random_shape, random_shape_names
from pdunit.engine.model.transformer import GEMM_PRECISIONS, ForwardBatch, TTSModel
from pdunit.kernels.decode_settings import parse as parse_decode_kernel
from pdunit.kernels.decode_settings import render
from pdunit.kernels.kv_dtype import kv_storage_dtype, to_kv
from pdunit.kernels.kv_dtype_names import KV_CACHE_DTYPES

COLUMNS = [
    Column("batch", "batch"),
    Column("context", "context"),
    Column("overlap", "overlap"),
    Column("steps", "steps"),
    Column("frames", "frames"),
    Column("graph_steps", "graph steps"),
    Column("eager_steps", "eager steps"),
    Column("frame_graph_steps", "frame graph steps"),
    Column("frame_eager_steps", "frame eager steps"),
    Column("step_ms", "step ms", "{:.3f}"),
    Column("host_ms", "host ms", "{:.3f}"),
    Column("wait_ms", "wait ms", "{:.3f}"),
    Column("gpu_ms", "gpu ms", "{:.3f}"),
    Column("backbone_gpu_ms", "backbone gpu ms", "{:.3f}"),
    Column("frames_gpu_ms", "frames gpu ms", "{:.3f}"),
    Column("event_gpu_ms", "event gpu ms", "{:.3f}"),
    Column("roofline_ms", "roofline ms", "{:.3f}"),
    Column("bound", "bound"),
    Column("backbone_roofline_ms", "backbone roofline ms", "{:.3f}"),
    Column("frames_roofline_ms", "frames roofline ms", "{:.3f}"),
    Column("fraction_of_roofline", "of roofline", "{:.1%}"),
    Column("gpu_fraction_of_roofline", "gpu of roofline", "{:.1%}"),
    Column("gpu_busy", "gpu busy", "{:.1%}"),
    Column("event_busy", "event busy", "{:.1%}"),
    Column("attn_gbps", "attn GB/s", "{:.0f}"),
    Column("skipped", "skipped"),
]

MODES = {"off": (False,), "on": (True,), "both": (False, True)}
# Frames a stream may produce beyond admission + warmup + timed steps: the overlap
# pipeline schedules one step ahead, and the extra keeps the length end out of the
# window (the streams are cancelled after it).
FRAME_MARGIN = 4
TUNE_POINT = (64, 2048)  # batch x context where `--tune` times the kernel's configurations
_GRAPH_STEPS = "pdunit_decode_graph_steps_total"
_HOST = "pdunit_decode_host_seconds"
_WAIT = "pdunit_decode_device_wait_seconds"


@dataclasses.dataclass
class StepConfig:
    model: str = "qwen3-4b-shape"
    batches: list[int] = dataclasses.field(default_factory=lambda: [1, 8, 16, 32, 64, 128, 256])
    contexts: list[int] = dataclasses.field(default_factory=lambda: [1024, 2048, 4096])
    page_size: int = 16
    kv_cache_dtype: str = "auto"
    iters: int = 20
    warmup: int = 3
    seed: int = 0
    copy_gib: float = 4.0
    hbm_gbps: float = 0.0  # > 0: the roofline's bandwidth as given, not measured
    matrix_tflops: float = 0.0  # > 0: the roofline's matrix rate as given, not measured
    matrix_fp8_tflops: float = 0.0  # > 0: its e4m3 rate (fp8 decode GEMMs) as given, not measured
    reserve_gib: float = 14.0  # left free for activations, graph pools, scratch
    compare: list[str] = dataclasses.field(default_factory=lambda: ["64x2048"])
    tune: bool = False
    decode_kernel: str = ""  # the engines' --decode-kernel: settings the rows (and --tune's start) run with
    decode_gemm: str = "bf16"  # the engines' --decode-gemm
    depth_kernels: str = "auto"  # D's and the monolith's --depth-kernels (a depth decoder's passes)
    overlap: str = "both"
    device: str = "cuda"
    temperature: float = 0.0
    top_k: int = 0
    profile: bool = False
    out: str = "bench/results"
    machine_tag: str | None = None
    command: str = ""


# ------------------------------------------------------------------ measurements


CPU_COPY_GIB = 1 / 16  # the bandwidth copy on the CPU (tests): 64 MiB, not --copy-gib


def measure_copy_gbps(gib: float, iters: int = 10, device: str | torch.device = "cuda") -> float:
    """Memory bandwidth of a large copy on `device`, counting bytes read + written (CUDA
    events on a GPU, the host clock on the CPU)."""
    dev = torch.device(device)
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    ms = statistics.median(times_ms(lambda: dst.copy_(src), iters, 3, dev.type == "cuda"))
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def measure_matrix_tflops(dtype: torch.dtype, device: str | torch.device = "cuda", iters: int = 10) -> float:
    """Dense matrix-multiply rate in `dtype` on `device`: a square GEMM (8192 on a GPU,
    256 on the CPU), 2 n^3 FLOPs a call, the median call. e4m3 (`FP8`): the engine's own
    fp8 GEMM (kernels/fp8_gemm.py: rows and output channels scaled, bf16 out)."""
    from pdunit.kernels.fp8_gemm import FP8, Fp8Weight, fp8_gemm, quantize_rows_reference

    dev = torch.device(device)
    n = 8192 if dev.type == "cuda" else 256
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    if dtype == FP8:
        rows, w = quantize_rows_reference(a), Fp8Weight.quantize(b)
        ms = statistics.median(times_ms(lambda: fp8_gemm(rows, w, torch.bfloat16), iters, 3, dev.type == "cuda"))
    else:
        a, b = a.to(dtype), b.to(dtype)
        out = torch.empty(n, n, dtype=dtype, device=dev)
        ms = statistics.median(times_ms(lambda: torch.mm(a, b, out=out), iters, 3, dev.type == "cuda"))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def _fail(message: str, prog: str = "pdunit bench step") -> SystemExit:
    return SystemExit(f"{prog}: {message}")


def load_bench_model(spec: str, seed: int, device: str | torch.device = "cuda", dtype: str | None = None,
                     prog: str = "pdunit bench step") -> TTSModel:
    """`--model`: a shape name (a pdunit config or a family's random shape: `tiny`,
    `csm-tiny`, `csm-1b-shape`, ...) with weights drawn from `seed`, `random:<shape>:<seed>`
    (its own seed), or a checkpoint directory (its weights, engine/model/loader.py).
    Random weights are drawn on `device` at the loader's scales: seconds instead of a
    CPU init of billions of parameters. `dtype` overrides the config's compute/KV dtype;
    errors start with `prog` (the bench's command)."""
    from pdunit.engine.model.loader import _init_std, _random_model, load_model

    dev = torch.device(device)
    name = spec
    if spec.startswith("random:"):
        parts = spec.split(":")
        if len(parts) != 3 or not parts[2].isdigit():
            raise _fail(f"--model {spec!r}: expected random:<shape>:<seed> with a non-negative integer seed", prog)
        name, seed = parts[1], int(parts[2])
    if random_shape(name) is not None or name in CONFIGS:
        m = _random_model(name, str(dev), dtype)
    elif name == spec and Path(spec).is_dir():
        try:
            return load_model(spec, device=str(dev), dtype=dtype)
        except ValueError as exc:
            raise _fail(f"--model: {exc}", prog) from None
    else:
        raise _fail(f"--model {spec!r} is none of a shape ({', '.join([*CONFIGS, *random_shape_names()])}), "
                    "random:<shape>:<seed> or a checkpoint directory", prog)
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            std = _init_std(pname, tuple(p.shape), m.config)
            if std is None:
                p.fill_(1.0)
            else:
                bound = std * math.sqrt(3.0)
                p.uniform_(-bound, bound, generator=g)
    m.requires_grad_(False)
    return m.eval()


def _nbytes(params: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _matrix_elems(params: Sequence[torch.Tensor]) -> int:
    """Weights of the matrices among `params` (norms are vectors: no FLOPs counted)."""
    return sum(p.numel() for p in params if p.dim() >= 2)


@dataclasses.dataclass(frozen=True)
class StepWork:
    """What one decode step of `batch` streams reads from memory and computes, backbone
    and frame generation apart (`step_work`). Activations (hidden states, logits) and
    K/V writes are not counted: a roofline, a floor on the step's time. The FLOPs of
    e4m3 GEMMs (`*_fp8_flops`, part of the totals) are timed at the e4m3 matrix rate,
    the rest at the model dtype's."""

    backbone_weight_bytes: int  # every backbone matrix and norm, read once (fp8 GEMMs: e4m3 + scales)
    embed_bytes: int  # the batch's embedding rows (of the whole table only those are read)
    kv_bytes: float  # the backbone's K/V of every stream at the mean context
    backbone_flops: float  # 2 x rows x matrix weights + attention's 4 x heads x head_dim x context
    frame_weight_bytes: int = 0  # the head and the depth heads once, the depth decoder (K-1) times
    frame_other_bytes: int = 0  # the depth decoder's embedding rows and its K/V within the frame
    frames_flops: float = 0.0
    depth_passes: int = 0  # K-1: the depth decoder's dependent passes a frame
    backbone_fp8_flops: float = 0.0  # of backbone_flops: the per-layer GEMMs' under fp8 decode GEMMs
    frames_fp8_flops: float = 0.0  # of frames_flops: the depth layers' GEMMs' under fp8 decode GEMMs

    @property
    def backbone_bytes(self) -> float:
        return self.backbone_weight_bytes + self.embed_bytes + self.kv_bytes

    @property
    def frames_bytes(self) -> int:
        return self.frame_weight_bytes + self.frame_other_bytes

    def roofline_ms(self, gbps: float, tflops: float, part: str = "step", fp8_tflops: float | None = None) -> float:
        """max(bytes / bandwidth, matrix time) of the whole step, or of one `part`
        ("backbone", "frames"); the matrix time is the model dtype's FLOPs at `tflops`
        plus the e4m3 GEMMs' at `fp8_tflops` (needed when there are any)."""
        nbytes = {"step": self.backbone_bytes + self.frames_bytes, "backbone": self.backbone_bytes,
                  "frames": self.frames_bytes}[part]
        return max(nbytes / (gbps * 1e9), self._matrix_s(part, tflops, fp8_tflops)) * 1e3

    def bound(self, gbps: float, tflops: float, fp8_tflops: float | None = None) -> str:
        """Which term of the whole step's roofline binds: "hbm" or "matrix"."""
        nbytes = self.backbone_bytes + self.frames_bytes
        return "hbm" if nbytes / (gbps * 1e9) >= self._matrix_s("step", tflops, fp8_tflops) else "matrix"

    def _matrix_s(self, part: str, tflops: float, fp8_tflops: float | None) -> float:
        flops = {"step": self.backbone_flops + self.frames_flops, "backbone": self.backbone_flops,
                 "frames": self.frames_flops}[part]
        fp8 = {"step": self.backbone_fp8_flops + self.frames_fp8_flops, "backbone": self.backbone_fp8_flops,
               "frames": self.frames_fp8_flops}[part]
        if not fp8:
            return flops / (tflops * 1e12)
        if not fp8_tflops:
            raise ValueError("e4m3 GEMM FLOPs need the e4m3 matrix rate (fp8_tflops): the model dtype's "
                             "would make the roofline too slow and the step look nearer to it")
        return (flops - fp8) / (tflops * 1e12) + fp8 / (fp8_tflops * 1e12)


def _gemm_elems(named: Any) -> int:
    """Weights of the per-layer GEMMs (q, k, v, o, gate, up, down) among (name, parameter)
    pairs of a layer stack: what fp8 decode GEMMs run in e4m3."""
    return sum(p.numel() for n, p in named if n.startswith("layers.") and n.endswith("_proj.weight"))


def step_work(m: TTSModel, batch: int, mean_context: float, kv_token: int) -> StepWork:
    """`StepWork` of one decode step from the model's own parameters: the backbone's
    weights once (the head too where it gives every column), its embedding rows and K/V;
    with a frame generator (csm's depth decoder) the head once (codebook 0), then K-1
    dependent passes of the depth decoder, each reading its projection, layers and norm
    (K positions in all: the first pass takes the backbone state and codebook 0), the
    codebook heads once (pass j reads head j), K embedding rows a stream and the frame's
    own K/V (pass j reads j + 1 positions). With fp8 decode GEMMs the per-layer GEMMs of
    the backbone and of the depth decoder (which follows decode_gemm) count their e4m3
    bytes and scales, and their FLOPs are the e4m3 ones (`StepWork`)."""
    c = m.config
    fp8 = m.decode_gemm == "fp8"
    fg: Any = m.frame_generator  # csm's DepthDecoder, read by its attributes
    named = dict(m.named_parameters())
    backbone = [p for n, p in named.items()
                if not n.startswith("frame_generator.") and n != "embed.weight" and not (fg and n == "head.weight")]
    w_bytes = _nbytes(backbone)
    if fp8:
        w_bytes += m.gemm_weight_bytes(True) - m.gemm_weight_bytes(False)
    work = StepWork(
        backbone_weight_bytes=w_bytes,
        embed_bytes=batch * c.n_codebooks * c.hidden * m.embed.weight.element_size(),
        kv_bytes=batch * mean_context * kv_token,
        backbone_flops=2.0 * batch * _matrix_elems(backbone)
        + 4.0 * batch * mean_context * c.n_heads * c.head_dim * c.n_layers,
        backbone_fp8_flops=2.0 * batch * _gemm_elems(named.items()) if fp8 else 0.0,
    )
    if fg is None:
        return work
    layers = getattr(fg, "layers", None)
    if not all(hasattr(fg, a) for a in ("n_codebooks", "embed", "heads")) or layers is None:
        raise _fail(f"no byte or FLOP count for frame generator {type(fg).__name__} (step_work knows csm's)")
    k = int(fg.n_codebooks)
    passes = k - 1
    depth = [p for n, p in fg.named_parameters() if not n.startswith(("embed.", "heads"))]
    depth_bytes = _nbytes(depth)
    if fp8:  # the depth layers' GEMMs in e4m3 (DepthDecoder.quantise_gemms)
        depth_bytes += fg.gemm_weight_bytes(True) - fg.gemm_weight_bytes(False)
    heads = [m.head.weight, fg.heads]
    attn = layers[0].attn
    n_layers, elt = len(layers), fg.embed.weight.element_size()
    positions_read = passes * (k + 2) // 2  # sum over passes j = 1..K-1 of j + 1
    pairs = positions_read + 1  # pass 1's two positions attend 1 and 2
    return dataclasses.replace(
        work,
        frame_weight_bytes=_nbytes(heads) + passes * depth_bytes,
        frame_other_bytes=batch * k * fg.embed.weight.shape[1] * elt
        + batch * n_layers * 2 * attn.n_kv_heads * attn.head_dim * elt * positions_read,
        frames_flops=2.0 * batch * (_matrix_elems(heads) + k * _matrix_elems(depth))
        + 4.0 * batch * n_layers * attn.n_heads * attn.head_dim * pairs,
        frames_fp8_flops=2.0 * batch * k * _gemm_elems(fg.named_parameters()) if fp8 else 0.0,
        depth_passes=passes,
    )


def random_kv_storage(m: TTSModel, n_slots: int, device: torch.device, kv_cache_dtype: str) -> torch.Tensor:
    """A KV pool of `n_slots` slots as the engines allocate it, filled with random K/V
    (never zeros: zeros run faster than data)."""
    storage = m.new_kv_storage(n_slots, device=device, kv_cache_dtype=kv_cache_dtype)
    kv_dtype = kv_storage_dtype(kv_cache_dtype, m.dtype)
    for layer in storage:
        layer.copy_(to_kv(torch.randn(layer.shape, dtype=m.dtype, device=device), kv_dtype))
    return storage


def paged_contexts(
    batch: int, context: int, page_size: int, n_slots: int, rng: np.random.Generator
) -> list[np.ndarray]:
    pages_each = math.ceil(context / page_size)
    pages = rng.permutation(n_slots // page_size)[: batch * pages_each].reshape(batch, pages_each)
    slots = (pages[:, :, None] * page_size + np.arange(page_size)).reshape(batch, -1)[:, :context]
    return [s.astype(np.int64) for s in slots]


def fragment_pool(pool: Any, rng: np.random.Generator) -> None:
    """Churn a fresh PagePool through its public transitions: every page owned by a
    one-page request, then freed in a random order. The FIFO free list then hands out
    pages in that order, as after real traffic (ids of the churn start at 2**40, far
    from the benchmark's stream ids)."""
    base = 1 << 40
    n = pool.free_pages
    for i in range(n):
        pool.reserve(base + i, 0, pool.page_size)
        pool.mark_filled(base + i)
        pool.start_decoding(base + i)
    for i in rng.permutation(n):
        pool.finish(base + int(i))


def _tune_decode(m: TTSModel, kv: torch.Tensor, rng: np.random.Generator, cfg: StepConfig) -> list[dict[str, Any]]:
    """Time the split kernel's launch configurations at 64 x 2k on one layer; apply the
    fastest to the module (it is what the graphs then capture)."""
    from pdunit.kernels import paged_attention as pa

    c = m.config
    b, ctx = TUNE_POINT
    table, lengths = pa.build_slot_table(paged_contexts(b, ctx, cfg.page_size, kv.shape[2], rng))
    table, lengths = table.cuda(), lengths.cuda()
    q = torch.randn(b, c.n_heads, c.head_dim, device="cuda").to(m.dtype)
    kv_bytes = b * ctx * 2 * c.n_kv_heads * c.head_dim * kv.element_size()
    results = []
    best = None
    for cand in pa.DECODE_CANDIDATES:
        pa.DECODE_CONFIG.update(cand)
        splits = pa.choose_splits(b, c.n_kv_heads, m.sm_count(), ctx)
        row: dict[str, Any] = {**cand, "splits": splits}
        try:
            ms = kernel_ms(functools.partial(pa.paged_decode_attention, q, kv[0], table, lengths, splits))
            row.update(ms=ms, gbps=kv_bytes / (ms * 1e-3) / 1e9)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is a data point
            row["error"] = repr(exc)[:300]
        results.append(row)
        print("tune", row, flush=True)
        if "ms" in row and (best is None or row["ms"] < best["ms"]):
            best = row
    assert best is not None, "no decode kernel configuration ran"
    pa.DECODE_CONFIG.update({k: best[k] for k in pa.DECODE_CONFIG})
    print(f"tune: fastest {best['ms']:.4f} ms; engines take it as --decode-kernel={render(pa.DECODE_CONFIG)!r}",
          flush=True)
    return results


def _engine_counters() -> dict[str, float]:
    """The engine's own counters the rows are read from: StepForward's path counter and
    the overlap scheduler's host/wait histograms. Read with `collect()` on those metrics
    alone (tens of microseconds): a registry-wide scan between two iterations would
    leave the device idle at the start of the timed window."""
    from pdunit.engine.decode.overlap import HOST_SECONDS, WAIT_SECONDS
    from pdunit.engine.decode.step_forward import GRAPH_STEPS

    out = {"graph": 0.0, "eager": 0.0}
    for metric in GRAPH_STEPS.collect():
        for sample in metric.samples:
            if sample.name == _GRAPH_STEPS:
                out[sample.labels["path"]] = sample.value
    for hist, name in ((HOST_SECONDS, _HOST), (WAIT_SECONDS, _WAIT)):
        for metric in hist.collect():
            for sample in metric.samples:
                if sample.name in (name + "_sum", name + "_count"):
                    out[sample.name] = sample.value
    return out


class EngineUnderTest:
    """D's decode path over one pool: the batcher, the step forward (graphs captured
    here, once, against `storage`), and a fresh overlap scheduler per measurement."""

    def __init__(self, model: TTSModel, storage: torch.Tensor, page_size: int, max_batch: int,
                 rng: np.random.Generator) -> None:
        from pdunit.engine.decode.batcher import DecodeBatcher
        from pdunit.engine.decode.step_forward import StepForward
        from pdunit.engine.kv.pool import PagePool

        self.model = model
        self.storage = storage
        self.pool = PagePool(storage.shape[2] // page_size, page_size)
        fragment_pool(self.pool, rng)
        self.batcher = DecodeBatcher(model, self.pool, storage, max_batch)
        t0 = time.perf_counter()
        self.forward = StepForward(model, storage, use_graphs=True, max_batch=max_batch)
        self.capture_s = time.perf_counter() - t0
        self._next_id = 1
        self._message = 0

    @property
    def cuda(self) -> bool:
        return self.model.device.type == "cuda"

    def admit(self, batch: int, context: int, frames: int, temperature: float, top_k: int,
              rng: np.random.Generator) -> list[int]:
        """`batch` streams as D admits a committed transfer: pages reserved for prompt +
        max frames, marked filled, decoding; the prompt's K/V is whatever the storage
        holds (random values)."""
        from pdunit.engine.decode.batcher import Stream
        from pdunit.engine.model.sampling import SamplingParams

        c = self.model.config
        ids = []
        for _ in range(batch):
            rid, self._next_id = self._next_id, self._next_id + 1
            self.pool.reserve(rid, context - 1, context - 1 + frames)
            self.pool.mark_filled(rid)
            self.pool.start_decoding(rid)
            params = SamplingParams(temperature=temperature, top_k=top_k, seed=rid,
                                    max_frames=frames, min_frames=frames)
            first = rng.integers(0, min(c.vocab_sizes), c.n_codebooks).astype(np.int32)
            self.batcher.admit(Stream(rid, context - 1, params, first))
            ids.append(rid)
        return ids

    def plain_iteration(self) -> tuple[Any, float | None, bool]:
        """One iteration of `DecodeEngine._step_once` without overlap; returns (its
        StepOutput or None, when the step was queued (perf_counter) or None, whether a
        step ran)."""
        from pdunit.engine.step_loop import step_message

        b = self.batcher
        b.take_cancelled()
        new = b.take_incoming()
        streams, entries = b.decode_entries()
        if not streams and not new:
            return None, None, False
        logits = self.forward(entries) if entries else None
        queued = time.perf_counter()
        out = b.apply(streams, logits, new)
        self._message += 1
        step_message(self._message, out)
        return out, queued, bool(entries)

    def overlap_iteration(self, sched: Any) -> tuple[Any, Any]:
        """One iteration of `DecodeEngine._overlap_step_once`; returns (its StepOutput or
        None, the step it queued or None)."""
        from pdunit.engine.step_loop import step_message

        _, out = sched.step_once()
        if out is not None:
            self._message += 1
            step_message(self._message, out)
        # The scheduler keeps the step it just queued (with its started/copied events)
        # as its in-flight step; the bench reads the events from there.
        return out, sched.queued_step

    def drain(self, ids: list[int], sched: Any | None) -> None:
        """Cancel the point's streams and run the loop until they are gone; every page
        must be back in the pool (a leak here is a bug in the engine or the bench)."""
        for rid in ids:
            self.batcher.cancel(rid)
        for _ in range(4):
            if sched is None:
                self.plain_iteration()
            else:
                self.overlap_iteration(sched)
            if not len(self.batcher) and (sched is None or not sched.in_flight):
                break
        if self.pool.free_pages != self.pool.n_pages:
            raise RuntimeError(
                f"{self.pool.n_pages - self.pool.free_pages} pages still owned after cancelling every stream "
                f"(states: {self.pool.counts()})")


PROFILE_COLUMNS = [
    Column("op", "op", "{}"), Column("self_cpu_ms", "self host ms", "{:.3f}"),
    Column("cpu_ms", "host ms incl. children", "{:.3f}"), Column("calls", "calls", "{}"),
]


def _profiler(cuda: bool) -> Any:
    """torch.profiler over the timed iterations (host ops, and kernels on CUDA): where a
    step's host time goes, op by op."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))


def _profile_top(prof: Any, iters: int, n: int = 15) -> list[dict[str, Any]]:
    """The `n` ops with the most self host time, per timed iteration."""
    events = sorted(prof.key_averages(), key=lambda ev: ev.self_cpu_time_total, reverse=True)[:n]
    return [{"op": ev.key, "self_cpu_ms": round(ev.self_cpu_time_total / 1e3 / iters, 4),
             "cpu_ms": round(ev.cpu_time_total / 1e3 / iters, 4), "calls": round(ev.count / iters, 2)}
            for ev in events]


def measure_row(e: EngineUnderTest, batch: int, context: int, overlap: bool, cfg: StepConfig,
                rng: np.random.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    """Admit, warm up, time `cfg.iters` iterations, drain. Returns the row and the
    leftovers the caller needs (the staged graph, the plain loop's last entries)."""
    from pdunit.engine.decode.overlap import OverlapScheduler

    frames_cap = cfg.warmup + cfg.iters + FRAME_MARGIN
    ids = e.admit(batch, context, frames_cap, cfg.temperature, cfg.top_k, rng)
    sched = OverlapScheduler(e.model, e.batcher, e.forward) if overlap else None

    def iterate() -> tuple[Any, Any, float | None]:
        if sched is None:
            out, queued, ran = e.plain_iteration()
            return out, ran, queued
        out, step = e.overlap_iteration(sched)
        return out, step, None

    iterate()  # admission: the first frames go out (and, with overlap, step 0 is queued)
    if len(e.batcher.running) != batch:
        raise RuntimeError(f"{len(e.batcher.running)} of {batch} streams admitted (max_batch too small?)")
    for _ in range(cfg.warmup):
        iterate()
    # No sync here: with overlap a step is in flight, as in every steady-state
    # iteration; the window's `iters` iterations then wait for exactly `iters` steps.
    before = _engine_counters()
    frame_stats_before = _frame_graph_stats(e.model)
    steps, frames, host, walls, launched = 0, 0, [], [], []
    profiler = _profiler(e.cuda) if cfg.profile else contextlib.nullcontext()
    t_start = time.perf_counter()
    with profiler as prof:
        for _ in range(cfg.iters):
            s0 = time.perf_counter()
            out, ran, queued = iterate()
            walls.append(time.perf_counter() - s0)
            if ran:
                steps += 1
                if sched is not None:
                    launched.append(ran)
            if queued is not None:
                host.append(queued - s0)
            if out is not None:
                frames += len(out.request_ids)
    window = time.perf_counter() - t_start
    after = _engine_counters()
    frame_stats_after = _frame_graph_stats(e.model)
    top = _profile_top(prof, max(1, cfg.iters)) if cfg.profile else None
    graph_steps = int(after["graph"] - before["graph"])
    eager_steps = int(after["eager"] - before["eager"])
    row: dict[str, Any] = {
        "batch": batch, "context": context, "overlap": overlap,
        "steps": steps, "frames": frames, "graph_steps": graph_steps, "eager_steps": eager_steps,
        "path": "graph" if graph_steps == steps and steps else "eager" if eager_steps == steps else "mixed",
        "mean_context": context + cfg.warmup + cfg.iters / 2,
        "step_ms": window / max(1, steps) * 1e3,
        "step_p50_ms": statistics.median(walls) * 1e3,
        "step_max_ms": max(walls) * 1e3,
    }
    if e.model.frame_generator is not None:
        # how the frames were made: frame graph replays (engine/model/frame_graphs.py), or
        # eagerly (no runner, as on the CPU: every step's; a batch no bucket covers)
        replays = frame_stats_after["replays"] - frame_stats_before["replays"]
        row["frame_graph_steps"] = replays
        row["frame_eager_steps"] = (frame_stats_after["eager"] - frame_stats_before["eager"]
                                    if e.model.frame_graphs is not None else steps)
    if top is not None:
        row["profile"] = top
    if sched is None:
        row["host_ms"] = statistics.mean(host) * 1e3 if host else None
    else:
        n = after[_HOST + "_count"] - before[_HOST + "_count"]
        w = after[_WAIT + "_count"] - before[_WAIT + "_count"]
        row["host_ms"] = (after[_HOST + "_sum"] - before[_HOST + "_sum"]) / n * 1e3 if n else None
        row["wait_ms"] = (after[_WAIT + "_sum"] - before[_WAIT + "_sum"]) / w * 1e3 if w else None
    extra: dict[str, Any] = {}
    if e.cuda:
        torch.cuda.synchronize()
        if launched:
            spans = [s.started.elapsed_time(s.copied) for s in launched]
            whole = launched[0].started.elapsed_time(launched[-1].copied)
            row["event_gpu_ms"] = statistics.mean(spans)
            row["event_busy"] = sum(spans) / whole if whole > 0 else None
        runner = e.forward.graphs
        size = runner.bucket_for(batch) if runner is not None else None
        if runner is not None and size is not None:
            # the staged inputs are the last timed step's: replaying them back to back
            # rewrites the same K/V rows of streams about to be cancelled
            row["gpu_ms"] = row["backbone_gpu_ms"] = statistics.median(
                event_times_ms(lambda: runner.replay_staged(size), cfg.iters, 1))
            frame_graphs = e.model.frame_graphs
            if frame_graphs is not None and frame_graphs.bucket_for(batch) == size:
                # the frame graph on the last step's staged hidden states and sampling rows,
                # alone, then the whole step: both graphs back to back
                cap = _frame_cap(cfg)

                def whole_step() -> None:
                    runner.replay_staged(size)
                    frame_graphs.replay_staged(size, cap)

                row["frames_gpu_ms"] = statistics.median(
                    event_times_ms(lambda: frame_graphs.replay_staged(size, cap), cfg.iters, 1))
                row["gpu_ms"] = statistics.median(event_times_ms(whole_step, cfg.iters, 1))
            row["gpu_busy"] = row["gpu_ms"] / row["step_ms"]
            extra["runner"] = runner
    if sched is None and e.cuda and f"{batch}x{context}" in cfg.compare:
        _, entries = e.batcher.decode_entries()
        extra["compare_entries"] = entries
    extra["ids"], extra["sched"] = ids, sched
    return row, extra


def _frame_graph_stats(m: TTSModel) -> dict[str, int]:
    return dict(m.frame_graphs.stats) if m.frame_graphs is not None else {"replays": 0, "eager": 0}


def _frame_cap(cfg: StepConfig) -> int | None:
    """The frame graphs' top-k cap the rows' sampling takes (FrameGraphRunner.cap_for):
    every stream samples alike."""
    from pdunit.engine.model.frame_graphs import TOP_K_CAPS

    k = cfg.top_k if cfg.temperature != 0 else 0
    return next(c for c in TOP_K_CAPS if c is None or c >= k)


def run_step(config: StepConfig) -> dict[str, Any]:
    """Measure every point; return the results document (BENCHMARKS.md section 6)."""
    _check_config(config)
    dev = torch.device(config.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("pdunit bench step: needs a CUDA GPU (none visible); "
                         "--device cpu --model tiny runs the engine path on the CPU as a smoke test")
    if config.tune and not cuda:
        raise SystemExit("pdunit bench step: --tune times GPU kernels; drop it with --device cpu")
    rng = np.random.default_rng(config.seed)
    gbps = config.hbm_gbps or measure_copy_gbps(config.copy_gib if cuda else CPU_COPY_GIB, device=dev)
    m = load_bench_model(config.model, config.seed, dev)
    tflops = config.matrix_tflops or measure_matrix_tflops(m.dtype, dev)
    # the e4m3 GEMMs' own rate, where any run (StepWork times their FLOPs at it)
    fp8_tflops = None
    if config.decode_gemm == "fp8":
        from pdunit.kernels.fp8_gemm import FP8

        fp8_tflops = config.matrix_fp8_tflops or measure_matrix_tflops(FP8, dev)
    if cuda:
        torch.cuda.empty_cache()  # the measurements' buffers: back to the device before sizing the pool
    print(f"memory bandwidth: {gbps:.0f} GB/s (read + write{', given' if config.hbm_gbps else ''}); "
          f"matrix rate in {m.dtype}: {tflops:.3g} TFLOP/s{' (given)' if config.matrix_tflops else ''}"
          + (f"; in e4m3: {fp8_tflops:.3g} TFLOP/s{' (given)' if config.matrix_fp8_tflops else ''}"
             if fp8_tflops else ""), flush=True)
    try:
        m.set_decode_gemm(config.decode_gemm)
    except ValueError as exc:
        raise SystemExit(f"pdunit bench step: --decode-gemm: {exc}") from None
    try:  # before any frame graph records the depth decoder's kernels
        depth_kernels = set_depth_kernels(m, config.depth_kernels)
    except ValueError as exc:
        raise SystemExit(f"pdunit bench step: {exc}") from None
    c = m.config
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, m.dtype)
    kv_token = c.kv_bytes_per_token(kv_dtype)
    idle = step_work(m, 0, 0, kv_token)  # the weights alone
    w_bytes = idle.backbone_weight_bytes
    page = config.page_size
    frames_cap = config.warmup + config.iters + FRAME_MARGIN
    too_long = [ctx for ctx in config.contexts if ctx - 1 + frames_cap > c.max_positions]
    if too_long:
        raise SystemExit(
            f"pdunit bench step: --contexts {too_long} plus {frames_cap} frames exceed the model's "
            f"max_positions {c.max_positions}: lower --contexts (or --iters/--warmup)")
    points = [(b, ctx) for ctx in config.contexts for b in config.batches]

    def pages_for(b: int, ctx: int) -> int:
        return b * -(-(ctx - 1 + frames_cap) // page)

    n_pages = max(pages_for(b, ctx) for b, ctx in points)
    if config.tune:  # the tuning layout is 64 x 2k (`_tune_decode`)
        n_pages = max(n_pages, -(-TUNE_POINT[0] * TUNE_POINT[1] // page))
    if cuda:
        free, _ = torch.cuda.mem_get_info()
        budget = free - int(config.reserve_gib * 2**30)
        n_pages = min(n_pages, budget // (kv_token * page))
        if n_pages < 1:
            raise SystemExit(f"pdunit bench step: {free / 2**30:.1f} GiB free leaves no room for a KV pool "
                             f"after --reserve-gib {config.reserve_gib}")
    storage = random_kv_storage(m, n_pages * page, dev, config.kv_cache_dtype)
    print(f"pool: {n_pages} pages of {page} in {kv_dtype}, {n_pages * page * kv_token / 2**30:.2f} GiB; "
          f"weights {w_bytes / 2**30:.2f} GiB a step"
          + (f" + frame generation {idle.frame_weight_bytes / 2**30:.2f} GiB "
             f"({idle.depth_passes} depth passes)" if m.frame_generator is not None else ""), flush=True)
    if cuda:
        from pdunit.kernels import paged_attention as pa

        print(f"decode kernel: {pa.configure_decode(config.decode_kernel)}", flush=True)
    tuning = _tune_decode(m, storage, rng, config) if config.tune else []
    e = EngineUnderTest(m, storage, page, max(config.batches), rng)
    graph_buckets = e.forward.graphs.sizes if e.forward.graphs is not None else None
    print(f"step forward ready in {e.capture_s:.1f}s; graph buckets: {graph_buckets}", flush=True)
    rows: list[dict[str, Any]] = []
    compare: dict[str, Any] = {}
    for b, ctx in points:
        for overlap in MODES[config.overlap]:
            row: dict[str, Any] = {"batch": b, "context": ctx, "overlap": overlap}
            if pages_for(b, ctx) > n_pages:
                row["skipped"] = (f"needs {pages_for(b, ctx) * page * kv_token / 2**30:.0f} GiB of KV; "
                                  f"pool holds {n_pages * page * kv_token / 2**30:.0f}")
                rows.append(row)
                print(row, flush=True)
                continue
            row, extra = measure_row(e, b, ctx, overlap, config, rng)
            row.update(roofline_columns(step_work(m, b, row["mean_context"], kv_token), gbps, tflops, row,
                                        fp8_tflops))
            if "runner" in extra:
                row["attn_gbps"] = _attention_gbps(m, storage, extra["runner"], b)
            if "compare_entries" in extra:
                compare[f"{b}x{ctx}"] = _compare(m, e, extra["compare_entries"])
            e.drain(extra["ids"], extra["sched"])
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            if cuda and row["eager_steps"]:
                print(f"WARNING: {row['eager_steps']} of {row['steps']} steps at {b}x{ctx} "
                      f"overlap={overlap} ran eagerly, not as graph replays", flush=True)
            if cuda and row.get("frame_eager_steps"):
                print(f"WARNING: the frames of {row['frame_eager_steps']} of {row['steps']} steps at {b}x{ctx} "
                      f"overlap={overlap} ran eagerly, not as frame graph replays", flush=True)
    summary = _summary(rows, config)
    summary.update(
        device=str(dev),
        hbm_copy_gbps=gbps,
        hbm_gbps_given=bool(config.hbm_gbps),
        matrix_tflops=tflops,
        matrix_tflops_given=bool(config.matrix_tflops),
        matrix_fp8_tflops=fp8_tflops,  # the e4m3 GEMMs' rate (None: none ran)
        matrix_fp8_tflops_given=bool(config.matrix_fp8_tflops) and fp8_tflops is not None,
        weight_gib=w_bytes / 2**30,
        frame_generator=type(m.frame_generator).__name__ if m.frame_generator is not None else None,
        frame_weight_read_gib=idle.frame_weight_bytes / 2**30,
        depth_passes=idle.depth_passes,
        depth_kernels=depth_kernels,  # what --depth-kernels resolved to
        frame_graph_buckets=m.frame_graphs.sizes if m.frame_graphs is not None else None,
        kv_bytes_per_token=kv_token,
        pool_slots=n_pages * page,
        capture_s=e.capture_s,
        graph_buckets=graph_buckets,
        tuning=tuning,
        compare=compare,
        gpu_used=torch.cuda.get_device_name() if cuda else "none (cpu)",
        visible_gpus=torch.cuda.device_count() if cuda else 0,
    )
    if cuda:
        from pdunit.kernels import paged_attention as pa

        summary["decode_kernel_config"] = dict(pa.DECODE_CONFIG)
        summary["decode_kernel"] = render(pa.DECODE_CONFIG)  # the engines' flag for these settings
    res = report.Results(
        bench="step",
        machine=machine_info(),
        command=config.command,
        config={k: v for k, v in dataclasses.asdict(config).items() if k not in ("command", "out")},
        rows=rows,
        summary=summary,
    )
    return res.document()


def roofline_columns(work: StepWork, gbps: float, tflops: float, row: dict[str, Any],
                     fp8_tflops: float | None = None) -> dict[str, Any]:
    """A measured row's roofline columns: the whole step's and each part's roofline (e4m3
    GEMMs' FLOPs at `fp8_tflops`), the binding term, the bytes and FLOPs behind them, and
    the fractions of step_ms / gpu_ms (and of the parts' device times) they are."""
    roof = work.roofline_ms(gbps, tflops, fp8_tflops=fp8_tflops)
    out: dict[str, Any] = {
        "roofline_ms": roof, "bound": work.bound(gbps, tflops, fp8_tflops),
        "backbone_roofline_ms": work.roofline_ms(gbps, tflops, "backbone", fp8_tflops),
        "read_gb": (work.backbone_bytes + work.frames_bytes) / 1e9, "kv_gb": work.kv_bytes / 1e9,
        "tflop": (work.backbone_flops + work.frames_flops) / 1e12,
        "fp8_tflop": (work.backbone_fp8_flops + work.frames_fp8_flops) / 1e12,
        "fraction_of_roofline": roof / row["step_ms"],
    }
    if work.depth_passes:
        out["frames_roofline_ms"] = work.roofline_ms(gbps, tflops, "frames", fp8_tflops)
        out["frames_read_gb"] = work.frames_bytes / 1e9
        out["frames_tflop"] = work.frames_flops / 1e12
    if row.get("gpu_ms"):
        out["gpu_fraction_of_roofline"] = roof / row["gpu_ms"]
    for part in ("backbone", "frames"):
        if row.get(f"{part}_gpu_ms") and f"{part}_roofline_ms" in out:
            out[f"{part}_gpu_fraction_of_roofline"] = out[f"{part}_roofline_ms"] / row[f"{part}_gpu_ms"]
    return out


def _summary(rows: list[dict[str, Any]], config: StepConfig) -> dict[str, Any]:
    """Per mode: the roofline fractions at >= 64 streams and 2k context (the target is
    >= 80%), GPU busy there (the D target is >= 95% with overlap), eager steps."""
    measured = [r for r in rows if "step_ms" in r]
    out: dict[str, Any] = {"modes": ["overlap" if o else "no_overlap" for o in MODES[config.overlap]]}
    for overlap in MODES[config.overlap]:
        name = "overlap" if overlap else "no_overlap"
        mine = [r for r in measured if r["overlap"] is overlap]
        target = [r for r in mine if r["batch"] >= 64 and r["context"] == 2048]
        key = lambda r: f"{r['batch']}x2048"  # noqa: E731
        out[name] = {
            "steps": sum(r["steps"] for r in mine),
            "graph_steps": sum(r["graph_steps"] for r in mine),
            "eager_steps": sum(r["eager_steps"] for r in mine),
            "fraction_of_roofline_ge64_2k": {key(r): r.get("fraction_of_roofline") for r in target},
            "gpu_fraction_of_roofline_ge64_2k": {key(r): r.get("gpu_fraction_of_roofline") for r in target},
            "gpu_busy_ge64_2k": {key(r): r.get("gpu_busy") for r in target},
            "event_busy_ge64_2k": {key(r): r.get("event_busy") for r in target},
            "target_0_8_met_wall": bool(target) and all((r.get("fraction_of_roofline") or 0) >= 0.8 for r in target),
            "target_0_8_met_gpu": bool(target) and all((r.get("gpu_fraction_of_roofline") or 0) >= 0.8
                                                       for r in target),
        }
        if overlap:
            out[name]["target_busy_0_95_met"] = bool(target) and all((r.get("gpu_busy") or 0) >= 0.95
                                                                      for r in target)
    return out


def step_model(rows: list[dict[str, Any]]) -> StepCoefficients:
    """The engines' `--step-model` seed from this run's rows: the overlap rows' fit when
    there are any (D's default on a GPU), else the others' (bench/plan.py's StepCost)."""
    from pdunit.bench.plan import StepCost

    overlap = any(r.get("overlap") and r.get("step_ms") for r in rows)
    cost = StepCost.fit(rows, overlap)
    return StepCoefficients(cost.base_ms, cost.per_stream_ms, cost.per_token_ms)


def _attention_gbps(m: TTSModel, kv: torch.Tensor, runner: Any, b: int) -> float:
    """One layer's decode attention alone on the runner's staged table (the last step's),
    in K/V bytes read per second."""
    from pdunit.kernels import paged_attention as pa

    c = m.config
    q = torch.randn(b, c.n_heads, c.head_dim, device="cuda").to(m.dtype)
    table, lengths = runner.staged_table(b)
    splits = pa.choose_splits(b, c.n_kv_heads, m.sm_count(), runner.max_context)
    ms = kernel_ms(lambda: pa.paged_decode_attention(q, kv[0], table, lengths, splits))
    layer_bytes = int(lengths.sum()) * 2 * c.n_kv_heads * c.head_dim * kv.element_size()
    return layer_bytes / (ms * 1e-3) / 1e9


def _compare(m: TTSModel, e: EngineUnderTest, entries: list[Any]) -> dict[str, Any]:
    """At one point: the graph step, the eager GPU path and the torch reference path (the
    pre-kernel code) on the same batch; their step times and how far their logits are
    from the graph's (a frame generator's model: the head's, of the hidden states; the
    times are the backbone's forward alone)."""
    from pdunit.engine.batching import make_batch

    def to_logits(out: torch.Tensor) -> torch.Tensor:
        return m.logits(out) if m.frame_generator is not None else out

    batch: ForwardBatch = make_batch(entries)
    graph_logits = to_logits(e.forward(entries))
    out: dict[str, Any] = {}

    def timed(n: int) -> tuple[float, torch.Tensor]:
        times, logits = [], None
        for i in range(n + 1):
            s0 = time.perf_counter()
            with torch.inference_mode():
                logits = to_logits(m.forward(batch, e.storage))
            logits.argmax(-1).cpu()
            if i:  # the first run compiles / warms up
                times.append((time.perf_counter() - s0) * 1e3)
        assert logits is not None
        return statistics.median(times), logits

    eager_ms, eager = timed(5)
    out["eager_step_ms"] = eager_ms
    out["graph_vs_eager_max_abs"] = float((graph_logits - eager).abs().max())
    out["graph_vs_eager_greedy_agree"] = float((graph_logits.argmax(-1) == eager.argmax(-1)).double().mean())
    m.attention_backend = "reference"
    try:
        ref_ms, ref = timed(2)
        out["reference_step_ms"] = ref_ms
        out["graph_vs_reference_rel"] = float((graph_logits - ref).norm() / ref.norm())
        out["graph_vs_reference_greedy_agree"] = float((graph_logits.argmax(-1) == ref.argmax(-1)).double().mean())
    except torch.OutOfMemoryError as exc:
        out["reference_error"] = repr(exc)[:200]
    finally:
        m.attention_backend = "triton"
    print("compare", out, flush=True)
    return out


# ------------------------------------------------------------------ CLI


def _check_config(cfg: StepConfig) -> None:
    problems = []
    if cfg.overlap not in MODES:
        problems.append(f"--overlap must be one of {', '.join(MODES)} (got {cfg.overlap!r})")
    if cfg.iters < 1:
        problems.append(f"--iters must be >= 1 (got {cfg.iters})")
    if cfg.warmup < 0:
        problems.append(f"--warmup must be >= 0 (got {cfg.warmup})")
    if cfg.page_size < 1:
        problems.append(f"--page-size must be >= 1 (got {cfg.page_size})")
    if min(cfg.contexts) < 2:
        problems.append(f"--contexts must be >= 2 tokens (a prompt of >= 1 plus the step's; got {cfg.contexts})")
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        problems.append(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {cfg.kv_cache_dtype!r})")
    if cfg.hbm_gbps < 0 or cfg.matrix_tflops < 0:
        problems.append(f"--hbm-gbps and --matrix-tflops must be >= 0 (0: measure; got {cfg.hbm_gbps}, "
                        f"{cfg.matrix_tflops})")
    if cfg.matrix_fp8_tflops < 0:
        problems.append(f"--matrix-fp8-tflops must be >= 0 (0: measure; got {cfg.matrix_fp8_tflops})")
    if cfg.device not in ("cuda", "cpu") and not cfg.device.startswith("cuda:"):
        problems.append(f"--device must be cuda, cuda:N or cpu (got {cfg.device!r})")
    if problems:
        raise SystemExit("pdunit bench step: " + "; ".join(problems))


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def results_path(bench: str, out: str, machine_tag: str | None, machine: dict[str, Any]) -> Path:
    """`<out>/<bench>-<date>-<tag>.json`; the tag is `--machine-tag`, else the machine's
    slug (`1xh100`)."""
    tag = machine_tag or report.machine_slug(machine).lower()
    return Path(out) / f"{bench}-{dt.date.today().strftime('%Y%m%d')}-{tag}.json"


def _parser() -> argparse.ArgumentParser:
    d = StepConfig()
    p = argparse.ArgumentParser(prog="pdunit bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model,
                   help="a shape name (any family's: tiny, qwen3-4b-shape, csm-tiny, csm-1b-shape, dualar-4b-shape; "
                        "random weights from --seed), random:<shape>:<seed>, or a checkpoint directory")
    p.add_argument("--batches", type=int_list, default=d.batches, help="comma-separated batch sizes")
    p.add_argument("--contexts", type=int_list, default=d.contexts, help="comma-separated context lengths")
    p.add_argument("--page-size", type=int, default=d.page_size,
                   help="slots per page of the pool (D's own --page-size defaults to 1; the step results of "
                        "record use this default, 16)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="the pool's precision, as D's --kv-cache-dtype (the roofline counts its bytes)")
    p.add_argument("--iters", type=int, default=d.iters, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed iterations after admission")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--copy-gib", type=float, default=d.copy_gib, help="size of the bandwidth copy (GPU)")
    p.add_argument("--hbm-gbps", type=float, default=d.hbm_gbps,
                   help="the roofline's memory bandwidth in GB/s instead of the measured copy's (0: measure)")
    p.add_argument("--matrix-tflops", type=float, default=d.matrix_tflops,
                   help="the roofline's matrix rate in TFLOP/s instead of a measured GEMM's (0: measure)")
    p.add_argument("--matrix-fp8-tflops", type=float, default=d.matrix_fp8_tflops,
                   help="with --decode-gemm fp8: the roofline's e4m3 matrix rate in TFLOP/s, at which the e4m3 "
                        "GEMMs' FLOPs are timed, instead of a measured e4m3 GEMM's (0: measure)")
    p.add_argument("--reserve-gib", type=float, default=d.reserve_gib, help="GPU memory kept out of the KV pool")
    p.add_argument("--compare", default=",".join(d.compare),
                   help="points (BxCTX) where eager and the torch reference are timed too (CUDA); '' for none")
    p.add_argument("--tune", action="store_true", help="time decode kernel launch configs first, use the best")
    p.add_argument("--decode-kernel", default=d.decode_kernel,
                   help="decode kernel settings KEY=VALUE,... over the defaults, as the engines' --decode-kernel")
    p.add_argument("--decode-gemm", choices=list(GEMM_PRECISIONS), default=d.decode_gemm,
                   help="GEMM precision of the decode steps, as the engines' --decode-gemm")
    p.add_argument("--depth-kernels", choices=list(DEPTH_KERNELS), default=d.depth_kernels,
                   help="kernels of a depth decoder's passes (csm), as the engines' --depth-kernels")
    p.add_argument("--overlap", choices=list(MODES), default=d.overlap,
                   help="both: each point without and with D's overlap scheduler, side by side (default); "
                        "on / off: one of them")
    p.add_argument("--device", default=d.device, help="cuda (the measurement) or cpu (engine-path smoke test)")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="sampling temperature of every stream (0: greedy)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="top-k of every stream (0: whole vocabulary)")
    p.add_argument("--profile", action="store_true",
                   help="run the timed iterations under torch.profiler; each row gets its top host ops per step")
    p.add_argument("--out", default=d.out, help="folder for step-<date>-<tag>.json/.md")
    p.add_argument("--machine-tag", default=d.machine_tag, help="file-name tag (default: from the GPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    try:  # a bad setting stops here, named, before the device is touched
        parse_decode_kernel(a.decode_kernel)
    except ValueError as exc:
        raise SystemExit(f"pdunit bench step: {exc}") from None
    cfg = StepConfig(
        model=a.model, batches=a.batches, contexts=a.contexts, page_size=a.page_size,
        kv_cache_dtype=a.kv_cache_dtype,
        iters=a.iters, warmup=a.warmup, seed=a.seed, copy_gib=a.copy_gib, reserve_gib=a.reserve_gib,
        hbm_gbps=a.hbm_gbps, matrix_tflops=a.matrix_tflops, matrix_fp8_tflops=a.matrix_fp8_tflops,
        compare=[x for x in a.compare.split(",") if x], tune=a.tune, decode_kernel=a.decode_kernel,
        decode_gemm=a.decode_gemm, depth_kernels=a.depth_kernels,
        overlap=a.overlap,
        device=a.device, temperature=a.temperature, top_k=a.top_k, profile=a.profile, out=a.out,
        machine_tag=a.machine_tag,
        command="pdunit bench step " + " ".join(shlex.quote(x) for x in argv),
    )
    doc = run_step(cfg)
    path = results_path("step", cfg.out, cfg.machine_tag, doc["machine"])
    title = "Decode step vs its roofline (HBM bytes, matrix FLOPs), without and with overlap"
    report.Results.from_document(doc).write(path, COLUMNS, title=title)
    print(text_table(doc["rows"], COLUMNS))
    for row in doc["rows"]:
        if row.get("profile"):
            print(f"\nhost ops per step, batch {row['batch']} x {row['context']}, overlap {row['overlap']}:")
            print(text_table(row["profile"], PROFILE_COLUMNS))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    fit = path.with_suffix(".fit.json")
    try:
        fit.write_text(step_model(doc["rows"]).to_json())
        print(f"wrote {fit} (the engines' --step-model seed)")
    except ValueError as exc:  # too few points for a fit: the results still stand
        print(f"no step model written: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
