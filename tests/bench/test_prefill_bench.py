"""`pdunit bench prefill`: the FLOP count behind its MFU, its point syntax, and a CPU run
through P's own prefill call."""

from __future__ import annotations

import json

import pytest

from pdunit.bench.main import main as bench_main
from pdunit.bench.prefill import forward_flops, parse_points, peak_for
from pdunit.engine.model.config import get_config


def test_flops_count_every_linear_weight_twice_per_row_plus_causal_attention():
    c = get_config("qwen3-4b-shape")
    per_layer_weights = (c.hidden * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim   # q|k|v
                         + c.n_heads * c.head_dim * c.hidden                      # o
                         + 3 * c.hidden * c.ffn_hidden)                           # gate|up, down
    one = forward_flops(c, 1, 1000)
    assert one == c.n_layers * (2 * per_layer_weights * 1000 + 2 * c.n_heads * c.head_dim * 1000 ** 2)
    # the 4B shape: ~8 GFLOP of weights per row, as the roofline assumes
    assert 7e9 < 2 * per_layer_weights * c.n_layers < 9e9
    # attention grows with each prompt's length, linear work with the rows
    assert forward_flops(c, 2, 1000) == 2 * one
    assert forward_flops(c, 1, 2000) > 2 * one


def test_points_and_peaks():
    assert parse_points("1x1500, 4X64") == [(1, 1500), (4, 64)]
    for bad in ("", "3", "0x10", "2x1", "ax5"):
        with pytest.raises(ValueError, match="--points"):
            parse_points(bad)
    assert peak_for({"gpu_model": "NVIDIA H200"}, 0) == 989.0
    assert peak_for({"gpu_model": "NVIDIA H200"}, 500) == 500
    assert peak_for({"gpu_model": None}, 0) is None


