"""The prefill computation shared by P and the monolith: prompt rows -> KV + first frame.

Owns no queue and no transport: callers pass prompts with their storage slots (cached
rows first) and get first frames back. The first frame is sampled with frame index 0,
so it is the same frame in every mode.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdunit.engine import metrics as m
from pdunit.engine.batching import SeqEntry, make_batch, prefill_entry
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.prefill_graphs import DEFAULT_ROW_BUCKETS, PrefillGraphRunner
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.model.transformer import TTSModel
from pdunit.engine.settings import PrefillModelFields


def start_prefill_model(
    cfg: PrefillModelFields, n_slots: int, max_seqs: int, log: logging.Logger
) -> tuple[TTSModel, torch.Tensor, PrefillGraphRunner | None] | None:
    """P's or the monolith's model, its KV storage of `n_slots` rows, warmed up, and its
    prefill graphs (for batches of up to `max_seqs` prompts) when the config asks for
    them; or None with the reason logged: a bad model spec or dtype, fp8 GEMMs or CUDA
    graphs where the device has none."""
    try:
        model = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
        graphs, fp8_min_rows = cfg.resolved_prefill(model.gpu_path)
        model.set_prefill_gemm(cfg.prefill_gemm, fp8_min_rows)
        log.info("prefill model", extra={"dtype": str(model.dtype).replace("torch.", ""), "gpu_path": model.gpu_path,
                                         "prefill_gemm": cfg.prefill_gemm, "fp8_min_rows": fp8_min_rows,
                                         "prefill_graphs": graphs, "kv_cache_dtype": cfg.kv_cache_dtype})
        storage = model.new_kv_storage(n_slots, device=cfg.device, kv_cache_dtype=cfg.kv_cache_dtype)
        warm_up(model, storage, cfg.warmup_rows, cfg.max_batch_rows)
        return model, storage, capture_prefill_graphs(model, storage, graphs, max_seqs, cfg.graph_buckets())
    except ValueError as exc:
        log.error("cannot start the model", extra={"error": str(exc)})
        return None


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
