"""The prefill computation shared by P and the monolith: prompt rows -> KV + first frame.

Owns the model's start (load, warm-up, prefill graphs; P's first-frame kernels and frame
graphs) and no queue and no transport: callers pass prompts with their storage slots
(cached rows first) and get first frames back. The first frame is sampled with frame
index 0, so it is the same frame in every mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdunit.engine import metrics as m
from pdunit.engine.batching import SeqEntry, make_batch, prefill_entry
from pdunit.engine.model.family_csm import set_depth_kernels
from pdunit.engine.model.frame_graphs import FrameGraphRunner, frame_graphs_supported
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.prefill_graphs import DEFAULT_ROW_BUCKETS, PrefillGraphRunner
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.settings import FirstFrameFields, PrefillModelFields


def start_prefill_model(
    cfg: PrefillModelFields, n_slots: int, max_seqs: int, log: logging.Logger,
    first_frames: FirstFrameFields | None = None,
) -> tuple[TTSModel, torch.Tensor, PrefillGraphRunner | None] | None:
    """P's or the monolith's model, its KV storage of `n_slots` rows, warmed up, and its
    prefill graphs (for batches of up to `max_seqs` prompts) when the config asks for
    them; or None with the reason logged: a bad model spec or dtype, fp8 GEMMs or CUDA
    graphs where the device has none. `first_frames` (P's flags): its first frames'
    depth kernels and frame graphs around the warm-up (`start_first_frames`); None (the
    monolith, whose decode steps set both) leaves them."""
    try:
        model = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
        graphs, fp8_min_rows = cfg.resolved_prefill(model.gpu_path)
        model.set_prefill_gemm(cfg.prefill_gemm, fp8_min_rows)
        log.info("prefill model", extra={"dtype": str(model.dtype).replace("torch.", ""), "gpu_path": model.gpu_path,
                                         "prefill_gemm": cfg.prefill_gemm, "fp8_min_rows": fp8_min_rows,
                                         "prefill_graphs": graphs, "kv_cache_dtype": cfg.kv_cache_dtype})
        storage = model.new_kv_storage(n_slots, device=cfg.device, kv_cache_dtype=cfg.kv_cache_dtype)

        def warm() -> None:
            warm_up(model, storage, cfg.warmup_rows, cfg.max_batch_rows)

        if first_frames is None:
            warm()
        else:  # a forward finishes at most one prompt a row
            start_first_frames(model, first_frames, min(max_seqs, cfg.max_batch_rows), log, warm)
        return model, storage, capture_prefill_graphs(model, storage, graphs, max_seqs, cfg.graph_buckets())
    except ValueError as exc:
        log.error("cannot start the model", extra={"error": str(exc)})
        return None


def frame_graph_buckets(max_prompts: int) -> list[int]:
    """The first frames' batch buckets: the powers of two below `max_prompts`, then
    `max_prompts` (16: 1, 2, 4, 8, 16; 12: 1, 2, 4, 8, 12)."""
    bound = max(1, max_prompts)
    return [1 << i for i in range(bound.bit_length()) if 1 << i < bound] + [bound]


def resolve_frame_graphs(requested: bool | None, model: TTSModel) -> bool:
    """`--frame-graphs` with its default applied (on where the model takes the GPU path
    and its frame generator has a capture-safe form); ValueError naming the flag where
    it was asked for and cannot run."""
    supported = frame_graphs_supported(model)
    if requested is None:
        return model.gpu_path and supported
    if requested and (model.device.type != "cuda" or not supported):
        why = (f"a CUDA device, the model is on {model.device}" if model.device.type != "cuda" else
               "a frame generator with a capture-safe form (csm's depth decoder), the model has none")
        raise ValueError(f"--frame-graphs: the first frames' CUDA graphs need {why}: drop --frame-graphs")
    return requested


@dataclass
class FirstFrameKernels:
    """What P's first frames run on: what --depth-kernels resolved to and the frame
    graphs (None: eager), as `start_first_frames` set them."""

    depth_kernels: str
    frame_graphs: FrameGraphRunner | None


def start_first_frames(model: TTSModel, fields: FirstFrameFields, max_prompts: int, log: logging.Logger,
                       warm: Callable[[], None] | None = None) -> FirstFrameKernels:
    """P's first frames (and `pdunit bench prefill`'s), set in the order they must be:
    `--decode-gemm` (the depth decoder's e4m3 weights, as D's), `--depth-kernels`
    (`set_depth_kernels`), then `warm()` (the warm-up: its first frames compile those
    kernels), then the frame graphs, which record the kernels live at capture:
    buckets `frame_graph_buckets(max_prompts)`, attached as `model.frame_graphs`, which
    `TTSModel.frames` replays (a larger batch runs eagerly). Both are logged. ValueError
    naming the flag, before the warm-up, where one cannot run."""
    graphs = resolve_frame_graphs(fields.frame_graphs, model)
    if fields.decode_gemm != "bf16":
        if model.frame_generator is None:
            raise ValueError(f"decode_gemm {fields.decode_gemm}: the model has no frame generator, so P's first "
                             "frames run no decode GEMMs (leave it bf16)")
        model.set_decode_gemm(fields.decode_gemm)  # quantises the depth layers once, before any capture
    log.info("first-frame gemm", extra={"decode_gemm": fields.decode_gemm})
    depth = set_depth_kernels(model, fields.depth_kernels)
    log.info("depth kernels", extra={"requested": fields.depth_kernels, "kernels": depth})
    if warm is not None:
        warm()
    if not graphs:
        log.info("frame graphs", extra={"requested": fields.frame_graphs, "on": False})
        return FirstFrameKernels(depth, None)
    import time

    def reserved() -> int:
        return torch.cuda.memory_reserved(model.device) if model.device.type == "cuda" else 0

    t0, before = time.perf_counter(), reserved()
    runner = FrameGraphRunner(model, frame_graph_buckets(max_prompts))
    model.frame_graphs = runner
    # what the graphs hold on to (their memory pool, static buffers), as the prefill graphs' log
    log.info("frame graphs", extra={
        "requested": fields.frame_graphs, "on": True, "buckets": runner.sizes, "top_k_caps": list(runner.caps),
        "seconds": round(time.perf_counter() - t0, 2), "reserved_mib": round((reserved() - before) / 2**20)})
    return FirstFrameKernels(depth, runner)


@dataclass
class PrefillChunk:
    prompt: np.ndarray       # int64 [rows, C]
    slots: np.ndarray        # int64 [rows]: storage slot of every row
    start: int               # first row computed now (rows before are in storage)
    end: int                 # one past the last row computed now
    params: SamplingParams

    @property
    def is_last(self) -> bool:
        return self.end == len(self.prompt)


def capture_prefill_graphs(model: TTSModel, storage: torch.Tensor, enabled: bool, max_seqs: int,
                           buckets: Sequence[int] = DEFAULT_ROW_BUCKETS) -> PrefillGraphRunner | None:
    """The CUDA-graph runner of `--prefill-graphs` (engine/model/prefill_graphs.py), built
    after the warm-up; None when off. ValueError where the model cannot take graphs."""
    if not enabled:
        return None
    if not storage.is_cuda:
        raise ValueError(f"prefill_graphs: CUDA graphs need a CUDA device, the engine runs on {storage.device}")
    import time

    t0, reserved = time.perf_counter(), torch.cuda.memory_reserved(storage.device)
    runner = PrefillGraphRunner(model, storage, buckets=buckets, max_seqs=max_seqs)
    # what the graphs hold on to (their memory pool and static buffers): memory the
    # engine's KV storage could otherwise have had
    logging.getLogger("pdunit.prefill").info("prefill graphs captured", extra={
        "row_buckets": runner.sizes, "max_seqs": max_seqs, "seconds": round(time.perf_counter() - t0, 2),
        "reserved_mib": round((torch.cuda.memory_reserved(storage.device) - reserved) / 2**20)})
    return runner


def run_forward(
    model: TTSModel, storage: torch.Tensor, entries: list[SeqEntry], graphs: PrefillGraphRunner | None = None
) -> torch.Tensor:
    """One forward over `entries`; through `graphs` (a replay where a bucket covers the
    batch, else eager) when given."""
    if graphs is not None:
        replays = graphs.stats["replays"]
        logits = graphs.run(make_batch(entries))
        m.P_PREFILL_FORWARDS.labels(path="graph" if graphs.stats["replays"] > replays else "eager").inc()
        return logits
    m.P_PREFILL_FORWARDS.labels(path="eager").inc()
    return _eager_forward(model, storage, entries)


def _eager_forward(model: TTSModel, storage: torch.Tensor, entries: list[SeqEntry]) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward(make_batch(entries), storage)


def run_prefill(
    model: TTSModel, storage: torch.Tensor, chunks: list[PrefillChunk], graphs: PrefillGraphRunner | None = None
) -> list[np.ndarray | None]:
    """Computes the chunks in one forward; returns each prompt's first frame (int32 [C])
    when its last row was computed, else None."""
    logits = run_forward(model, storage, [prefill_entry(c.prompt, c.slots, c.start, c.end) for c in chunks], graphs)
    return first_frames(model, logits, chunks)


def first_frames(model: TTSModel, logits: torch.Tensor, chunks: list[PrefillChunk]) -> list[np.ndarray | None]:
    done = [i for i, c in enumerate(chunks) if c.is_last]
    out: list[np.ndarray | None] = [None] * len(chunks)
    if done:
        frames = model.frames(logits[done], [chunks[i].params for i in done], [0] * len(done))
        for row, i in enumerate(done):
            out[i] = frames[row]
    return out


def random_chunks(model: TTSModel, lengths: list[int], rng: np.random.Generator) -> list[PrefillChunk]:
    """Whole prompts of random ids, one per length, at storage slots 0, 1, ... in turn
    (greedy, one frame): what warm-up and `pdunit bench prefill` run."""
    vocab = min(model.config.vocab_sizes)
    greedy = SamplingParams(max_frames=1)
    chunks, first = [], 0
    for n in lengths:
        prompt = rng.integers(0, vocab - 1, size=(n, model.config.n_codebooks), dtype=np.int64)
        chunks.append(PrefillChunk(prompt, np.arange(first, first + n, dtype=np.int64), 0, n, greedy))
        first += n
    return chunks


def warm_up(model: TTSModel, storage: torch.Tensor, rows: int | None, largest: int) -> float:
    """Runs prefills of random prompts (one of `rows` rows, and a batch of two of
    different lengths) into the first slots of `storage` before the engine serves: the
    first forwards of a process compile Triton kernels, pick GEMM algorithms and grow the
    allocator's pool, which on a GPU stalled the first requests' prefill by up to ~1 s.
    `rows` None: `largest` (the engine's largest forward, `--max-batch-rows`) on CUDA, so
    that the first full-size forward of a clump pays none of that either (a warm-up of
    2048 rows left the chunked monolith's first 8192-row chunks unwarmed; with this and
    16-aligned slot tables its early freeze of bench/results/capacity-20261130-h200x2-
    60s-bf16.md is gone in -60s-fam8.md); none on the CPU. Must run before any request
    owns a slot (it overwrites slots [0, rows)). Returns the seconds it took."""
    import logging
    import time

    if rows is None:
        rows = largest if storage.is_cuda else 0
    rows = min(rows, int(storage.shape[2]))
    if rows < 2:
        return 0.0
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    shapes = [[rows], [rows // 2 + 1, rows - rows // 2 - 1]] if rows >= 4 else [[rows]]
    for lengths in shapes:  # not through run_prefill: the forwards metric counts served forwards only
        chunks = random_chunks(model, lengths, rng)
        logits = _eager_forward(model, storage, [prefill_entry(c.prompt, c.slots, c.start, c.end) for c in chunks])
        first_frames(model, logits, chunks)
    if storage.is_cuda:
        torch.cuda.synchronize(storage.device)
    seconds = time.perf_counter() - t0
    logging.getLogger("pdunit.prefill").info("warmed up", extra={"rows": rows, "seconds": round(seconds, 2)})
    return seconds
