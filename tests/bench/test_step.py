"""`pdunit bench step` without a GPU: the fragmented layouts, the command line and its
refusals, and the whole engine-path measurement on the CPU with the tiny model: every
point measured without and with D's overlap scheduler, through D's own classes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from pdunit.bench import step
from pdunit.engine.decode.admission import StepCoefficients
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.metrics import register_role

BATCHES, CONTEXTS, ITERS, WARMUP = [1, 3], [6, 33], 3, 1


def test_paged_contexts_are_distinct_whole_pages_of_the_pool() -> None:
    ctx = step.paged_contexts(4, 40, 16, 1024, np.random.default_rng(0))
    assert [len(c) for c in ctx] == [40] * 4
    every = np.concatenate(ctx)
    assert len(set(every.tolist())) == every.size and every.max() < 1024
    for c in ctx:
        assert (c[:16] // 16 == c[0] // 16).all() and c[0] % 16 == 0


def test_fragmented_pool_hands_out_scattered_pages_and_keeps_every_page_free() -> None:
    pool = PagePool(256, 4)
    step.fragment_pool(pool, np.random.default_rng(1))
    assert pool.free_pages == pool.n_pages and not pool.requests()
    pool.reserve(7, 40, 40)
    pages = pool.pages_of(7)
    assert len(set(pages.tolist())) == 10
    assert (np.diff(pages) != 1).sum() >= 5, f"pages {pages} are mostly consecutive: not fragmented"


def test_bad_batch_list_is_rejected_naming_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        step._parser().parse_args(["--batches", "1,x"])
    assert "expected comma-separated integers, got '1,x'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_run_step_without_cuda_says_it_needs_a_gpu_and_names_the_cpu_mode() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA GPU.*--device cpu"):
        step.run_step(step.StepConfig())


def test_tune_on_cpu_is_refused_naming_the_flag() -> None:
    with pytest.raises(SystemExit, match="--tune"):
        step.run_step(step.StepConfig(model="tiny", device="cpu", tune=True, batches=[1], contexts=[8]))


def test_context_past_the_models_positions_is_refused_naming_the_flag() -> None:
    with pytest.raises(SystemExit, match=r"--contexts \[8190\].*max_positions 8192"):
        step.run_step(step.StepConfig(model="tiny", device="cpu", batches=[1], contexts=[64, 8190]))


def test_unknown_overlap_mode_is_refused_naming_the_choices() -> None:
    with pytest.raises(SystemExit, match="--overlap must be one of off, on, both"):
        step.run_step(step.StepConfig(model="tiny", device="cpu", overlap="sometimes"))


def test_bad_decode_kernel_is_refused_before_the_device_is_touched() -> None:
    with pytest.raises(SystemExit, match="--decode-kernel: fp8_dots=4 is not one of"):
        step.main(["--decode-kernel", "fp8_dots=4"])


def _launches() -> float:
    """Steps the overlap scheduler queued (its host-time histogram counts one each)."""
    register_role("decode")  # what D's main does before serving /metrics
    return REGISTRY.get_sample_value("pdunit_decode_host_seconds_count") or 0.0


def test_cpu_run_measures_every_point_without_and_with_overlap_through_the_engine(tmp_path: Path) -> None:
    before = _launches()
    argv = ["--device", "cpu", "--model", "tiny", "--page-size", "4",
            "--batches", ",".join(map(str, BATCHES)), "--contexts", ",".join(map(str, CONTEXTS)),
            "--iters", str(ITERS), "--warmup", str(WARMUP), "--machine-tag", "test", "--out", str(tmp_path)]
    assert step.main(argv) == 0
    (path,) = tmp_path.glob("step-*-test.json")
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    points = [(b, c) for c in CONTEXTS for b in BATCHES]
    assert [(r["batch"], r["context"], r["overlap"]) for r in rows] == [
        (b, c, o) for b, c in points for o in (False, True)]
    for r in rows:
        where = f"{r['batch']}x{r['context']} overlap={r['overlap']}"
        assert "skipped" not in r, where
        assert r["steps"] == ITERS, where                 # one step per timed iteration, as asked
        assert r["frames"] == r["batch"] * ITERS, where   # every stream published a frame per step
        # the path counters come from StepForward; on the CPU there are no graphs
        assert r["graph_steps"] + r["eager_steps"] == r["steps"], where
        assert (r["eager_steps"], r["path"]) == (ITERS, "eager"), where
        assert r["step_ms"] > 0 and r["host_ms"] > 0, where
        assert r["mean_context"] == r["context"] + WARMUP + ITERS / 2, where
        assert ("wait_ms" in r) is r["overlap"], where
    # the overlap rows ran D's OverlapScheduler: admission + warmup + timed launches each
    assert _launches() - before == len(points) * (1 + WARMUP + ITERS)
    summary = doc["summary"]
    assert summary["modes"] == ["no_overlap", "overlap"]
    for mode in ("no_overlap", "overlap"):
        assert summary[mode]["eager_steps"] == summary[mode]["steps"] == len(points) * ITERS
    md = path.with_suffix(".md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| batch"))
    assert "| overlap |" in header and "| graph steps | eager steps |" in header
    table = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == len(rows)
    for line, r in zip(table, rows, strict=True):  # steps, frames, graph steps, eager steps
        assert f"| {r['overlap']} | {ITERS} | {r['batch'] * ITERS} | 0 | {ITERS} |" in line, line
    # the engines' --step-model seed, fitted from the overlap rows, loads as D loads it
    (fit,) = tmp_path.glob("step-*-test.fit.json")
    coef = StepCoefficients.from_json(fit.read_text(), str(fit))
    assert coef == step.step_model(rows)
    assert min(coef.base_ms, coef.per_stream_ms, coef.per_token_ms) >= 0 and coef.ms(1, 1) > 0


def test_step_model_fits_the_overlap_rows_when_there_are_any() -> None:
    def row(b: int, ctx: int, overlap: bool, per_stream: float) -> dict:
        return {"batch": b, "context": ctx, "mean_context": ctx, "overlap": overlap,
                "step_ms": 2.0 + per_stream * b + 1e-4 * b * ctx}
    rows = [row(b, c, o, 0.5 if o else 1.0) for b in (1, 8, 64) for c in (512, 2048) for o in (False, True)]
    coef = step.step_model(rows)
    assert (coef.base_ms, coef.per_stream_ms, coef.per_token_ms) == pytest.approx((2.0, 0.5, 1e-4), rel=1e-6)
    assert step.step_model([r for r in rows if not r["overlap"]]).per_stream_ms == pytest.approx(1.0)


def test_overlap_only_mode_measures_only_overlapped_rows() -> None:
    doc = step.run_step(step.StepConfig(model="tiny", device="cpu", page_size=4, batches=[2], contexts=[9],
                                        iters=2, warmup=0, overlap="on"))
    assert [(r["overlap"], r["steps"], r["frames"]) for r in doc["rows"]] == [(True, 2, 4)]
    assert doc["summary"]["modes"] == ["overlap"]


def test_fp8_decode_gemms_run_the_steps_and_count_their_weight_bytes(capsys) -> None:
    def run(gemm: str) -> dict:
        return step.run_step(step.StepConfig(model="tiny", device="cpu", page_size=4, batches=[2], contexts=[9],
                                             iters=2, warmup=0, overlap="on", decode_gemm=gemm))

    bf16, fp8 = run("bf16"), run("fp8")
    assert [r["frames"] for r in fp8["rows"]] == [4]
    assert fp8["summary"]["weight_gib"] < bf16["summary"]["weight_gib"]  # the GEMMs' e4m3 bytes
    with pytest.raises(SystemExit):
        step.main(["--device", "cpu", "--decode-gemm", "int8"])
    assert "--decode-gemm: invalid choice: 'int8'" in capsys.readouterr().err


def test_profile_lists_the_top_host_ops_of_a_step() -> None:
    doc = step.run_step(step.StepConfig(model="tiny", device="cpu", page_size=4, batches=[2], contexts=[9],
                                        iters=3, warmup=0, overlap="both", profile=True))
    for row in doc["rows"]:
        ops = row["profile"]
        assert 0 < len(ops) <= 15 and all(op["self_cpu_ms"] >= 0 and op["calls"] > 0 for op in ops)
        assert ops == sorted(ops, key=lambda op: op["self_cpu_ms"], reverse=True)
    # the forward's matmuls are among a step's ops on the CPU
    assert any("mm" in op["op"] or "linear" in op["op"] for r in doc["rows"] for op in r["profile"])


@pytest.mark.gpu
def test_gpu_run_replays_graphs_in_both_modes_and_reads_the_schedulers_events() -> None:
    """The real shape at two small points: every timed step, with and without overlap,
    is a graph replay (no silent eager fallback), and the device-side columns exist."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    doc = step.run_step(step.StepConfig(batches=[1, 8], contexts=[64], iters=4, warmup=1, copy_gib=0.5,
                                        compare=[]))
    assert [(r["batch"], r["overlap"]) for r in doc["rows"]] == [(1, False), (1, True), (8, False), (8, True)]
    for r in doc["rows"]:
        where = f"{r['batch']}x64 overlap={r['overlap']}"
        assert (r["steps"], r["graph_steps"], r["eager_steps"], r["path"]) == (4, 4, 0, "graph"), where
        assert r["frames"] == 4 * r["batch"], where
        assert r["gpu_ms"] > 0 and r["roofline_ms"] > 0 and r["attn_gbps"] > 0, where
        if r["overlap"]:
            assert 0 < r["event_gpu_ms"] and 0 < r["event_busy"] <= 1.0 + 1e-6, where
    assert doc["summary"]["graph_buckets"] == [1, 2, 4, 8]


@pytest.mark.gpu
def test_gpu_run_takes_the_engines_decode_kernel_flag() -> None:
    """`--decode-kernel` sets the kernel the rows run (graphs capture it), and the summary
    gives the flag back in the engines' canonical form."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pdunit.kernels import paged_attention as pa

    saved = dict(pa.DECODE_CONFIG)
    try:
        doc = step.run_step(step.StepConfig(batches=[8], contexts=[64], iters=2, warmup=1, copy_gib=0.5,
                                            compare=[], overlap="on", decode_kernel="kv_as_a=1,head_major=1"))
    finally:
        pa.DECODE_CONFIG.clear()
        pa.DECODE_CONFIG.update(saved)
    assert doc["summary"]["decode_kernel"] == "head_major=1,kv_as_a=1"
    assert doc["summary"]["decode_kernel_config"]["head_major"] == 1
    assert doc["rows"][0]["graph_steps"] == 2
