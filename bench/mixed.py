"""`pdunit bench mixed`: the monolith's mixed step (decode rows beside prompt chunks in one
forward: `--policy chunked` and `budget`), eager against the replay of the captured
bucket pair that holds it (engine/model/mixed_graphs.py, the monolith's `--mixed-graphs`).

Owns one measurement per (streams, context, prompt rows, chunks) point: the step staged as
the monolith stages it, timed as its eager forward, as the replay, and for reference as
the decode-only step and the prefill-only forward of the same rows; the replay's output
against the eager one's. Never re-implements a forward (it calls the engine's), and never
reports a replay figure the runner did not replay: a refused runner (off the GPU path) or
a point outside the pairs gets its reason instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pdunit.bench import report
from pdunit.bench.cuda_timing import times_ms
from pdunit.bench.step import int_list, load_bench_model, random_kv_storage, results_path
from pdunit.engine.batching import SeqEntry, make_batch, prefill_entry
from pdunit.engine.loadgen.summary import Column, machine_info, text_table
from pdunit.engine.model.mixed_graphs import MixedGraphRunner, mixed_graphs_refusal
from pdunit.engine.model.transformer import GEMM_PRECISIONS, TTSModel
from pdunit.engine.prefill.runner import run_forward
from pdunit.engine.settings import PrefillModelFields
from pdunit.kernels.kv_dtype import kv_storage_dtype
from pdunit.kernels.kv_dtype_names import KV_CACHE_DTYPES

PROG = "pdunit bench mixed"
DTYPES = ("bfloat16", "float16", "float32", "float64")
# A replay against the eager forward, ||replay - eager|| / ||eager|| over the output rows:
# the bound tests/kernels/test_mixed_graphs.py's GPU test holds the captured pairs to (the
# same kernels; the decode splits are fixed per bucket, so the sums' order differs).
TOLERANCE = 3e-2

COLUMNS = [
    Column("batch", "streams"),
    Column("context", "context"),
    Column("prompt_rows", "prompt rows"),
    Column("chunks", "chunks"),
    Column("pair", "pair"),
    Column("eager_ms", "eager ms", "{:.3f}"),
    Column("replay_ms", "replay ms", "{:.3f}"),
    Column("speedup", "replay speedup", "{:.2f}x"),
    Column("decode_ms", "decode-only ms", "{:.3f}"),
    Column("decode_path", "decode path"),
    Column("prefill_ms", "prefill-only ms", "{:.3f}"),
    Column("prefill_path", "prefill path"),
    Column("max_abs_diff", "max abs diff", "{:.3g}"),
    Column("rel_diff", "rel diff", "{:.2e}"),
    Column("equals_staged", "= staged"),
    Column("note", "note"),
]


@dataclasses.dataclass
class MixedConfig:
    model: str = "qwen3-4b-shape"
    dtype: str | None = None  # None: the config's
    batches: list[int] = dataclasses.field(default_factory=lambda: [32, 64, 128, 256])
    contexts: list[int] = dataclasses.field(default_factory=lambda: [1024])
    prompt_rows: list[int] = dataclasses.field(default_factory=lambda: [256, 512, 1024, 2048])
    chunks: list[int] = dataclasses.field(default_factory=lambda: [1])
    mixed_graph_streams: list[int] = dataclasses.field(default_factory=list)  # empty: the monolith's default
    mixed_graph_rows: list[int] = dataclasses.field(default_factory=list)  # empty: the monolith's default
    mixed_graph_chunks: int = 4  # the monolith's default
    page_size: int = 16
    kv_cache_dtype: str = "auto"
    prefill_gemm: str = "bf16"
    iters: int = 20
    warmup: int = 3
    seed: int = 0
    reserve_gib: float = 14.0  # left free for activations and graph pools
    device: str = "cuda"
    out: str = "bench/results"
    machine_tag: str | None = None
    command: str = ""


@dataclasses.dataclass
class MixedStep:
    """One staged mixed step: `batch` decode rows (their tokens, positions, write slots
    and contexts, as the monolith hands them to the runner) and the prompt chunks."""

    decode: list[SeqEntry]
    chunks: list[SeqEntry]

    def shape(self) -> tuple[int, list[int], int]:
        """`MixedGraphRunner.bucket_for`'s arguments: decode rows, chunk rows, the longest context."""
        rows = [len(e.tokens) for e in self.chunks]
        return len(self.decode), rows, max(len(e.context_slots) for e in self.decode + self.chunks)

    def runner_args(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], list[SeqEntry]]:
        """`MixedGraphRunner.run`'s arguments, as the monolith's plain loop passes them."""
        d = self.decode
        return (np.concatenate([e.tokens for e in d]), np.concatenate([e.positions for e in d]),
                np.concatenate([e.write_slots for e in d]), [e.context_slots for e in d], self.chunks)


