"""`pdunit bench codec` on a CPU: the tiny codec, both paths, the results file's rows and
the share of D's step (the GPU run of record: bench/gpu/codec_h200.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pdunit.bench.codec import D_STEP_MODEL, CodecConfig, d_step_ms
from pdunit.bench.main import main as bench_main


def test_cpu_run_writes_a_row_per_point_and_path(tmp_path):
    out = tmp_path / "codec.json"
    assert bench_main(["codec", "--shape", "tiny", "--device", "cpu", "--batches", "1,3", "--frames", "1,2",
                       "--buckets", "1,4", "--iters", "1", "--warmup", "1", "--d-step-ms", "10",
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "codec" and doc["command"].startswith("pdunit bench codec --shape tiny")
    assert [(r["mode"], r["batch"], r["frames"]) for r in doc["rows"]] == [
        (m, b, f) for m in ("eager", "graphs") for b in (1, 3) for f in (1, 2)]
    for r in doc["rows"]:
        assert r["dtype"] == "fp32" and r["ms"] > 0 and r["d_step_ms"] == 10
        assert r["of_d_step"] == pytest.approx(r["ms"] / 10)
        assert r["us_per_stream"] == pytest.approx(r["ms"] * 1e3 / r["batch"])
        assert r["audio_ms"] == pytest.approx(r["frames"] * 40)  # 32 samples a frame at 800 Hz
        assert r["bucket"] == ({1: 1, 3: 4}[r["batch"]] if r["mode"] == "graphs" else None)
        assert (r["speedup"] is None) == (r["mode"] == "eager")
    runs = doc["summary"]["runs"]
    assert runs["fp32/eager"]["warm_frames"] == 4  # past the tiny codec's 6-position window
    assert runs["fp32/graphs"]["replays"] > 0 and runs["fp32/graphs"]["captures"] == 0  # no capture on a CPU
    assert set(doc["summary"]["fits"]) == {"fp32/eager/1f", "fp32/eager/2f", "fp32/graphs/1f", "fp32/graphs/2f"}
    assert "| batch |" in out.with_suffix(".md").read_text()


def test_d_step_comes_from_the_step_model_of_record_unless_given():
    ms, source = d_step_ms(CodecConfig(), 256)
    assert D_STEP_MODEL.exists() and D_STEP_MODEL.name in source
    assert 10 < ms < 20  # D's step at 256 streams x 1024 tokens on an H200
    assert d_step_ms(CodecConfig(d_step_ms=12.5), 256) == (12.5, "--d-step-ms 12.5")
    assert d_step_ms(CodecConfig(d_step_model=""), 256) == (None, "none")


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        bench_main(["codec", "--dtype", "fp16"])
    with pytest.raises(SystemExit, match="--iters"):
        bench_main(["codec", "--iters", "0", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--tune-conv times the fused kernels on a GPU"):
        bench_main(["codec", "--tune-conv", "--device", "cpu"])
    with pytest.raises(SystemExit, match="drop --conv-table"):
        bench_main(["codec", "--tune-conv", "--conv-table", "t.json"])
    with pytest.raises(SystemExit, match="add fused to --kernels"):
        bench_main(["codec", "--tune-conv", "--kernels", "torch"])


def test_kernels_side_by_side_name_each_run_and_auto_is_what_it_runs(tmp_path):
    """`--kernels auto,torch` on a CPU: auto is torch there, so one set of runs, named
    plainly; rows say their kernels and have no replay time (no graph on a CPU)."""
    out = tmp_path / "codec.json"
    assert bench_main(["codec", "--shape", "tiny", "--device", "cpu", "--batches", "2", "--frames", "1",
                       "--kernels", "auto,torch", "--iters", "1", "--warmup", "0", "--d-step-ms", "10",
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["kernels"] == ["torch"]
    assert [(r["mode"], r["kernels"], r["replay_ms"]) for r in doc["rows"]] == [
        ("eager", "torch", None), ("graphs", "torch", None)]
    assert set(doc["summary"]["runs"]) == {"fp32/eager", "fp32/graphs"}
    assert doc["summary"]["runs"]["fp32/eager"]["kernels"] == "torch"
    with pytest.raises(SystemExit):
        bench_main(["codec", "--kernels", "fused,triton"])


def test_conv_calls_are_the_real_decoders_fifteen_launches_at_their_rows():
    """Mimi's decoder at 256 streams x 1 frame: the upsample, the k7 input conv, four
    (transposed conv, residual k3, residual k1 with the skip) stages, the output conv."""
    from pdunit.bench.codec import build_codec, conv_calls

    codec = build_codec("real", torch.float32, "cpu", 0)
    calls = conv_calls(codec, 256, 1)
    got = [(c.conv.in_channels, c.conv.out_channels * c.conv.frames, c.conv.taps, 256 * t, last)
           for _, c, t, last in calls]
    assert got == [(512, 1024, 2, 256, False), (512, 1024, 7, 512, False),
                   (1024, 4096, 2, 512, False), (512, 256, 3, 4096, False), (256, 512, 1, 4096, True),
                   (512, 1536, 2, 4096, False), (256, 128, 3, 24576, False), (128, 256, 1, 24576, True),
                   (256, 640, 2, 24576, False), (128, 64, 3, 122880, False), (64, 128, 1, 122880, True),
                   (128, 256, 2, 122880, False), (64, 32, 3, 491520, False), (32, 64, 1, 491520, True),
                   (64, 1, 3, 491520, False)]
    assert [r for _, _, r, _ in conv_calls(codec, 256, 2)] == [2 * r for _, _, r, _ in calls]


def test_a_cpu_run_given_a_conv_table_runs_and_says_it_was_not_used(tmp_path):
    table = tmp_path / "codec-conv.json"
    table.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "entries": []}))
    out = tmp_path / "codec.json"
    assert bench_main(["codec", "--shape", "tiny", "--device", "cpu", "--batches", "2", "--frames", "1",
                       "--mode", "eager", "--iters", "1", "--warmup", "0", "--d-step-ms", "10",
                       "--conv-table", str(table), "--out", str(out)]) == 0
    tiles = json.loads(out.read_text())["summary"]["conv_tiles"]
    assert tiles["used"] == "hand" and str(table) in tiles["why"]


TUNE = textwrap.dedent("""
    import json, sys
    import torch
    from pdunit.bench import codec as bench
    from pdunit.engine.audio.mimi_stream import MimiStreamDecoder
    from pdunit.kernels import codec_fused as cf
    from tests.audio.test_mimi_graphs import lively
    from tests.audio.tiny import tiny_mimi

    FAST = cf.ConvTiles(32, 64, 64, 4, 3)

    def made_up_ms(fn):  # the GPU's timer stood in for: FAST (fitted to the shape) wins everywhere
        k = fn.keywords
        return 0.5 if k["tiles"] == FAST.fitted(k["x"].shape[2], k["weight"].shape[1]) else 1.0

    bench.graph_ms = made_up_ms
    codec = lively(tiny_mimi())
    cfg = bench.CodecConfig(shape="tiny", batches=[2, 3], frames=[1], dtypes=["fp32"], device="cpu")
    rows, best = bench.tune_conv(codec, cfg, "fp32")
    bench.write_conv_table(__import__("pathlib").Path(sys.argv[1]), cfg, "cpu", best, rows)
    table = cf.ConvTable.from_dict(json.loads(open(sys.argv[1]).read()), sys.argv[1])
    cf.use_conv_table(table)
    launched = []
    kernel = cf._conv_kernel()

    class Seen:  # the tiles every launch of the decoders below takes
        def __getitem__(self, grid):
            def launch(*args, **options):
                launched.append(options["BLOCK_M"])
                return kernel[grid](*args, **options)
            return launch

    cf._conv_kernel = lambda: Seen()
    import numpy as np
    ref = MimiStreamDecoder(codec, slots=3, kernels="torch")
    fused = MimiStreamDecoder(codec, slots=3, kernels="fused")
    worst = 0.0
    rng = np.random.default_rng(0)
    for d in (ref, fused):
        for s in "ab":
            d.open(s)
    for n in (1, 2, 1):
        batch = {s: rng.integers(0, 32, size=(4, n)) for s in "ab"}
        want, got = ref.push_many(batch), fused.push_many(batch)
        worst = max(worst, max(float(np.abs(got[s] - want[s]).max()) for s in batch))
    print(json.dumps({"rows": [{k: r[k] for k in ("conv", "rows", "tiles", "ok")} | {"error": r.get("error")}
                               for r in rows],
                      "best": best, "worst": worst, "launched": sorted(set(launched))}))
