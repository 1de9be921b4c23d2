"""The codec stage's host work per call (issue 26), on any device: a CPU run measures it.

Times `CodecStage.step_costed` as D's step loop calls it (engine/step_loop.py
`publish_step`: a step's frames in, the due PCM chunks out) with every stream due each
call, the decoder's device work stubbed (`push_slots` returns zeros of the PCM's shape):
what is timed is the Python and host-array work around the decode (chunking, codes,
checks, the graph path's padding, the PCM's split and 16-bit conversion, the chunks).
`--compute` keeps the real decode. Never a GPU figure: `python -m pdunit.bench.codec_host`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdunit.bench import report
from pdunit.bench.codec import build_codec
from pdunit.engine.loadgen.summary import Column, machine_info, text_table

COLUMNS = [
    Column("variant", "code"),
    Column("shape", "shape"),
    Column("path", "path"),
    Column("decode", "decode"),
    Column("batch", "streams"),
    Column("frames", "frames"),
    Column("ms", "ms/call", "{:.3f}"),
    Column("p90_ms", "p90 ms", "{:.3f}"),
    Column("us_per_stream", "us/stream", "{:.2f}"),
    Column("buffer_ms", "ms/buffering step", "{:.3f}"),
    Column("rounds_ms", "each round's ms"),
]


def _codes(frames: np.ndarray) -> np.ndarray:
    """The `pdunit` family's `TTSModel.codec_codes`: every column, [K, n] int64."""
    return np.ascontiguousarray(np.asarray(frames, dtype=np.int64).T)


def measure(codec: Any, batch: int, frames: int, graphs: bool, compute: bool, iters: int,
            warmup: int, seed: int) -> dict[str, Any]:
    """One stage of `batch` streams, each due every `frames` steps (first chunk too):
    the median step that decodes (a call) and the median step that only buffers."""
    from pdunit.engine.audio.codec_stage import CodecStage
    from pdunit.engine.audio.mimi_graphs import capped_buckets

    dec = codec.stream_decoder(graphs=graphs, slots=batch + 1, buckets=capped_buckets(batch),
                               graph_frames=frames)
    if not compute:
        spf = codec.samples_per_frame
        dec.push_slots = lambda slots, codes: torch.zeros(codes.shape[0], codes.shape[2] * spf)
    stage = CodecStage(dec, _codes, frames, frames)
    ids = np.arange(1, batch + 1, dtype=np.uint64)
    for rid in ids.tolist():
        stage.open(rid)
    rng = np.random.default_rng(seed)
    k, size = codec.num_codebooks, codec.codebook_size
    running = np.zeros(batch, dtype=np.uint8)
    calls: list[float] = []
    buffering: list[float] = []
    for i in range((warmup + iters) * frames):
        out = _Out(ids, rng.integers(0, size, size=(batch, k)).astype(np.int32), running)
        t0 = time.perf_counter()
        chunks, errors, _ = stage.step_costed(out)
        ms = (time.perf_counter() - t0) * 1e3
        assert not errors and len(chunks) in (0, batch), (len(chunks), errors[:1])
        if i >= warmup * frames:
            (calls if chunks else buffering).append(ms)
    ms = statistics.median(calls)
    return {"shape": "", "path": "graphs" if graphs else "eager", "decode": "real" if compute else "stub",
            "batch": batch, "frames": frames, "ms": ms, "p90_ms": float(np.percentile(calls, 90)),
            "us_per_stream": ms * 1e3 / batch,
            "buffer_ms": statistics.median(buffering) if buffering else None, "iters": iters}


class _Out:
    """A step's frames as D's StepOutput carries them."""

    def __init__(self, request_ids: np.ndarray, frames: np.ndarray, finished: np.ndarray) -> None:
        self.request_ids, self.frames, self.finished = request_ids, frames, finished


def _merged(paths: list[str]) -> list[dict[str, Any]]:
    """Every point's row of lowest median over the runs, with each run's median."""
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            key = tuple(row[k] for k in ("variant", "shape", "path", "decode", "frames", "batch"))
            rounds = best.get(key, {}).get("rounds_ms", []) + [round(row["ms"], 4)]
            if key not in best or row["ms"] < best[key]["ms"]:
                best[key] = dict(row)
            best[key]["rounds_ms"] = rounds
    return list(best.values())


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m pdunit.bench.codec_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("tiny", "real"), default="tiny")
    p.add_argument("--batches", type=_ints, default=[64, 256, 512])
    p.add_argument("--frames", type=_ints, default=[1, 2])
    p.add_argument("--paths", default="graphs,eager", help="graphs (the CUDA path's host work, run uncaptured), eager")
    p.add_argument("--compute", action="store_true", help="the real decode (not a stub)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--variant", default="", help="a label for the rows (the code measured)")
    p.add_argument("--merge", nargs="+", default=[], help="write nothing new: runs' JSONs (each code's rounds, "
                   "run alternately) merged, a point's row the round of the lowest median (a loaded machine's noise)")
    p.add_argument("--out", default="", help="a .json path (and its .md) for the rows")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows: list[dict[str, Any]] = _merged(a.merge) if a.merge else []
    runs = [json.loads(Path(f).read_text())["command"] for f in a.merge]
    codec = None if a.merge else build_codec(a.shape, torch.float32, "cpu", a.seed)
    for path in a.paths.split(",") if codec is not None else ():
        for frames in a.frames:
            for batch in a.batches:
                row = measure(codec, batch, frames, path == "graphs", a.compute, a.iters, a.warmup, a.seed)
                row.update(variant=a.variant, shape=a.shape)
                rows.append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    if a.merge:
        a.shape = a.paths = a.frames = a.batches = None  # type: ignore[assignment]  # the runs' own
    command = "python -m pdunit.bench.codec_host " + " ".join(shlex.quote(x) for x in argv)
    doc = report.Results("codec_host", machine_info(), command, {**vars(a), "torch": torch.__version__},
                         rows, {"note": "CPU host work of a codec stage call; the decode stubbed unless "
                                "decode=real; not a GPU figure", "runs": runs}).document()
    print(text_table(rows, COLUMNS))
    if a.out:
        report.Results.from_document(doc).write(Path(a.out), COLUMNS, title="Codec stage host work per call (CPU)")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