def test_cpu_run_writes_one_row_per_point_and_precision(tmp_path):
    out = tmp_path / "prefill.json"
    assert bench_main(["prefill", "--model", "tiny", "--device", "cpu", "--points", "1x32,2x16", "--gemm", "bf16,fp8",
                       "--iters", "2", "--warmup", "1", "--host-profile", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "prefill"
    assert [(r["gemm"], r["prompts"], r["rows"]) for r in doc["rows"]] == [
        ("bf16", 1, 32), ("bf16", 2, 16), ("fp8", 1, 32), ("fp8", 2, 16)]
    for r in doc["rows"]:
        assert r["tokens"] == r["prompts"] * r["rows"] and r["ms"] > 0 and r["mfu"] is None
        assert r["us_per_token"] == pytest.approx(r["ms"] * 1e3 / r["tokens"], rel=1e-3)
    bf16 = {(r["prompts"], r["rows"]): r["ms"] for r in doc["rows"] if r["gemm"] == "bf16"}
    for r in doc["rows"]:
        assert r["speedup"] == pytest.approx(bf16[(r["prompts"], r["rows"])] / r["ms"], rel=1e-2)
    assert set(doc["summary"]["best_us_per_token"]) == {"bf16", "fp8"}
    for r in doc["rows"]:  # the host profile: the functions with the most self time, per forward
        host = r["host"]
        assert 0 < len(host) <= 15 and all(h["calls"] > 0 and h["cum_ms"] >= h["self_ms"] >= 0 for h in host)
        assert [h["self_ms"] for h in host] == sorted((h["self_ms"] for h in host), reverse=True)
    assert out.with_suffix(".md").exists()


def test_graphs_without_a_gpu_are_refused_naming_the_device():
    with pytest.raises(SystemExit, match="--graphs needs a CUDA device, not --device cpu"):
        bench_main(["prefill", "--model", "tiny", "--device", "cpu", "--graphs"])


def _graph_rows_on_cuda(tmp_path, *flags: str) -> list[tuple]:
    """`bench prefill --graphs` of the tiny model on CUDA: (graphs, replayed, rows) per row."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "prefill.json"
    assert bench_main(["prefill", "--model", "tiny", "--device", "cuda", "--dtype", "bfloat16", "--graphs",
                       "--iters", "2", "--warmup", "1", "--out", str(out), *flags]) == 0
    return [(r["graphs"], r["replayed"], r["rows"]) for r in json.loads(out.read_text())["rows"]]


@pytest.mark.gpu
def test_cuda_run_measures_each_point_eager_and_through_the_prefill_graphs(tmp_path):
    assert _graph_rows_on_cuda(tmp_path, "--points", "1x100,2x2000") == [
        (False, False, 100), (False, False, 2000), (True, True, 100), (True, False, 2000)]  # 4000 rows: no bucket


@pytest.mark.gpu
def test_graph_rows_give_the_graphs_larger_buckets(tmp_path):
    assert _graph_rows_on_cuda(tmp_path, "--points", "2x2000", "--graph-rows", "2048,4096") == [
        (False, False, 2000), (True, True, 2000)]  # 4000 rows: the 4096 bucket


def test_the_first_frames_run_as_ps_and_the_report_says_how(tmp_path):
    """P's first frames (engine/prefill/runner.py start_first_frames): on the CPU auto
    gives the torch depth kernels and no frame graphs, and the report says so."""
    out = tmp_path / "prefill.json"
    assert bench_main(["prefill", "--model", "csm-tiny", "--device", "cpu", "--points", "2x8", "--iters", "1",
                       "--warmup", "0", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["depth_kernels"] == "auto" and doc["config"]["frame_graphs"] is None
    assert doc["summary"]["depth_kernels"] == "torch" and doc["summary"]["frame_graph_buckets"] is None
    assert [r["first_frames"] for r in doc["rows"]] == ["eager"]
    assert "first frames" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize(("flags", "says"), [
    (["--frame-graphs"], "--frame-graphs: the first frames' CUDA graphs need a CUDA device"),
    (["--depth-kernels", "fused"], "--depth-kernels fused runs the GPU path's Triton kernels"),
])
def test_first_frame_kernels_that_cannot_run_are_refused_naming_the_flag(flags, says):
    with pytest.raises(SystemExit, match=f"pdunit bench prefill: {says}"):
        bench_main(["prefill", "--model", "csm-tiny", "--device", "cpu", "--points", "1x8", *flags])


@pytest.mark.gpu
def test_cuda_run_of_csm_replays_the_first_frames_where_a_bucket_holds_the_prompts(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "prefill.json"
    assert bench_main(["prefill", "--model", "csm-tiny", "--device", "cuda", "--dtype", "bfloat16", "--points",
                       "1x64,4x64", "--iters", "2", "--warmup", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["depth_kernels"] == "fused" and doc["summary"]["frame_graph_buckets"] == [1, 2, 4]
    assert [r["first_frames"] for r in doc["rows"]] == ["graph", "graph"]
    assert bench_main(["prefill", "--model", "csm-tiny", "--device", "cuda", "--dtype", "bfloat16", "--points",
                       "4x64", "--iters", "2", "--warmup", "1", "--depth-kernels", "torch", "--no-frame-graphs",
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["depth_kernels"] == "torch" and doc["summary"]["frame_graph_buckets"] is None
    assert [r["first_frames"] for r in doc["rows"]] == ["eager"]


def test_an_unknown_or_repeated_gemm_is_refused(capsys):
    for bad in ("int8", "fp8,fp8"):
        with pytest.raises(SystemExit):
            bench_main(["prefill", "--device", "cpu", "--gemm", bad])
        assert "invalid gemm (from --gemm)" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_run_reports_mfu_and_top_kernels(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "prefill.json"
    assert bench_main(["prefill", "--model", "tiny", "--device", "cuda", "--dtype", "bfloat16", "--points", "2x256",
                       "--iters", "3", "--warmup", "1", "--peak-tflops", "100", "--profile", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert 0 < row["mfu"] < 1 and row["kernels"] and row["kernels"][0]["ms"] > 0
    idle = row["idle"]  # every profiled forward found, and its wall time split
    assert idle["forwards"] == 3 and idle["wall_ms"] > 0
    assert 0 <= idle["lead_ms"] + idle["inner_ms"] + idle["tail_ms"] < idle["wall_ms"]
    assert any("Launch" in c["call"] for c in idle["runtime"]), idle["runtime"]


def test_idle_analysis_splits_each_forward_into_lead_inner_gaps_and_tail():
    from pdunit.bench.prefill import FORWARD_MARK, device_idle

    def op(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        {"cat": "user_annotation", "name": FORWARD_MARK, "ts": 0, "dur": 1000},
        op("embed", 100, 50), op("gemm", 150, 300), op("attn", 700, 200),   # a 250 us hole before attn
        op("cudaMemcpyAsync", 10, 80, "cuda_runtime"), op("cudaLaunchKernel", 120, 5, "cuda_runtime"),
        {"cat": "user_annotation", "name": FORWARD_MARK, "ts": 2000, "dur": 600},
        op("embed", 2010, 40), op("gemm", 2050, 500, "gpu_memcpy"),           # back to back
        op("cudaMemcpyAsync", 2001, 8, "cuda_runtime"),
        op("stray", 1500, 100),                                               # between forwards: not counted
    ]
    idle = device_idle(events)
    assert idle["forwards"] == 2
    assert idle["wall_ms"] == 0.8
    assert idle["lead_ms"] == round((100 + 10) / 2 / 1e3, 3)
    assert idle["inner_ms"] == round(250 / 2 / 1e3, 3)
    assert idle["tail_ms"] == round((100 + 50) / 2 / 1e3, 3)
    assert idle["gaps"] == [{"ms": 0.25, "after": "gemm", "before": "attn"}]
    memcpy = next(c for c in idle["runtime"] if c["call"] == "cudaMemcpyAsync")
    assert memcpy == {"call": "cudaMemcpyAsync", "ms": 0.044, "calls": 1.0, "max_ms": 0.08}
    assert device_idle([op("gemm", 0, 1)]) == {"forwards": 0}


def test_top_kernels_count_device_operations_only():
    from pdunit.bench.prefill import top_kernels

    events = [
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 300}, {"cat": "kernel", "name": "gemm", "ts": 400, "dur": 300},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 800, "dur": 100},
        {"cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 900},         # a host op: not a kernel
        {"cat": "user_annotation", "name": "pdunit_prefill_forward", "ts": 0, "dur": 1000},
    ]
    rows = top_kernels(events, iters=2)
    assert rows == [{"kernel": "gemm", "ms": 0.3, "share": round(600 / 700, 4), "calls": 1.0},
                    {"kernel": "Memcpy HtoD", "ms": 0.05, "share": round(100 / 700, 4), "calls": 0.5}]


def test_the_host_profile_sees_the_functions_a_forward_runs():
    import numpy as np

    from pdunit.bench.prefill import host_profile
    from pdunit.engine.model.loader import load_model
    from pdunit.engine.prefill.runner import random_chunks

    model = load_model("random:tiny:0", dtype="float32")
    storage = model.new_kv_storage(64)
    chunks = random_chunks(model, [40], np.random.default_rng(0))
    names = lambda rows: {h["function"].split("(")[-1].rstrip(")") for h in rows}  # noqa: E731
    bf16 = host_profile(model, storage, chunks, iters=2, n=1000)
    assert {"run_prefill", "forward"} <= names(bf16) and "fp8_gemm" not in names(bf16)
    assert all(h["calls"] > 0 for h in bf16)
    model.set_prefill_gemm("fp8")
    assert "fp8_gemm" in names(host_profile(model, storage, chunks, iters=2, n=1000))