""")


def test_tune_conv_times_every_candidate_checks_it_and_the_decoder_launches_the_fastest(tmp_path):
    """Under Triton's interpreter (its own process), the tiny codec at 2 and 3 streams:
    every candidate of every conv shape checked against the torch form, the made-up
    fastest chosen per shape, the table written and read back, and a fused decoder on it
    launches only those tiles and still equals the torch decoder."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    table = tmp_path / "codec-conv.json"
    run = subprocess.run([sys.executable, "-c", TUNE, str(table)], cwd=Path(__file__).resolve().parents[2], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    from pdunit.kernels.codec_fused import conv_candidates

    shapes = {(b["cin"], b["n_out"], b["taps"], b["rows"]) for b in got["best"]}
    assert len(shapes) == len(got["best"]) and {b["rows"] % 2 for b in got["best"]} == {0, 1}  # 2 and 3 streams
    for b in got["best"]:
        tried = [r for r in got["rows"] if r["conv"] == b["conv"] and r["rows"] == b["rows"]]
        assert [r["tiles"] for r in tried] == [c.text() for c in conv_candidates(b["cin"], b["n_out"])]
        assert all(r["ok"] and r["error"] <= 1e-4 for r in tried), tried
        assert b["tiles"].startswith("m32-") and b["ms"] == 0.5 and b["hand_ms"] == 1.0
    assert got["launched"] == [32]  # every launch took the table's tiles
    assert got["worst"] <= 1e-4
    assert json.loads(table.read_text())["entries"] == got["best"]