def chunk_rows(rows: int, chunks: int) -> list[int]:
    """`rows` prompt rows split into `chunks` chunks, as even as rows allow."""
    return [rows // chunks + (1 if i < rows % chunks else 0) for i in range(chunks)]


def pages_for(batch: int, context: int, rows: list[int], page: int) -> int:
    return batch * -(-context // page) + sum(-(-q // page) for q in rows)


def stage_step(m: TTSModel, batch: int, context: int, rows: list[int], page: int, n_slots: int,
               rng: np.random.Generator) -> MixedStep:
    """`batch` decode rows of `context` tokens each (the new one last, its K/V written by
    the step) and chunks of `rows` rows (a prompt's first rows each), every sequence on
    whole pages drawn at random from the pool (fragmented, as after traffic); random
    token ids."""
    c = m.config
    vocab = min(c.vocab_sizes)
    lengths = [context] * batch + rows
    pages = rng.permutation(n_slots // page)
    slots, used = [], 0
    for n in lengths:
        k = -(-n // page)
        mine = pages[used : used + k]
        used += k
        slots.append((mine[:, None] * page + np.arange(page)).reshape(-1)[:n].astype(np.int64))
    tokens = rng.integers(0, vocab, (batch, c.n_codebooks)).astype(np.int64)
    decode = [SeqEntry(tokens[i : i + 1], np.array([context - 1], dtype=np.int64), s[-1:], s)
              for i, s in enumerate(slots[:batch])]
    chunks = [prefill_entry(rng.integers(0, vocab, (q, c.n_codebooks)).astype(np.int64), s, 0, q)
              for q, s in zip(rows, slots[batch:], strict=True)]
    return MixedStep(decode, chunks)


def no_pair_reason(runner: MixedGraphRunner, batch: int, rows: list[int], longest: int) -> str:
    """Why no bucket pair of `runner` holds a step (its `bucket_for` returned None)."""
    if batch > runner.streams[-1]:
        return f"no pair: {batch} streams > the largest stream bucket {runner.streams[-1]} (--mixed-graph-streams)"
    if len(rows) > runner.max_seqs:
        return f"no pair: {len(rows)} chunks > {runner.max_seqs} (--mixed-graph-chunks)"
    if sum(rows) > runner.rows[-1]:
        return f"no pair: {sum(rows)} prompt rows > the largest row bucket {runner.rows[-1]} (--mixed-graph-rows)"
    if longest > runner.max_context:
        return f"no pair: a context of {longest} > the pairs' {runner.max_context}"
    return "no pair of the step's GEMM precision"


def output_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, ||got - want|| / ||want||) over the entries finite in both
    (logits pad narrower vocabularies with -inf); inf where they differ in finiteness."""
    a, b = got.double(), want.double()
    finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(finite_a, finite_b):
        return float("inf"), float("inf")
    diff = torch.where(finite_b, a - b, 0.0)
    norm = float(torch.where(finite_b, b, 0.0).norm())
    return float(diff.abs().max()), float(diff.norm()) / norm if norm else float(diff.norm())


def _median_ms(fn: Callable[[], Any], cfg: MixedConfig, cuda: bool) -> float:
    return statistics.median(times_ms(fn, cfg.iters, cfg.warmup, cuda))


def _timed_path(fn: Callable[[], Any], stats: dict[str, int] | None, cfg: MixedConfig,
                cuda: bool) -> tuple[float, str]:
    """`fn`'s median ms and how it ran: "graph" when every call replayed (its runner's
    `stats` counted them), else "eager"."""
    before = dict(stats) if stats is not None else None
    ms = _median_ms(fn, cfg, cuda)
    replayed = stats is not None and before is not None and stats["replays"] - before["replays"] == (
        cfg.iters + cfg.warmup)
    return ms, "graph" if replayed else "eager"


@dataclasses.dataclass
class Graphs:
    """The runners the monolith would use for these points (None: not captured, eager):
    the mixed pairs the grid needs (`staged`: the same buckets uncaptured, which picks
    the pairs and runs the padded step eagerly), D's decode graphs and P's prefill graphs
    of the grid's sizes, with their capture costs."""

    staged: MixedGraphRunner | None = None
    mixed: MixedGraphRunner | None = None
    decode: Any = None  # DecodeGraphRunner
    prefill: Any = None  # PrefillGraphRunner
    costs: dict[str, Any] = dataclasses.field(default_factory=dict)


def _captured(what: str, costs: dict[str, Any], build: Callable[[], Any], dev: torch.device) -> Any:
    """`build()` with its wall seconds and the device memory it left reserved (its graph
    pool and static buffers) in `costs[what]`."""
    torch.cuda.synchronize(dev)
    t0, reserved = time.perf_counter(), torch.cuda.memory_reserved(dev)
    runner = build()
    torch.cuda.synchronize(dev)
    costs[what] = {"capture_s": round(time.perf_counter() - t0, 3),
                   "reserved_mib": round((torch.cuda.memory_reserved(dev) - reserved) / 2**20, 1)}
    print(f"{what} graphs captured: {costs[what]}", flush=True)
    return runner


def capture_graphs(m: TTSModel, storage: torch.Tensor, cfg: MixedConfig,
                   steps: dict[tuple[int, int, int, int], MixedStep]) -> Graphs:
    """In the monolith's order (prefill graphs, decode graphs, then the mixed pairs) with
    its default buckets, keeping the buckets the points replay: the pairs of the mixed
    buckets (`--mixed-graph-*`, else the monolith's defaults) that `bucket_for` picks."""
    from pdunit.engine.model.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphRunner
    from pdunit.engine.model.prefill_graphs import PrefillGraphRunner
    from pdunit.engine.monolith.main import PREFILL_GRAPH_SEQS, MonolithConfig, mixed_graph_buckets

    g = Graphs()
    if mixed_graphs_refusal(m) is not None:
        return g
    mono = MonolithConfig(mixed_graph_streams=cfg.mixed_graph_streams, mixed_graph_rows=cfg.mixed_graph_rows)
    dev = storage.device
    # the largest step once, eagerly: kernels compile and the allocator grows here, as in the
    # monolith's warm-up, not in the captures timed below
    largest = max(steps.values(), key=lambda s: len(s.decode) + sum(len(e.tokens) for e in s.chunks))
    run_forward(m, storage, largest.decode + largest.chunks)

    def holding(buckets: list[int], sizes: list[int]) -> list[int]:
        """The smallest bucket >= each size (none for a size past the largest)."""
        return sorted({min(x for x in buckets if x >= n) for n in sizes if n <= max(buckets)})

    prefill = holding(PrefillModelFields().graph_buckets(), cfg.prompt_rows)
    if prefill:
        g.prefill = _captured("prefill", g.costs, lambda: PrefillGraphRunner(
            m, storage, buckets=prefill, max_seqs=PREFILL_GRAPH_SEQS), dev)
    d_buckets = sorted({b for b in DEFAULT_BUCKETS if b < mono.max_batch} | {mono.max_batch})
    decode = holding(d_buckets, cfg.batches)
    if decode:
        g.decode = _captured("decode", g.costs, lambda: DecodeGraphRunner(m, storage, buckets=decode), dev)
    streams, rows = mixed_graph_buckets(mono)
    g.staged = MixedGraphRunner(m, storage, streams, rows, cfg.mixed_graph_chunks, capture=False)
    pairs = {pair for pair in (g.staged.bucket_for(*s.shape()) for s in steps.values()) if pair is not None}
    g.costs["mixed_buckets"] = {"stream_buckets": streams, "row_buckets": rows, "max_chunks": cfg.mixed_graph_chunks}
    if pairs:
        g.mixed = _captured("mixed", g.costs, lambda: MixedGraphRunner(
            m, storage, sorted({b for b, _ in pairs}), sorted({p for _, p in pairs}), cfg.mixed_graph_chunks), dev)
        g.costs["mixed"]["pairs"] = [f"{b}x{p}" for b, p in g.mixed.pairs]
    return g


def measure_point(m: TTSModel, storage: torch.Tensor, step: MixedStep, g: Graphs, cfg: MixedConfig,
                  cuda: bool) -> dict[str, Any]:
    """One point's times and checks (the row's columns but its coordinates)."""
    entries = step.decode + step.chunks
    row: dict[str, Any] = {"eager_ms": _median_ms(lambda: run_forward(m, storage, entries), cfg, cuda)}
    if g.decode is not None:  # as the monolith's decode-only step (StepForward) calls its graphs
        row["decode_ms"], row["decode_path"] = _timed_path(lambda: g.decode.run(make_batch(step.decode)),
                                                           g.decode.stats, cfg, cuda)
    else:
        row["decode_ms"], row["decode_path"] = _timed_path(lambda: run_forward(m, storage, step.decode), None, cfg,
                                                           cuda)
    row["prefill_ms"], row["prefill_path"] = _timed_path(
        lambda: run_forward(m, storage, step.chunks, g.prefill), g.prefill.stats if g.prefill else None, cfg, cuda)
    if g.staged is None:
        row["note"] = "no replay: refused off the GPU path (summary: replay_refused)"
        return row
    runner, args = g.mixed, step.runner_args()
    pair = g.staged.bucket_for(*step.shape())  # the monolith's buckets' pick; captured when not None
    if runner is None or pair is None:
        row["note"] = no_pair_reason(g.staged, *step.shape())
        return row
    if runner.bucket_for(*step.shape()) != pair:
        raise RuntimeError(f"the captured pairs {runner.pairs} replay this step elsewhere than {pair}")
    replays = runner.stats["replays"]
    row["pair"] = f"{pair[0]}x{pair[1]}"
    row["replay_ms"] = _median_ms(lambda: runner.run(*args), cfg, cuda)
    if runner.stats["replays"] - replays != cfg.iters + cfg.warmup:
        raise RuntimeError(f"the runner replayed {runner.stats['replays'] - replays} of "
                           f"{cfg.iters + cfg.warmup} calls of pair {pair}")
    row["speedup"] = row["eager_ms"] / row["replay_ms"]
    got, staged = runner.run(*args), g.staged.run(*args)
    want = run_forward(m, storage, entries)
    assert got is not None and staged is not None
    row["max_abs_diff"], row["rel_diff"] = output_diff(got, want)
    row["matches_eager"] = row["rel_diff"] < TOLERANCE
    row["equals_staged"] = bool(torch.equal(got, staged))
    return row


def run_mixed(cfg: MixedConfig) -> dict[str, Any]:
    """Measure every point; return the results document (bench/report.py's Results)."""
    _check_config(cfg)
    dev = torch.device(cfg.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"{PROG}: needs a CUDA GPU (none visible); --device cpu --model tiny runs the "
                         "eager rows on the CPU as a smoke test")
    m = load_bench_model(cfg.model, cfg.seed, dev, cfg.dtype, PROG)
    c = m.config
    for flag, values in (("--contexts", cfg.contexts), ("--prompt-rows", cfg.prompt_rows)):
        if max(values) > c.max_positions:
            raise SystemExit(f"{PROG}: {flag} {[v for v in values if v > c.max_positions]} exceed the model's "
                             f"max_positions {c.max_positions}")
    _, min_rows = PrefillModelFields(prefill_gemm=cfg.prefill_gemm).resolved_prefill(m.gpu_path)
    try:
        m.set_prefill_gemm(cfg.prefill_gemm, min_rows)
    except ValueError as exc:
        raise SystemExit(f"{PROG}: --prefill-gemm: {exc}") from None
    page = cfg.page_size
    points = [(b, ctx, p, k) for ctx in cfg.contexts for b in cfg.batches for p in cfg.prompt_rows for k in cfg.chunks]
    need = {pt: pages_for(pt[0], pt[1], chunk_rows(pt[2], pt[3]), page) for pt in points}
    n_pages = max(need.values())
    kv_token = c.kv_bytes_per_token(kv_storage_dtype(cfg.kv_cache_dtype, m.dtype))
    if cuda:
        free, _ = torch.cuda.mem_get_info(dev)
        n_pages = min(n_pages, (free - int(cfg.reserve_gib * 2**30)) // (kv_token * page))
        if n_pages < 1:
            raise SystemExit(f"{PROG}: {free / 2**30:.1f} GiB free leaves no room for a KV pool after "
                             f"--reserve-gib {cfg.reserve_gib}")
    storage = random_kv_storage(m, n_pages * page, dev, cfg.kv_cache_dtype)
    print(f"{PROG}: {m.config.name} in {m.dtype} on {dev}, prefill GEMMs {cfg.prefill_gemm} (fp8 from "
          f"{min_rows} rows), pool {n_pages} pages of {page} in {storage.dtype} "
          f"({n_pages * page * kv_token / 2**30:.2f} GiB)", flush=True)
    rng = np.random.default_rng(cfg.seed)
    steps = {pt: stage_step(m, pt[0], pt[1], chunk_rows(pt[2], pt[3]), page, n_pages * page, rng)
             for pt in points if need[pt] <= n_pages}
    g = capture_graphs(m, storage, cfg, steps) if steps else Graphs()
    rows: list[dict[str, Any]] = []
    for pt in points:
        b, ctx, p, k = pt
        row: dict[str, Any] = {"batch": b, "context": ctx, "prompt_rows": p, "chunks": k}
        if pt not in steps:
            row["note"] = (f"skipped: needs {need[pt] * page * kv_token / 2**30:.1f} GiB of KV; the pool holds "
                           f"{n_pages * page * kv_token / 2**30:.1f}")
        else:
            row.update(measure_point(m, storage, steps[pt], g, cfg, cuda))
        rows.append(row)
        print({key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
    return report.Results(
        bench="mixed", machine=machine_info(), command=cfg.command,
        config={key: v for key, v in dataclasses.asdict(cfg).items() if key not in ("command", "out")},
        rows=rows, summary=_summary(m, cfg, rows, g, n_pages * page, kv_token, min_rows, cuda),
    ).document()


def _summary(m: TTSModel, cfg: MixedConfig, rows: list[dict[str, Any]], g: Graphs, pool_slots: int,
             kv_token: int, min_rows: int, cuda: bool) -> dict[str, Any]:
    replayed = [r for r in rows if "replay_ms" in r]
    speedups = [r["speedup"] for r in replayed]
    return {
        "device": str(m.device), "dtype": str(m.dtype).removeprefix("torch."),
        "gpu_used": torch.cuda.get_device_name(m.device) if cuda else "none (cpu)",
        "prefill_gemm": cfg.prefill_gemm, "fp8_min_rows": min_rows,
        "pool_slots": pool_slots, "kv_bytes_per_token": kv_token,
        "replay_refused": mixed_graphs_refusal(m),
        "graphs": g.costs,
        "tolerance_rel": TOLERANCE,
        "replayed_points": len(replayed),
        "points_without_pair": [f"{r['batch']}x{r['context']}+{r['prompt_rows']}/{r['chunks']}" for r in rows
                                if str(r.get("note", "")).startswith("no pair")],
        "replays_match_eager": all(r["matches_eager"] for r in replayed) if replayed else None,
        "replays_equal_staged": all(r["equals_staged"] for r in replayed) if replayed else None,
        "speedup_min": min(speedups) if speedups else None,
        "speedup_max": max(speedups) if speedups else None,
    }


# ------------------------------------------------------------------ CLI


def _check_config(cfg: MixedConfig) -> None:
    problems = []
    if cfg.iters < 1:
        problems.append(f"--iters must be >= 1 (got {cfg.iters})")
    if cfg.warmup < 0:
        problems.append(f"--warmup must be >= 0 (got {cfg.warmup})")
    if cfg.page_size < 1:
        problems.append(f"--page-size must be >= 1 (got {cfg.page_size})")
    if min(cfg.contexts) < 2:
        problems.append(f"--contexts must be >= 2 tokens (a decode row's context holds its new token; "
                        f"got {cfg.contexts})")
    if max(cfg.chunks) > min(cfg.prompt_rows):
        problems.append(f"--chunks {max(cfg.chunks)} is more than --prompt-rows {min(cfg.prompt_rows)}: "
                        "every chunk needs a row")
    if cfg.mixed_graph_chunks < 1:
        problems.append(f"--mixed-graph-chunks must be >= 1 (got {cfg.mixed_graph_chunks})")
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        problems.append(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {cfg.kv_cache_dtype!r})")
    if cfg.prefill_gemm not in GEMM_PRECISIONS:
        problems.append(f"--prefill-gemm must be one of {', '.join(GEMM_PRECISIONS)} (got {cfg.prefill_gemm!r})")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        problems.append(f"--dtype must be one of {', '.join(DTYPES)} (got {cfg.dtype!r})")
    if cfg.device not in ("cuda", "cpu") and not cfg.device.startswith("cuda:"):
        problems.append(f"--device must be cuda, cuda:N or cpu (got {cfg.device!r})")
    if problems:
        raise SystemExit(f"{PROG}: " + "; ".join(problems))


def _parser() -> argparse.ArgumentParser:
    d = MixedConfig()
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model,
                   help="a shape name (tiny, qwen3-4b-shape, csm-tiny, ...; random weights from --seed), "
                        "random:<shape>:<seed>, or a checkpoint directory")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="compute and KV dtype (default: the config's)")
    p.add_argument("--batches", type=int_list, default=d.batches, help="decode rows (streams) per step, comma-separated")
    p.add_argument("--contexts", type=int_list, default=d.contexts,
                   help="each decode row's context in tokens (its new one included), comma-separated")
    p.add_argument("--prompt-rows", type=int_list, default=d.prompt_rows,
                   help="prompt rows per step beside the decode rows, comma-separated")
    p.add_argument("--chunks", type=int_list, default=d.chunks,
                   help="prompt chunks the rows are split into (each a prompt's first rows), comma-separated")
    p.add_argument("--mixed-graph-streams", type=int_list, default=d.mixed_graph_streams,
                   help="the pairs' decode-row buckets, as the monolith's flag (default: its default)")
    p.add_argument("--mixed-graph-rows", type=int_list, default=d.mixed_graph_rows,
                   help="the pairs' prompt-row buckets, as the monolith's flag (default: its default, 16..512)")
    p.add_argument("--mixed-graph-chunks", type=int, default=d.mixed_graph_chunks,
                   help="chunks a pair holds, as the monolith's flag")
    p.add_argument("--page-size", type=int, default=d.page_size, help="slots per page of the fragmented pool")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="the pool's precision, as the monolith's --kv-cache-dtype")
    p.add_argument("--prefill-gemm", choices=list(GEMM_PRECISIONS), default=d.prefill_gemm,
                   help="GEMM precision of forwards with prompt rows (mixed steps included), as the monolith's")
    p.add_argument("--iters", type=int, default=d.iters, help="timed calls per measurement (the median is reported)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed calls before them")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--reserve-gib", type=float, default=d.reserve_gib, help="GPU memory kept out of the KV pool")
    p.add_argument("--device", default=d.device, help="cuda (the measurement) or cpu (eager rows only: a smoke test)")
    p.add_argument("--out", default=d.out, help="folder for mixed-<date>-<tag>.json/.md")
    p.add_argument("--machine-tag", default=d.machine_tag, help="file-name tag (default: from the GPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    cfg = MixedConfig(
        model=a.model, dtype=a.dtype, batches=a.batches, contexts=a.contexts, prompt_rows=a.prompt_rows,
        chunks=a.chunks, mixed_graph_streams=a.mixed_graph_streams, mixed_graph_rows=a.mixed_graph_rows,
        mixed_graph_chunks=a.mixed_graph_chunks, page_size=a.page_size, kv_cache_dtype=a.kv_cache_dtype,
        prefill_gemm=a.prefill_gemm, iters=a.iters, warmup=a.warmup, seed=a.seed, reserve_gib=a.reserve_gib,
        device=a.device, out=a.out, machine_tag=a.machine_tag,
        command=f"{PROG} " + " ".join(shlex.quote(x) for x in argv),
    )
    doc = run_mixed(cfg)
    path = results_path("mixed", cfg.out, cfg.machine_tag, doc["machine"])
    title = "The monolith's mixed step: eager vs the captured pair's replay"
    report.Results.from_document(doc).write(path, COLUMNS, title=title)
    print(text_table(doc["rows"], COLUMNS))
    print("summary:", doc["summary"])
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
