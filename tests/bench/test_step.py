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
from pdunit.engine.decode.step_model import StepCoefficients
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
    # the e4m3 GEMMs' own rate is measured and reported beside the model dtype's
    assert bf16["summary"]["matrix_fp8_tflops"] is None and fp8["summary"]["matrix_fp8_tflops"] > 0
    assert fp8["rows"][0]["fp8_tflop"] > 0 == bf16["rows"][0]["fp8_tflop"]
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


# ------------------------------------------------------------------ any family: csm


def _llama_weights(c, with_final_norm: bool = True) -> tuple[int, int]:  # noqa: ANN001 - a ModelConfig
    """(matrix weights, norm weights) of a Llama-shaped stack, by hand from its config."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    per_layer = c.hidden * q + 2 * c.hidden * kv + q * c.hidden + 3 * c.hidden * c.ffn_hidden
    norms = c.n_layers * 2 * c.hidden + (c.hidden if with_final_norm else 0)
    assert not c.qk_norm  # csm-tiny's stacks have no q/k norm
    return c.n_layers * per_layer, norms


def _csm_tiny_work(batch: int, mean_context: float) -> dict[str, float]:
    """One csm-tiny decode step's bytes and FLOPs computed from its config alone (float64:
    8 bytes a value): the backbone once; the head once; the depth decoder's projection,
    layers and norm once per depth pass, K-1 passes over K positions; its heads once."""
    from pdunit.engine.model.registry import random_shape

    shape = random_shape("csm-tiny")
    assert shape is not None
    b, d = shape[1].model, shape[1].extras.depth
    dc, k, v, e = d.backbone, d.n_codebooks, d.vocab_size, 8
    mats, norms = _llama_weights(b)
    d_mats, d_norms = _llama_weights(dc)
    d_mats += d.backbone_hidden * dc.hidden  # the projection from the backbone's width
    head, depth_heads = b.hidden * b.head_vocab_sizes[0], (k - 1) * dc.hidden * v
    kv_token = b.n_layers * 2 * b.n_kv_heads * b.head_dim * e
    positions = sum(j + 1 for j in range(1, k))  # pass j attends the frame's first j + 1 positions
    return {
        "backbone_bytes": e * (mats + norms) + batch * b.n_codebooks * b.hidden * e + batch * mean_context * kv_token,
        "backbone_flops": 2 * batch * mats + 4 * batch * mean_context * b.n_heads * b.head_dim * b.n_layers,
        "frames_bytes": e * (head + depth_heads + (k - 1) * (d_mats + d_norms))
        + batch * k * d.backbone_hidden * e + batch * dc.n_layers * 2 * dc.n_kv_heads * dc.head_dim * e * positions,
        "frames_flops": 2 * batch * (head + depth_heads + k * d_mats)
        + 4 * batch * dc.n_layers * dc.n_heads * dc.head_dim * (positions + 1),
        "depth_weight_bytes": e * (d_mats + d_norms), "passes": k - 1,
    }


def test_step_work_counts_the_depth_decoders_k_minus_1_passes_as_the_config_says() -> None:
    m = step.load_bench_model("random:csm-tiny:0", 0, "cpu")
    kv_token = m.config.kv_bytes_per_token(m.dtype)
    for batch, ctx in ((1, 8.5), (3, 35.5)):
        work = step.step_work(m, batch, ctx, kv_token)
        hand = _csm_tiny_work(batch, ctx)
        assert work.depth_passes == hand["passes"] == 3
        assert work.backbone_bytes == pytest.approx(hand["backbone_bytes"], rel=1e-12)
        assert work.backbone_flops == pytest.approx(hand["backbone_flops"], rel=1e-12)
        assert work.frames_bytes == pytest.approx(hand["frames_bytes"], rel=1e-12)
        assert work.frames_flops == pytest.approx(hand["frames_flops"], rel=1e-12)
    # the weights as stored: the depth decoder counted K-1 = 3 times, not once
    params = dict(m.named_parameters())
    stored = sum(p.numel() * p.element_size() for n, p in params.items() if n.startswith("frame_generator."))
    stored += params["head.weight"].numel() * 8
    embed = params["frame_generator.embed.weight"]
    once = stored - embed.numel() * 8
    assert work.frame_weight_bytes == once + 2 * hand["depth_weight_bytes"]
    # the backbone's: every parameter but the embedding table and the frame generation's
    backbone = sum(p.numel() * 8 for n, p in params.items()
                   if n != "embed.weight" and n != "head.weight" and not n.startswith("frame_generator."))
    assert work.backbone_weight_bytes == backbone


def test_step_work_of_a_model_without_frame_generator_is_its_weights_embedding_rows_and_kv() -> None:
    m = step.load_bench_model("tiny", 0, "cpu")
    c = m.config
    work = step.step_work(m, 4, 100.0, 1000)
    every = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n != "embed.weight")
    assert work.backbone_bytes == every + 4 * c.n_codebooks * c.hidden * 8 + 4 * 100.0 * 1000
    assert (work.frames_bytes, work.frames_flops, work.depth_passes) == (0, 0.0, 0)
    gbps, tflops = 2.0, 1e-3
    assert work.roofline_ms(gbps, tflops) == pytest.approx(
        max(work.backbone_bytes / 2e9, work.backbone_flops / 1e9) * 1e3)


CSM_BATCHES, CSM_CONTEXTS = [1, 3], [6, 9]


def test_cpu_run_of_csm_times_the_whole_step_and_its_roofline_from_the_config(tmp_path: Path) -> None:
    """`--model random:csm-tiny:0` on the CPU: D's step with the depth decoder's frames
    (eager: no graphs on the CPU), each row's roofline from the given bandwidth and
    matrix rate equal to the hand computation's, and the admission fit written."""
    gbps, tflops = 0.5, 2e-4
    argv = ["--device", "cpu", "--model", "random:csm-tiny:0", "--page-size", "4",
            "--batches", ",".join(map(str, CSM_BATCHES)), "--contexts", ",".join(map(str, CSM_CONTEXTS)),
            "--iters", "2", "--warmup", "1", "--hbm-gbps", str(gbps), "--matrix-tflops", str(tflops),
            "--machine-tag", "csm", "--out", str(tmp_path)]
    assert step.main(argv) == 0
    (path,) = tmp_path.glob("step-*-csm.json")
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert [(r["batch"], r["context"], r["overlap"]) for r in rows] == [
        (b, c, o) for c in CSM_CONTEXTS for b in CSM_BATCHES for o in (False, True)]
    binds = set()
    for r in rows:
        where = f"{r['batch']}x{r['context']} overlap={r['overlap']}"
        assert r["steps"] == 2 and r["frames"] == 2 * r["batch"], where
        assert (r["frame_graph_steps"], r["frame_eager_steps"]) == (0, 2), where
        hand = _csm_tiny_work(r["batch"], r["mean_context"])
        nbytes = hand["backbone_bytes"] + hand["frames_bytes"]
        flops = hand["backbone_flops"] + hand["frames_flops"]
        roof = max(nbytes / (gbps * 1e9), flops / (tflops * 1e12)) * 1e3
        assert r["roofline_ms"] == pytest.approx(roof, rel=1e-9), where
        assert r["bound"] == ("hbm" if nbytes / (gbps * 1e9) >= flops / (tflops * 1e12) else "matrix"), where
        binds.add(r["bound"])
        assert r["frames_roofline_ms"] == pytest.approx(
            max(hand["frames_bytes"] / (gbps * 1e9), hand["frames_flops"] / (tflops * 1e12)) * 1e3, rel=1e-9)
        assert r["backbone_roofline_ms"] == pytest.approx(
            max(hand["backbone_bytes"] / (gbps * 1e9), hand["backbone_flops"] / (tflops * 1e12)) * 1e3, rel=1e-9)
        assert r["fraction_of_roofline"] == pytest.approx(r["roofline_ms"] / r["step_ms"]), where
    assert binds == {"hbm", "matrix"}, "the given rates put the small batch on bytes, the larger on FLOPs"
    s = doc["summary"]
    assert (s["hbm_copy_gbps"], s["matrix_tflops"], s["hbm_gbps_given"]) == (gbps, tflops, True)
    assert (s["frame_generator"], s["depth_passes"], s["frame_graph_buckets"]) == ("DepthDecoder", 3, None)
    header = next(line for line in path.with_suffix(".md").read_text().splitlines() if line.startswith("| batch"))
    for col in ("frame graph steps", "frames gpu ms", "backbone roofline ms", "frames roofline ms", "bound"):
        assert f"| {col} |" in header, col
    (fit,) = tmp_path.glob("step-*-csm.fit.json")
    assert StepCoefficients.from_json(fit.read_text(), str(fit)) == step.step_model(rows)


