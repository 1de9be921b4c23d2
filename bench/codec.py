"""`pdunit bench codec`: the codec stage's cost per call vs batch (issue 26's Benchmarks).

Owns one measurement of `MimiStreamDecoder.decode` (codes [B, K, n] in, 16-bit PCM out) as
the codec stage makes it once a step for the due streams: Mimi's real shape (MimiConfig's
defaults, 32 codebooks) or a tiny one, random weights built locally (nothing downloaded),
streams warmed past the sliding window, per dtype, per path (eager, CUDA graphs), per
kernels (fused Triton or the torch reference) and ring attention (the Triton kernel or
torch's gather + SDPA): ms per call and per stream, a graph's replay alone, the share of
D's step at the same batch (a step-model fit from bench/results, or --d-step-ms), and
optionally the GPU kernels of one call (how many, the top ones). Must
never be run for a claim without writing its results file, and never re-implements the
decoder (it times the engine's own).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import gc
import json
import logging
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdunit.bench import report
from pdunit.bench.cuda_timing import kernel_ms, times_ms
from pdunit.engine.loadgen.summary import Column, machine_info, text_table

COLUMNS = [
    Column("dtype", "dtype"),
    Column("mode", "path"),
    Column("kernels", "kernels"),
    Column("attention", "attention"),
    Column("batch", "batch"),
    Column("frames", "frames"),
    Column("bucket", "bucket"),
    Column("ms", "ms/call", "{:.3f}"),
    Column("p90_ms", "p90 ms", "{:.3f}"),
    Column("replay_ms", "replay ms", "{:.3f}"),
    Column("us_per_stream", "us/stream", "{:.1f}"),
    Column("audio_ms", "audio ms", "{:.0f}"),
    Column("d_step_ms", "D step ms", "{:.2f}"),
    Column("of_d_step", "of D step", "{:.1%}"),
    Column("speedup", "vs eager", "{:.2f}x"),
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = {"eager": ("eager",), "graphs": ("graphs",), "both": ("eager", "graphs")}
# D's step fit of record (bench step, H200, qwen3-4b-shape, 16-256 streams x 1-2k context)
D_STEP_MODEL = report.RESULTS_DIR / "step-20261201-h200.fit.json"
TARGET = 0.10  # issue 26: the codec adds <= 10% to D's step at 256 streams


@dataclasses.dataclass
class CodecConfig:
    shape: str = "real"
    batches: list[int] = dataclasses.field(default_factory=lambda: [1, 64, 128, 256, 512])
    frames: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    dtypes: list[str] = dataclasses.field(default_factory=lambda: ["fp32"])
    mode: str = "both"
    attention: str = "auto"  # the decoder's ring attention: auto (triton on CUDA), triton, torch
    kernels: list[str] = dataclasses.field(default_factory=lambda: ["auto"])  # the push's: auto, fused, torch
    profile_batch: int = 0  # > 0: the top GPU kernels of one eager call at this batch (CUDA only)
    tune_conv: bool = False  # time every conv tile candidate at the benched points first, run with the fastest
    conv_table: str = ""  # a table --tune-conv wrote, for the timed runs ('' and no --tune-conv: the hand tiles)
    tune_workers: int = 16  # threads compiling --tune-conv's candidates
    warm_frames: int = -1  # -1: past the sliding window
    warm_chunk: int = 8
    iters: int = 20
    warmup: int = 3
    buckets: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    graph_frames: int = 4
    d_step_ms: float = 0.0  # > 0: this flat D step for every batch, else the step model
    d_step_model: str = str(D_STEP_MODEL)
    d_context: int = 1024  # context tokens per stream in D's step model
    device: str = "cuda"
    seed: int = 0
    out: str = "bench/results"
    machine_tag: str | None = None
    command: str = ""


def build_codec(shape: str, dtype: torch.dtype, device: str, seed: int) -> Any:
    """A `MimiCodec` of `shape` with random weights, built on `device`: `real` is
    transformers' MimiConfig defaults (Kyutai Mimi: 24 kHz, ratios (8, 6, 5, 4), 8-layer
    transformer, window 250) at CSM's 32 codebooks of 2048; `tiny` is the tests' codec.
    The codebooks are drawn too (transformers' init leaves them at zero)."""
    from transformers import MimiConfig, MimiModel

    from pdunit.engine.audio.codec_spec import tiny_mimi_model
    from pdunit.engine.audio.mimi_stream import MimiCodec

    torch.manual_seed(seed)
    if shape == "real":
        with torch.device(device):
            model: Any = MimiModel(MimiConfig(num_quantizers=32))
    elif shape == "tiny":
        model = tiny_mimi_model(4, 32, seed=seed)
        model = model.to(torch.device(device))
    else:
        raise ValueError(f"--shape must be real or tiny (got {shape!r})")
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("embed_sum"):
                buf.copy_(torch.randn(buf.shape, generator=g, device=device))
    return MimiCodec(model.to(dtype).eval())


def d_step_ms(cfg: CodecConfig, batch: int) -> tuple[float | None, str]:
    """D's step at `batch` streams: --d-step-ms, else the step model at --d-context."""
    if cfg.d_step_ms > 0:
        return cfg.d_step_ms, f"--d-step-ms {cfg.d_step_ms}"
    if not cfg.d_step_model:
        return None, "none"
    from pdunit.engine.decode.step_model import StepCoefficients

    path = Path(cfg.d_step_model)
    model = StepCoefficients.from_json(path.read_text(), source=str(path))
    return model.ms(batch, batch * cfg.d_context), f"{path.name} at {cfg.d_context} tokens a stream"




def measure(codec: Any, cfg: CodecConfig, dtype_name: str, mode: str,
            kernels: str = "auto") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One decoder (graphs or not, on `kernels`) with max(batches) streams, warmed, then
    each (batch, frames) point timed on the first `batch` streams; with graphs on CUDA,
    the graph's replay alone too (the call less its copies in and out)."""
    from pdunit.engine.audio.mimi_stream import MimiStreamDecoder

    cuda = codec.device.type == "cuda"
    graphs = mode == "graphs"
    most = max(cfg.batches)
    dec = MimiStreamDecoder(codec, slots=most + 1, graphs=graphs, buckets=tuple(cfg.buckets),
                            graph_frames=cfg.graph_frames, attention=cfg.attention, kernels=kernels)
    ids = [f"s{i}" for i in range(most)]
    slots = np.array([dec.open(s) for s in ids])
    rng = np.random.default_rng(cfg.seed)
    k, size = codec.num_codebooks, codec.codebook_size
    if cuda:
        torch.cuda.reset_peak_memory_stats(codec.device)
    t0 = time.perf_counter()
    dec.use_graphs = False  # warming is a few long calls, not the timed shape
    warm = cfg.warm_frames if cfg.warm_frames >= 0 else default_warm_frames(codec)
    done = 0
    while done < warm:
        n = min(cfg.warm_chunk, warm - done)
        dec.push_many({s: rng.integers(0, size, size=(k, n)) for s in ids})
        done += n
    dec.use_graphs = graphs
    warm_s = time.perf_counter() - t0
    rows = []
    for batch in cfg.batches:
        for frames in cfg.frames:
            codes = rng.integers(0, size, size=(batch, k, frames))
            call = functools.partial(dec.decode, slots[:batch], codes, pcm16=True)
            times = times_ms(call, cfg.iters, cfg.warmup, cuda)
            ms = statistics.median(times)
            d_ms, _ = d_step_ms(cfg, batch)
            uses_graph = graphs and dec.graphs.handles(frames)
            graph = dec.graphs.captured(dec.graphs.bucket(batch), frames) if uses_graph else None
            replay = statistics.median(times_ms(graph.replay, cfg.iters, 1, cuda)) if graph is not None else None
            rows.append({
                "dtype": dtype_name, "mode": mode, "kernels": dec.kernels, "attention": dec.attention,
                "batch": batch, "frames": frames, "bucket": dec.graphs.bucket(batch) if uses_graph else None,
                "ms": ms, "p90_ms": float(np.percentile(times, 90)), "min_ms": min(times), "replay_ms": replay,
                "us_per_stream": ms * 1e3 / batch,
                "audio_ms": frames * 1e3 / codec.frame_rate,
                "d_step_ms": d_ms, "of_d_step": ms / d_ms if d_ms else None,
                "iters": cfg.iters,
            })
            print({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in rows[-1].items()}, flush=True)
    info = {
        "warm_frames": warm, "warm_s": round(warm_s, 2), "pool_gib": round(dec.pool_bytes / 2**30, 3),
        "ring": dec.ring, "attention": dec.attention, "kernels": dec.kernels,
        "peak_gib": round(torch.cuda.max_memory_allocated(codec.device) / 2**30, 2) if cuda else None,
    }
    if cuda and cfg.profile_batch and mode == "eager":
        try:  # a profiler failure must not cost the timings
            info["profile"] = profile_kernels(dec, ids[: cfg.profile_batch], rng)
        except Exception as exc:  # noqa: BLE001
            info["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
    if graphs:
        info.update(captures=dec.graphs.captures, capture_s=round(dec.graphs.capture_seconds, 2),
                    replays=dec.graphs.replays)
    del dec
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows, info


def profile_kernels(dec: Any, ids: list[str], rng: np.random.Generator, calls: int = 3,
                    top: int = 15) -> dict[str, Any]:
    """The GPU kernels of `calls` eager one-frame calls of the streams `ids` (torch's
    profiler; a graph replays the same kernels): how many a call (copies included), the
    top ones by device time a call."""
    from torch.profiler import ProfilerActivity, profile

    k, size = dec.codec.num_codebooks, dec.codec.codebook_size
    batch = {s: rng.integers(0, size, size=(k, 1)) for s in ids}
    graphs, dec.use_graphs = dec.use_graphs, False
    dec.push_many(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            dec.push_many(batch)
        torch.cuda.synchronize()
    dec.use_graphs = graphs
    events = []
    for e in prof.key_averages():
        us = float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0))
        if us > 0:
            events.append((us, e.key, e.count))
    total = sum(us for us, _, _ in events)
    events.sort(reverse=True)
    return {
        "batch": len(ids), "frames": 1, "device_ms_per_call": round(total / calls / 1e3, 3),
        "kernels_per_call": round(sum(n for _, _, n in events) / calls, 1),
        "kernels": [{"name": name[:90], "ms_per_call": round(us / calls / 1e3, 3), "calls_per_call": n // calls,
                     "share": round(us / total, 3)} for us, name, n in events[:top]],
    }


def conv_calls(codec: Any, batch: int, frames: int) -> list[tuple[str, Any, int, bool]]:
    """The decoder's convolutions in push order as a call of `batch` streams x `frames`
    frames launches them: (name, its `_Conv`, input rows a stream, adds the block's residual)."""
    from pdunit.engine.audio.mimi_stream import MimiStreamDecoder, _Residual

    d = MimiStreamDecoder(codec, slots=1, kernels="torch")  # the convolutions alone: both kernels share them
    calls: list[tuple[str, Any, int, bool]] = []
    t = frames
    if d._upsample is not None:
        calls.append(("upsample", d._upsample, t, False))
        t *= d._upsample.conv.frames
    for i, step in enumerate(d._seanet):
        if isinstance(step, _Residual):
            if step.shortcut is not None:
                calls.append((f"seanet{i}.shortcut", step.shortcut, t, False))
            calls += [(f"seanet{i}.block{j}", c, t, c is step.block[-1]) for j, c in enumerate(step.block)]
        else:
            calls.append((f"seanet{i}", step, t, False))
            t *= step.conv.frames
    return calls


def tune_conv(codec: Any, cfg: CodecConfig, dtype_name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every tile candidate (kernels/codec_fused.py's CONV_CANDIDATES fitted to the shape)
    of every convolution shape of the decoder at the benched points (batches x frames),
    compiled at once in threads, each checked against the torch form and timed: a CUDA
    graph of back-to-back launches, its replays between events. Returns every candidate's
    row and per shape the fastest that passed (the table's entries)."""
    from pdunit.kernels import codec_fused as cf

    shapes: dict[Any, tuple[str, Any, int, int, bool]] = {}
    for batch in cfg.batches:
        for frames in cfg.frames:
            for name, c, t, last in conv_calls(codec, batch, frames):
                k = c.conv
                shape = cf.ConvShape(dtype_name, k.in_channels, k.out_channels * k.frames, k.taps, k.dilation, batch * t)
                shapes.setdefault(shape, (name, c, batch, t, last))
    gen = torch.Generator(device=codec.device).manual_seed(cfg.seed)
    dtype = DTYPES[dtype_name]

    def inputs(shape: Any, c: Any, batch: int, t: int, last: bool) -> dict[str, Any]:
        k = c.conv

        def randn(*size: int) -> torch.Tensor:
            return torch.randn(*size, device=codec.device, generator=gen).to(dtype)

        held = k.state_values > 0
        return {"x": randn(batch, t, k.in_channels), "weight": k.rows, "bias": k.row_bias, "taps": k.taps,
                "dilation": k.dilation, "state": randn(batch, k.state_values) if held else None,
                "next_state": torch.empty(batch, k.state_values, device=codec.device, dtype=dtype) if held else None,
                "elu": c.elu, "residual": randn(batch, t, shape.n_out) if last else None}

    t0 = time.perf_counter()
    jobs = []
    for shape, (_, c, batch, t, last) in shapes.items():
        args = inputs(shape, c, batch, t, last)
        jobs += [functools.partial(cf.compile_stream_conv, **args, tiles=tiles)
                 for tiles in cf.conv_candidates(shape.cin, shape.n_out)]
    how = compile_in_threads(jobs, cfg.tune_workers)
    del jobs
    print(f"tune-conv {dtype_name}: {len(shapes)} shapes, compiled {how} in {time.perf_counter() - t0:.1f} s",
          flush=True)
    rows: list[dict[str, Any]] = []
    best: list[dict[str, Any]] = []
    bound = 1e-3 if dtype == torch.float32 else 3e-2  # of the output's scale: fused rounds once, torch thrice
    for shape, (name, c, batch, t, last) in shapes.items():
        args = inputs(shape, c, batch, t, last)
        want_next = args["state"].clone() if args["state"] is not None else None
        with torch.inference_mode():
            want = c.conv(args["x"], args["state"], want_next, c.elu, args["residual"]).float()
        scale = max(1.0, float(want.abs().max()))
        done = []
        for tiles in cf.conv_candidates(shape.cin, shape.n_out):
            row: dict[str, Any] = {"conv": name, **dataclasses.asdict(shape), "tiles": tiles.text()}
            try:
                got = cf.stream_conv(**args, tiles=tiles).view(want.shape).float()
                err = float((got - want).abs().max()) / scale
                if want_next is not None:
                    err = max(err, float((args["next_state"].float() - want_next.float()).abs().max()) / scale)
                row.update(error=err, ok=err <= bound and math.isfinite(err))
                row["ms"] = graph_ms(functools.partial(cf.stream_conv, **args, tiles=tiles))
            except Exception as exc:  # noqa: BLE001  (a tile the card cannot hold: out of shared memory)
                row.update(ok=False, failed=f"{type(exc).__name__}: {str(exc)[:120]}")
            rows.append(row)
            if row["ok"] and "ms" in row:
                done.append(row)
        hand = next((r for r in rows[len(rows) - len(cf.conv_candidates(shape.cin, shape.n_out)):]
                     if r["tiles"] == cf.HAND_TILES.fitted(shape.cin, shape.n_out).text() and "ms" in r), None)
        if done:
            fast = min(done, key=lambda r: r["ms"])
            best.append({**dataclasses.asdict(shape), "tiles": fast["tiles"], "conv": name,
                         "ms": round(fast["ms"], 5), "hand_ms": round(hand["ms"], 5) if hand else None,
                         "candidates": len(done)})
            print(f"tune-conv {name} {shape}: {fast['tiles']} {fast['ms'] * 1e3:.1f} us, hand "
                  f"{hand['ms'] * 1e3 if hand else float('nan'):.1f} us ({len(done)} candidates)", flush=True)
        del args
    torch.cuda.empty_cache()
    return rows, best


def compile_in_threads(jobs: list[Any], workers: int) -> str:
    """Run `jobs` (compiles that launch nothing) with Triton's compiles spread over
    `workers` threads (its async compile mode); where this Triton has none, or it fails,
    one after another (each kernel then compiles at its first launch at worst)."""
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        workers = 1
    if workers > 1:
        try:
            with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
                for job in jobs:
                    job()
            return f"in {workers} threads"
        except Exception as exc:  # noqa: BLE001  (a private Triton API: never worth the tuning)
            print(f"tune-conv: compiling in threads failed ({type(exc).__name__}: {exc}); one after another")
    failed = 0
    for job in jobs:
        try:
            job()
        except Exception:  # noqa: BLE001  (the candidate's launch reports it)
            failed += 1
    return f"one after another ({failed} failed)"


def graph_ms(fn: Any, launches: int = 10, rounds: int = 5) -> float:
    """Device ms of one `fn()` launch: `launches` of them captured in a CUDA graph (no host
    gaps between them, as the codec's graphs run them), the graph replayed between events."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    ms = kernel_ms(graph.replay, reps=2, rounds=rounds) / launches
    del graph
    return ms


def write_conv_table(path: Path, cfg: CodecConfig, device: str, best: list[dict[str, Any]],
                     rows: list[dict[str, Any]]) -> None:
    """The table engines read (`--codec-conv-table`): per shape the fastest tiles, with
    their time and the hand tiles' (extra keys the reader skips), then every candidate."""
    doc = {"device": device, "command": cfg.command, "date": dt.datetime.now(dt.UTC).isoformat(
        timespec="seconds"), "entries": best, "candidates": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def default_warm_frames(codec: Any) -> int:
    """Frames that take a stream past the decoder transformer's sliding window (its
    positions run at the encoder's rate, `positions_per_frame` a codec frame)."""
    cfg = codec.model.config
    per_frame = max(1, round(float(cfg.encodec_frame_rate) / float(cfg.frame_rate)))
    return math.ceil(cfg.sliding_window / per_frame) + 1


def run_codec(cfg: CodecConfig, table_path: Path | None = None) -> dict[str, Any]:
    """Every (dtype, kernels, path) run; with --tune-conv the conv tiles are tuned first
    (per dtype) and the timed runs launch the fastest, the table written to `table_path`."""
    from pdunit.kernels import codec_fused as cf

    cuda = cfg.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("pdunit bench codec: --device cuda but no CUDA device (use --device cpu --shape tiny)")
    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    # auto named as what it runs, each kernels once (the results' config says what ran)
    cfg.kernels = list(dict.fromkeys(("fused" if cuda else "torch") if k == "auto" else k for k in cfg.kernels))
    tiles: dict[str, Any] = {"used": "hand", "why": "no --conv-table, no --tune-conv"}
    if cfg.conv_table:
        table = cf.load_conv_table(cfg.conv_table, torch.device(cfg.device), logging.getLogger("pdunit.bench.codec"))
        tiles = ({"used": cfg.conv_table, "shapes": len(table.entries)} if table is not None else
                 {"used": "hand", "why": f"{cfg.conv_table} not used: tuned on another GPU, or no CUDA (logged)"})
    tune = cfg.tune_conv and "fused" in cfg.kernels
    entries: list[dict[str, Any]] = []
    candidates: list[dict[str, Any]] = []
    codec = None
    try:
        for dtype_name in cfg.dtypes:
            codec = build_codec(cfg.shape, DTYPES[dtype_name], cfg.device, cfg.seed)
            if tune:
                got, best = tune_conv(codec, cfg, dtype_name)
                candidates += got
                entries += best
                device = torch.cuda.get_device_name(codec.device)
                cf.use_conv_table(cf.ConvTable.from_dict({"device": device, "entries": entries}, "--tune-conv"))
                tiles = {"used": "tuned", "table": str(table_path) if table_path else None,
                         "calls": _tuned_calls(codec, cfg, entries, tiles.get("calls", {}))}
                if table_path is not None:
                    write_conv_table(table_path, cfg, device, entries, candidates)
            for kernels in cfg.kernels:
                for mode in MODES[cfg.mode]:
                    got_rows, info = measure(codec, cfg, dtype_name, mode, kernels)
                    rows += got_rows
                    runs[_key(cfg, dtype_name, info["kernels"], mode)] = info
            del codec
            gc.collect()
    finally:
        cf.use_conv_table(None)
    eager = {(r["dtype"], r["kernels"], r["batch"], r["frames"]): r["ms"] for r in rows if r["mode"] == "eager"}
    for r in rows:
        base = eager.get((r["dtype"], r["kernels"], r["batch"], r["frames"]))
        r["speedup"] = base / r["ms"] if base and r["mode"] != "eager" else None
    summary = _summary(rows, runs, cfg)
    summary["conv_tiles"] = {**tiles, "shapes": entries} if tune else tiles
    return report.Results(
        bench="codec",
        machine=machine_info(),
        command=cfg.command,
        config={k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("command", "out")},
        rows=rows,
        summary=summary,
    ).document()


def _tuned_calls(codec: Any, cfg: CodecConfig, entries: list[dict[str, Any]],
                 calls: dict[str, Any]) -> dict[str, Any]:
    """Per benched point, the convolutions' device time of one call with the hand tiles
    and with the tuned ones (the sums of their launches' times as tuned)."""
    by_shape = {(e["dtype"], e["cin"], e["n_out"], e["taps"], e["dilation"], e["rows"]): e for e in entries}
    dtype = entries[-1]["dtype"] if entries else ""
    for batch in cfg.batches:
        for frames in cfg.frames:
            hand = tuned = 0.0
            for _, c, t, _ in conv_calls(codec, batch, frames):
                k = c.conv
                e = by_shape.get((dtype, k.in_channels, k.out_channels * k.frames, k.taps, k.dilation, batch * t))
                if e is None or e["hand_ms"] is None:
                    hand = tuned = math.nan
                    break
                hand += e["hand_ms"]
                tuned += e["ms"]
            calls[f"{dtype}/{batch}x{frames}f"] = {"hand_ms": round(hand, 4), "tuned_ms": round(tuned, 4)}
    return calls


def _key(cfg: CodecConfig, dtype: str, kernels: str, mode: str) -> str:
    """A run's name in the summary: dtype/path, with the kernels between when several
    were asked for (dtype/kernels/path)."""
    return f"{dtype}/{kernels}/{mode}" if len(cfg.kernels) > 1 else f"{dtype}/{mode}"


def _summary(rows: list[dict[str, Any]], runs: dict[str, Any], cfg: CodecConfig) -> dict[str, Any]:
    """Per (dtype, kernels, path, frames): a line ms = base + per_stream x batch over the
    batches, and the share of D's step at 256 streams against the target."""
    fits: dict[str, Any] = {}
    for dtype, kernels, mode, frames in sorted({(r["dtype"], r["kernels"], r["mode"], r["frames"]) for r in rows}):
        pts = sorted((r["batch"], r["ms"], r["of_d_step"]) for r in rows
                     if (r["dtype"], r["kernels"], r["mode"], r["frames"]) == (dtype, kernels, mode, frames))
        entry: dict[str, Any] = {}
        if len(pts) >= 2:
            slope, base = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
            entry.update(base_ms=round(float(base), 4), per_stream_ms=round(float(slope), 5))
        at = {p[0]: p[2] for p in pts}
        if at.get(256) is not None:
            entry["of_d_step_at_256"] = round(at[256], 4)
            entry["meets_target"] = at[256] <= TARGET
        fits[f"{_key(cfg, dtype, kernels, mode)}/{frames}f"] = entry
    return {
        "d_step": d_step_ms(cfg, 256)[1],
        "target": f"codec <= {TARGET:.0%} of D's step at 256 streams",
        "fits": fits,
        "runs": runs,
    }


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _kernels(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or any(v not in ("auto", "fused", "torch") for v in values) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"expected distinct auto, fused or torch (comma-separated), got {text!r}")
    return values


def _dtypes(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in DTYPES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"expected {' or '.join(DTYPES)} (comma-separated), got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    d = CodecConfig()
    p = argparse.ArgumentParser(prog="pdunit bench codec", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("real", "tiny"), default=d.shape,
                   help="real: Mimi's sizes (transformers' MimiConfig defaults, 32 codebooks); tiny: the tests' codec")
    p.add_argument("--batches", type=_ints, default=d.batches, help="streams per call, comma-separated")
    p.add_argument("--frames", type=_ints, default=d.frames, help="frames per stream per call, comma-separated")
    p.add_argument("--dtype", type=_dtypes, default=d.dtypes, help="fp32, bf16 or both (comma-separated)")
    p.add_argument("--mode", choices=tuple(MODES), default=d.mode, help="eager, CUDA graphs, or both")
    p.add_argument("--attention", choices=("auto", "triton", "torch"), default=d.attention,
                   help="the decoder's ring attention: the Triton kernel reading the pools in place (CUDA), torch's "
                   "gather + SDPA, or auto (triton on CUDA)")
    p.add_argument("--kernels", type=_kernels, default=d.kernels,
                   help="the push's kernels, comma-separated, each timed: fused (Triton, CUDA), torch (the "
                   "reference ops), auto (fused on CUDA); e.g. fused,torch for a side-by-side in one run")
    p.add_argument("--profile-batch", type=int, default=d.profile_batch,
                   help="> 0: the top GPU kernels of an eager one-frame call at this batch (CUDA; in the summary)")
    p.add_argument("--tune-conv", action="store_true",
                   help="first time every tile candidate of every conv shape of the decoder at the benched points "
                   "(CUDA, fused; each checked against the torch form), run with the fastest and write them as "
                   "codec-conv-<date>-<tag>.json beside the results: the engines' --codec-conv-table")
    p.add_argument("--conv-table", default=d.conv_table,
                   help="a table --tune-conv wrote, for the timed runs (used on the GPU model it names; without "
                   "it or --tune-conv the hand tiles run)")
    p.add_argument("--tune-workers", type=int, default=d.tune_workers, help="threads compiling --tune-conv's candidates")
    p.add_argument("--warm-frames", type=int, default=d.warm_frames,
                   help="frames each stream decodes before timing (-1: past the sliding window; 0: fresh streams)")
    p.add_argument("--warm-chunk", type=int, default=d.warm_chunk, help="frames per warming call")
    p.add_argument("--iters", type=int, default=d.iters, help="timed calls per point")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed calls per point (the graph capture included)")
    p.add_argument("--buckets", type=_ints, default=d.buckets, help="graph batch buckets")
    p.add_argument("--graph-frames", type=int, default=d.graph_frames,
                   help="largest frames per call captured (longer calls run eagerly)")
    p.add_argument("--d-step-ms", type=float, default=d.d_step_ms,
                   help="D's step in ms for every batch (default: the step model below)")
    p.add_argument("--d-step-model", default=d.d_step_model,
                   help="a bench step fit (.fit.json) giving D's step at each batch; '' for none")
    p.add_argument("--d-context", type=int, default=d.d_context, help="context tokens per stream in the step model")
    p.add_argument("--device", default=d.device, help="cuda, cuda:N or cpu")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out, help="folder (or .json path) for codec-<date>-<tag>.json/.md")
    p.add_argument("--machine-tag", default=d.machine_tag, help="file-name tag (default: from the GPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    problems = []
    if a.iters < 1 or a.warmup < 0 or a.warm_chunk < 1 or a.graph_frames < 1 or a.warm_frames < -1:
        problems.append("--iters, --warm-chunk, --graph-frames must be >= 1, --warmup >= 0, --warm-frames >= -1")
    if a.profile_batch < 0 or a.profile_batch > max(a.batches):
        problems.append(f"--profile-batch must be within 0..max(--batches) = {max(a.batches)} (got {a.profile_batch})")
    if a.tune_conv and not a.device.startswith("cuda"):
        problems.append("--tune-conv times the fused kernels on a GPU: drop it with --device cpu")
    if a.tune_conv and not {"fused", "auto"} & set(a.kernels):
        problems.append("--tune-conv tunes the fused kernels: add fused to --kernels")
    if a.tune_conv and a.conv_table:
        problems.append("--tune-conv writes its own table: drop --conv-table")
    if a.tune_workers < 1:
        problems.append(f"--tune-workers must be >= 1 (got {a.tune_workers})")
    if a.device != "cpu" and not a.device.startswith("cuda"):
        problems.append(f"--device must be cuda, cuda:N or cpu (got {a.device!r})")
    if problems:
        raise SystemExit("pdunit bench codec: " + "; ".join(problems))
    cfg = CodecConfig(
        shape=a.shape, batches=a.batches, frames=a.frames, dtypes=a.dtype, mode=a.mode, attention=a.attention,
        kernels=a.kernels,
        profile_batch=a.profile_batch, tune_conv=a.tune_conv, conv_table=a.conv_table, tune_workers=a.tune_workers,
        warm_frames=a.warm_frames, warm_chunk=a.warm_chunk, iters=a.iters, warmup=a.warmup,
        buckets=a.buckets, graph_frames=a.graph_frames, d_step_ms=a.d_step_ms,
        d_step_model=a.d_step_model, d_context=a.d_context, device=a.device, seed=a.seed,
        out=a.out, machine_tag=a.machine_tag,
        command="pdunit bench codec " + " ".join(shlex.quote(x) for x in argv),
    )
    machine = machine_info()
    print(f"machine: {report.machine_slug(machine)} ({machine.get('gpu_model') or machine.get('cpu_model')})")
    print(f"command: {cfg.command}")
    print(f"config: {dataclasses.asdict(cfg)}", flush=True)
    tag = cfg.machine_tag or report.machine_slug(machine).lower()
    path = Path(cfg.out)
    if path.suffix != ".json":
        path = path / f"codec-{dt.date.today().strftime('%Y%m%d')}-{tag}.json"
    table_path = path.with_name(path.name.replace("codec-", "codec-conv-", 1) if path.name.startswith("codec-")
                                else f"{path.stem}-conv.json")
    doc = run_codec(cfg, table_path if cfg.tune_conv else None)
    report.Results.from_document(doc).write(path, COLUMNS, title="Codec (Mimi stream decode) per call vs batch")
    print(text_table(doc["rows"], COLUMNS))
    print("summary:", doc["summary"])
    print(f"wrote {path} and {path.with_suffix('.md')}" + (f" and {table_path}" if table_path.exists() and
                                                            cfg.tune_conv else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
