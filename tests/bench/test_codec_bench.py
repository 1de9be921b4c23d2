"""`pdunit bench codec` on a CPU: the tiny codec, both paths, the results file's rows and
the share of D's step (the GPU run of record: bench/gpu/codec_h200.sh)."""

from __future__ import annotations

import json

import pytest

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