def _llama_rows(c) -> int:  # noqa: ANN001 - a ModelConfig
    """Output rows of a Llama-shaped stack's per-layer GEMMs (one fp8 scale each)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return c.n_layers * (q + 2 * kv + c.hidden + 2 * c.ffn_hidden + c.hidden)


def test_fp8_decode_gemms_shrink_the_frame_bytes_and_time_the_e4m3_flops_at_the_e4m3_rate() -> None:
    """csm-tiny (float64, 8 bytes a weight) under set_decode_gemm("fp8"): the backbone's
    and the depth decoder's per-layer GEMMs count 1 byte a weight and a float32 scale a
    row (the depth decoder's K-1 times), the FLOPs stay, the per-layer GEMMs' are e4m3
    FLOPs, and each part's matrix term takes those at the e4m3 rate, the rest at the
    model dtype's (a ratio over the model dtype's rate alone would flatter an fp8 step)."""
    from pdunit.engine.model.registry import random_shape

    shape = random_shape("csm-tiny")
    assert shape is not None
    b, d = shape[1].model, shape[1].extras.depth
    k, dc = d.n_codebooks, d.backbone
    mats, d_mats = _llama_weights(b)[0], _llama_weights(dc)[0]
    saved, d_saved = 7 * mats - 4 * _llama_rows(b), 7 * d_mats - 4 * _llama_rows(dc)
    bf16 = step.load_bench_model("random:csm-tiny:0", 0, "cpu")
    fp8 = step.load_bench_model("random:csm-tiny:0", 0, "cpu")
    fp8.set_decode_gemm("fp8")
    kv_token = bf16.config.kv_bytes_per_token(bf16.dtype)
    batch, ctx = 3, 35.5
    wide, narrow = step.step_work(bf16, batch, ctx, kv_token), step.step_work(fp8, batch, ctx, kv_token)
    assert narrow.backbone_weight_bytes == wide.backbone_weight_bytes - saved
    assert narrow.frame_weight_bytes == wide.frame_weight_bytes - (k - 1) * d_saved
    assert (narrow.backbone_flops, narrow.frames_flops) == (wide.backbone_flops, wide.frames_flops)
    assert (wide.backbone_fp8_flops, wide.frames_fp8_flops) == (0.0, 0.0)
    assert narrow.backbone_fp8_flops == 2 * batch * mats
    assert narrow.frames_fp8_flops == 2 * batch * k * d_mats  # K positions a frame
    gbps, tflops, fp8_tflops = 1e6, 1e-3, 4e-3  # matrix-bound: the bytes take no time
    for part, flops, e4m3 in (("backbone", narrow.backbone_flops, narrow.backbone_fp8_flops),
                              ("frames", narrow.frames_flops, narrow.frames_fp8_flops)):
        want = ((flops - e4m3) / (tflops * 1e12) + e4m3 / (fp8_tflops * 1e12)) * 1e3
        assert narrow.roofline_ms(gbps, tflops, part, fp8_tflops) == pytest.approx(want, rel=1e-12), part
        assert narrow.roofline_ms(gbps, tflops, part, fp8_tflops) < wide.roofline_ms(gbps, tflops, part), part
    assert narrow.roofline_ms(gbps, tflops, fp8_tflops=fp8_tflops) == pytest.approx(
        narrow.roofline_ms(gbps, tflops, "backbone", fp8_tflops) + narrow.roofline_ms(gbps, tflops, "frames", fp8_tflops))
    assert narrow.bound(gbps, tflops, fp8_tflops) == "matrix"
    assert wide.roofline_ms(gbps, tflops) == wide.roofline_ms(gbps, tflops, fp8_tflops=fp8_tflops)  # none in e4m3
    with pytest.raises(ValueError, match="e4m3 matrix rate"):
        narrow.roofline_ms(gbps, tflops)


def test_cpu_run_of_csm_with_fp8_decode_gemms_judges_its_rows_by_both_rates(tmp_path: Path) -> None:
    """`--decode-gemm fp8 --matrix-fp8-tflops`: each row's roofline is the hand count's,
    the e4m3 FLOPs at the given e4m3 rate; the summary reports both rates."""
    gbps, tflops, fp8_tflops = 1e6, 2e-4, 5e-4
    argv = ["--device", "cpu", "--model", "random:csm-tiny:0", "--page-size", "4", "--batches", "2",
            "--contexts", "9", "--iters", "2", "--warmup", "0", "--overlap", "on", "--decode-gemm", "fp8",
            "--hbm-gbps", str(gbps), "--matrix-tflops", str(tflops), "--matrix-fp8-tflops", str(fp8_tflops),
            "--machine-tag", "csm8", "--out", str(tmp_path)]
    assert step.main(argv) == 0
    (path,) = tmp_path.glob("step-*-csm8.json")
    doc = json.loads(path.read_text())
    (r,) = doc["rows"]
    from pdunit.engine.model.registry import random_shape

    shape = random_shape("csm-tiny")
    assert shape is not None
    hand = _csm_tiny_work(2, r["mean_context"])
    d = shape[1].extras.depth  # the per-layer GEMMs: the backbone once, the depth decoder at K positions
    e4m3 = 2 * 2 * (_llama_weights(shape[1].model)[0] + d.n_codebooks * _llama_weights(d.backbone)[0])
    assert r["fp8_tflop"] * 1e12 == pytest.approx(e4m3, rel=1e-12)
    matrix_ms = ((hand["backbone_flops"] + hand["frames_flops"] - e4m3) / (tflops * 1e12)
                 + e4m3 / (fp8_tflops * 1e12)) * 1e3
    assert r["roofline_ms"] == pytest.approx(matrix_ms, rel=1e-9) and r["bound"] == "matrix"
    s = doc["summary"]
    assert (s["matrix_tflops"], s["matrix_fp8_tflops"], s["matrix_fp8_tflops_given"]) == (tflops, fp8_tflops, True)
    with pytest.raises(SystemExit, match="--matrix-fp8-tflops must be >= 0"):
        step.run_step(step.StepConfig(model="tiny", device="cpu", matrix_fp8_tflops=-1))


def test_cpu_run_measures_the_bandwidth_and_matrix_rate_it_judges_by() -> None:
    doc = step.run_step(step.StepConfig(model="csm-tiny", device="cpu", page_size=4, batches=[2], contexts=[9],
                                        iters=2, warmup=0, overlap="on"))
    s, (r,) = doc["summary"], doc["rows"]
    assert s["hbm_copy_gbps"] > 0 and s["matrix_tflops"] > 0 and not s["hbm_gbps_given"]
    assert r["roofline_ms"] >= r["backbone_roofline_ms"] > 0 and r["frames_roofline_ms"] > 0


def test_model_spec_forms_and_refusals(tmp_path: Path) -> None:
    from pdunit.engine.model.loader import load_model, save_model

    a, b = step.load_bench_model("random:csm-tiny:3", 0, "cpu"), step.load_bench_model("csm-tiny", 3, "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert a.frame_generator is not None
    save_model(load_model("random:tiny:0"), str(tmp_path / "ckpt"))
    doc = step.run_step(step.StepConfig(model=str(tmp_path / "ckpt"), device="cpu", page_size=4, batches=[1],
                                        contexts=[9], iters=1, warmup=0, overlap="on"))
    assert doc["rows"][0]["frames"] == 1
    for bad, match in (("random:csm-tiny", "random:<shape>:<seed>"), ("nope", "none of a shape.*csm-1b-shape"),
                       (str(tmp_path), "--model: .* is neither .* nor a directory holding config.json")):
        with pytest.raises(SystemExit, match=match):
            step.load_bench_model(bad, 0, "cpu")
    with pytest.raises(SystemExit, match="--hbm-gbps and --matrix-tflops must be >= 0"):
        step.run_step(step.StepConfig(model="tiny", device="cpu", hbm_gbps=-1))


@pytest.mark.gpu
def test_gpu_run_of_csm_replays_both_graphs_and_times_them_apart() -> None:
    """csm-1b-shape at two small points: every step's backbone and frames are graph
    replays, and the whole step's device time and its two parts are measured."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    doc = step.run_step(step.StepConfig(model="random:csm-1b-shape:0", batches=[1, 8], contexts=[64], iters=4,
                                        warmup=1, copy_gib=0.5, compare=["8x64"], overlap="both"))
    for r in doc["rows"]:
        where = f"{r['batch']}x64 overlap={r['overlap']}"
        assert (r["graph_steps"], r["eager_steps"], r["frame_graph_steps"], r["frame_eager_steps"]) == (4, 0, 4, 0), where
        assert r["frames"] == 4 * r["batch"], where
        assert 0 < r["backbone_gpu_ms"] < r["gpu_ms"] and 0 < r["frames_gpu_ms"] < r["gpu_ms"], where
        assert r["roofline_ms"] > r["frames_roofline_ms"] > 0, where
    s = doc["summary"]
    assert s["depth_passes"] == 31 and s["frame_graph_buckets"] == [1, 2, 4, 8] and s["matrix_tflops"] > 10
    assert s["compare"]["8x64"]["graph_vs_eager_greedy_agree"] > 0.5  # codebook 0 of the head; a bug: ~1/2051
