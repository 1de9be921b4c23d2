"""`pdunit bench plan`: the cost fits, the scheduler models, and the capacity they
predict under the rules `bench capacity` judges by."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdunit.bench import plan
from pdunit.engine.loadgen.workload import StreamSpec

STEP = plan.StepCost(base_ms=3.0, per_stream_ms=0.01, per_token_ms=3e-5)
PREFILL = plan.PrefillCost(base_ms=3.0, per_row_ms=0.008, per_pair_ms=2e-6)


def step_rows(cost: plan.StepCost, overlap: bool) -> list[dict]:
    return [{"batch": b, "context": c, "mean_context": c + 7, "overlap": overlap,
             "step_ms": cost.ms(b, b * (c + 7))} for b in (32, 64, 128) for c in (1024, 2048, 4096)]


def prefill_rows(cost: plan.PrefillCost, gemm: str, graphs: bool) -> list[dict]:
    # with --graphs, the points within the largest bucket replayed one
    return [{"gemm": gemm, "graphs": graphs, "replayed": graphs and p * n <= 2048, "prompts": p, "rows": n,
             "ms": cost.ms([(n, 0)] * p)}
            for p, n in ((1, 300), (1, 1500), (2, 1000), (4, 1500), (8, 1000), (1, 700))]


def write_inputs(tmp_path: Path, step: plan.StepCost = STEP, prefill: plan.PrefillCost = PREFILL) -> list[str]:
    step_doc = {"machine": {"gpu_count": 1, "gpu_model": "test"}, "command": "pdunit bench step",
                "rows": step_rows(step, True) + step_rows(step, False)}
    prefill_doc = {"machine": {"gpu_count": 1, "gpu_model": "test"}, "command": "pdunit bench prefill",
                   "rows": prefill_rows(prefill, "fp8", True) + prefill_rows(prefill, "fp8", False)}
    (tmp_path / "step.json").write_text(json.dumps(step_doc))
    (tmp_path / "prefill.json").write_text(json.dumps(prefill_doc))
    return ["--step", str(tmp_path / "step.json"), "--prefill", str(tmp_path / "prefill.json")]


def config(tmp_path: Path, **kw) -> plan.PlanConfig:
    args = dict(zip(["step", "prefill"], write_inputs(tmp_path)[1::2], strict=True))
    return plan.PlanConfig(**args, **kw)


def costs(**kw) -> plan.Costs:
    base = dict(step=STEP, mono_step=STEP, eager=PREFILL, graph=None, graph_prompts=16, admit_s=0.005,
                reserve_s=0.002, handoff_s=0.01, deliver_s=0.001)
    return plan.Costs(**{**base, **kw})


def request(index: int, arrival: float, rows: int = 1000, frames: int = 20, voice: str = "cold",
            reused: bool = False, reference_rows: int = 750) -> plan.Request:
    spec = StreamSpec(index=index, voice=voice, reused=reused, prompt=np.zeros((rows, 1), dtype=np.int64),
                      frames=frames, seed=0)
    return plan.Request(index, arrival, spec, reference_rows)


def test_fits_recover_the_costs_they_were_made_from():
    step = plan.StepCost.fit(step_rows(STEP, True), overlap=True)
    assert (step.base_ms, step.per_stream_ms, step.per_token_ms) == pytest.approx((3.0, 0.01, 3e-5), rel=1e-6)
    assert step.worst_error < 1e-9 and step.points == 9
    pre = plan.PrefillCost.fit(prefill_rows(PREFILL, "fp8", False), "fp8", False)
    assert (pre.base_ms, pre.per_row_ms, pre.per_pair_ms) == pytest.approx((3.0, 0.008, 2e-6), rel=1e-6)


def test_a_graph_forward_is_priced_at_its_bucket_and_a_larger_one_runs_eager():
    buckets = (512, 1024, 2048)
    graph = plan.PrefillCost(1.0, 0.005, 1e-6, buckets=buckets)
    rows = [{"gemm": "fp8", "graphs": True, "replayed": p * n <= 2048, "prompts": p, "rows": n,
             "ms": graph.ms([(n, 0)] * p)} for p, n in ((1, 300), (1, 700), (1, 1500), (2, 1000), (4, 1500))]
    fit = plan.PrefillCost.fit(rows, "fp8", True, buckets)
    assert fit.points == 4  # 4 x 1500 did not replay: it is no graph point
    assert (fit.base_ms, fit.per_row_ms, fit.per_pair_ms) == pytest.approx((1.0, 0.005, 1e-6), rel=1e-6)
    assert graph.ms([(600, 0)]) == pytest.approx(1.0 + 0.005 * 1024 + 1e-6 * 600 * 601 / 2)
    c = costs(graph=graph)
    assert c.forward_ms([(1500, 0)]) == graph.ms([(1500, 0)])
    assert c.forward_ms([(1500, 0), (1000, 0)]) == PREFILL.ms([(1500, 0), (1000, 0)])  # > 2048 rows: eager
    assert c.forward_ms([(100, 0)] * 17) == PREFILL.ms([(100, 0)] * 17)  # more prompts than a graph holds


def test_a_fit_never_makes_a_cost_fall_as_its_term_grows():
    # step time independent of the context: the per-token term would fit slightly negative
    rows = [{"batch": b, "context": c, "overlap": True, "step_ms": 4.0 + 0.02 * b - (1e-7 * b * c if c > 2000 else 0)}
            for b in (16, 64, 128) for c in (1024, 4096)]
    fit = plan.StepCost.fit(rows, overlap=True)
    assert min(fit.base_ms, fit.per_stream_ms, fit.per_token_ms) >= 0
    assert fit.per_token_ms == 0.0


def test_a_fit_with_too_few_points_names_what_is_missing():
    with pytest.raises(ValueError, match="gemm=bf16, replayed from a graph"):
        plan.PrefillCost.fit(prefill_rows(PREFILL, "fp8", True), "bf16", True)
    with pytest.raises(ValueError, match="overlap=False"):
        plan.StepCost.fit(step_rows(STEP, True), overlap=False)


def test_one_pd_request_walks_the_pipeline_stage_by_stage(tmp_path):
    cfg = config(tmp_path)
    c = costs()
    r = request(0, arrival=1.0, rows=1000, frames=4)
    plan.simulate_pd([r], c, 1, cfg)
    commit = 1.0 + c.admit_s + c.reserve_s + PREFILL.ms([(1000, 0)]) / 1e3 + c.handoff_s
    assert r.times[0] == pytest.approx(commit + c.deliver_s)  # P's first frame
    # then one frame per D step, the context growing by one each step
    t = commit
    for k, got in enumerate(r.times[1:]):
        t += STEP.ms(1, 1000 + 1 + k) / 1e3
        assert got == pytest.approx(t + c.deliver_s)
    assert len(r.times) == 4
    stages = plan.stage_percentiles([r], start_frames=3)
    assert stages["p_reserved after p_admitted"]["p50"] == pytest.approx(c.reserve_s * 1e3)
    assert stages["prefill_end after prefill_start"]["p50"] == pytest.approx(PREFILL.ms([(1000, 0)]), abs=1e-3)
    assert stages["d_committed after prefill_end"]["p50"] == pytest.approx(c.handoff_s * 1e3)
    assert stages["start_frames_in after client_send"]["p50"] == pytest.approx((r.times[2] - 1.0) * 1e3, abs=1e-3)


def test_prefill_first_freezes_decoding_streams_for_the_forward_and_pd_does_not(tmp_path):
    cfg = config(tmp_path)
    c = costs()
    early = request(0, arrival=0.0, rows=500, frames=200)
    clump = [request(i, arrival=0.5, rows=2000, frames=10) for i in range(1, 6)]
    plan.simulate_monolith([early, *clump], c, cfg, chunk=None)
    gaps = np.diff(early.times)
    forward = PREFILL.ms([(2000, 0)] * 4) / 1e3  # 4 x 2000 rows fit the 8192-row forward
    assert gaps.max() >= forward  # the decoding stream waited for the clump's prefill
    for r in (early, *clump):
        r.times.clear()
    plan.simulate_pd([early, *clump], c, 1, cfg)
    assert np.diff(early.times).max() < 0.02  # D kept stepping: no gap near a forward's length


def test_a_warm_voice_skips_its_cached_blocks_once_published(tmp_path):
    cfg = config(tmp_path)
    first = request(0, arrival=0.0, voice="voice-1", reused=True, reference_rows=750)
    later = request(1, arrival=1.0, voice="voice-1", reused=True, reference_rows=750)
    plan.simulate_pd([first, later], costs(), 1, cfg)
    ttft = [r.times[0] - r.arrival for r in (first, later)]
    cached = (750 // 16) * 16
    saved = (PREFILL.ms([(1000, 0)]) - PREFILL.ms([(1000 - cached, cached)])) / 1e3
    assert ttft[0] - ttft[1] == pytest.approx(saved)


def test_1p2d_spreads_streams_over_its_decoders(tmp_path):
    cfg = config(tmp_path)
    reqs = [request(i, arrival=0.05 * i, frames=300) for i in range(20)]
    one = [request(i, arrival=0.05 * i, frames=300) for i in range(20)]
    plan.simulate_pd(reqs, costs(), 2, cfg)
    plan.simulate_pd(one, costs(), 1, cfg)
    rate = lambda r: (len(r.times) - 1) / (r.times[-1] - r.times[0])  # noqa: E731
    assert min(map(rate, reqs)) > min(map(rate, one))  # smaller batches per D, faster steps


def test_chunked_monolith_finishes_every_stream_with_all_its_frames(tmp_path):
    cfg = config(tmp_path)
    reqs = [request(i, arrival=0.01 * i, rows=1500, frames=30) for i in range(12)]
    plan.simulate_monolith(reqs, costs(), cfg, chunk=2048)
    assert all(len(r.times) == 30 for r in reqs)
    assert all(np.all(np.diff(r.times) > 0) for r in reqs)


def test_the_plan_judges_by_the_capacity_rules_and_a_faster_prefill_never_lowers_capacity(tmp_path, capsys):
    argv = write_inputs(tmp_path) + ["--variants", "1p1d,1p2d,monolith-prefill-first", "--rate", "4,8,16,32,64",
                                     "--repeat", "1", "--duration", "6", "--ramp", "1",
                                     "--out", str(tmp_path / "plan.json")]
    assert plan.main(argv) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    per_gpu = doc["summary"]["capacity_per_gpu"]
    assert set(per_gpu) == {"1p1d", "1p2d", "monolith-prefill-first"}
    assert doc["summary"]["predicted"] is True
    assert {r["gpus"] for r in doc["rows"] if r["mode"] == "1p2d"} == {3}
    # every row carries the capacity rules' verdict, and a failing level ends the sweep
    for mode in per_gpu:
        passed = [r["passed"] for r in doc["rows"] if r["mode"] == mode]
        assert passed == sorted(passed, reverse=True) and passed.count(False) <= 1
    assert plan.main(argv[:-1] + [str(tmp_path / "fast.json"), "--prefill-scale", "0.5"]) == 0
    fast = json.loads((tmp_path / "fast.json").read_text())["summary"]["capacity_per_gpu"]
    assert all((fast[m] or 0) >= (per_gpu[m] or 0) for m in per_gpu)
    assert "not a measurement" in (tmp_path / "plan.md").read_text()


def test_measured_levels_sit_beside_the_prediction(tmp_path, capsys):
    measured = {"rows": [{"mode": "1p1d", "rate": 4.0, "passed": True}, {"mode": "1p1d", "rate": 8.0, "passed": True},
                         {"mode": "1p1d", "rate": 8.0, "passed": False}]}
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    argv = write_inputs(tmp_path) + ["--variants", "1p1d", "--rate", "4,8", "--repeat", "1", "--duration", "4",
                                     "--ramp", "1", "--no-stop-at-failure", "--measured", str(tmp_path / "measured.json"),
                                     "--out", str(tmp_path / "plan.json")]
    assert plan.main(argv) == 0
    versus = json.loads((tmp_path / "plan.json").read_text())["summary"]["versus_measured"]
    levels = {v["rate"]: v for v in versus["levels"]}
    assert levels[4.0]["measured"] is True and levels[8.0]["measured"] is False  # a failed run fails the level
    assert versus["of"] == 2 and versus["agree"] == sum(v["agree"] for v in versus["levels"])
    assert "levels agree" in capsys.readouterr().out


@pytest.mark.parametrize("flag,value,message", [
    ("--variants", "2p1d", "variant '2p1d'"),
    ("--variant-rate", "1p1d", "--variant-rate"),
])
def test_bad_input_names_the_field(tmp_path, capsys, flag, value, message):
    assert plan.main(write_inputs(tmp_path) + [flag, value]) == 2
    assert message in capsys.readouterr().err


def test_a_monolith_without_a_prefix_cache_recomputes_a_warm_voice(tmp_path):
    cached, uncached = config(tmp_path), config(tmp_path, monolith_cache=False)
    ttft = {}
    for name, cfg in (("cached", cached), ("uncached", uncached)):
        reqs = [request(0, 0.0, voice="voice-1", reused=True), request(1, 1.0, voice="voice-1", reused=True)]
        plan.simulate_monolith(reqs, costs(), cfg, chunk=None)
        ttft[name] = reqs[1].times[0] - reqs[1].arrival
    saved = (PREFILL.ms([(1000, 0)]) - PREFILL.ms([(1000 - 736, 736)])) / 1e3
    assert ttft["uncached"] - ttft["cached"] == pytest.approx(saved)


def test_an_eager_forward_costs_at_least_its_launches():
    # eager forwards of a few hundred rows all take the host's launch time
    rows = [{"gemm": "fp8", "graphs": False, "prompts": p, "rows": n, "ms": max(16.0, 2.0 + 0.01 * p * n)}
            for p, n in ((1, 300), (1, 800), (2, 1500), (4, 1500), (8, 1000))]
    fit = plan.PrefillCost.fit(rows, "fp8", False)
    assert fit.floor_ms == 16.0 and fit.points == 3  # the line is fitted above the floor
    assert (fit.base_ms, fit.per_row_ms) == pytest.approx((2.0, 0.01), rel=1e-6)
    assert fit.ms([(300, 0)]) == 16.0 and fit.ms([(4000, 0)]) == pytest.approx(42.0)
    assert fit.scaled(0.5).ms([(300, 0)]) == 8.0


@pytest.mark.parametrize("variant", ["1p1d", "monolith"])
def test_a_request_the_pool_cannot_hold_is_refused_until_a_stream_ends(tmp_path, variant):
    """Pool of 2500 tokens: the first stream holds 1000 + 200; a clump of 1000-row
    prompts then fits once (2400 held), the rest are refused as the engines refuse
    them (no_capacity), and a request after every stream ended fits again."""
    cfg = config(tmp_path, pool_tokens=2500)
    reqs = [request(0, 0.0, frames=200), *[request(i, 0.5, frames=200) for i in range(1, 4)],
            request(4, 30.0, frames=200)]
    if variant == "1p1d":
        plan.simulate_pd(reqs, costs(), 1, cfg)
    else:
        plan.simulate_monolith(reqs, costs(), cfg, chunk=None)
    assert [r.refused for r in reqs] == [False, False, True, True, False]
    cap = plan.capacity_config(cfg, plan.Variant("x", 1), [1.0]).model_copy(update={"warmup": 0.0})
    row = plan.judge(reqs, cap, 1.0)
    assert row["errors"] == 2 and row["error_kinds"] == {"http_429:no_capacity": 2} and not row["passed"]


def test_a_labelled_familys_run_sits_beside_the_plan_with_measured_labels(tmp_path, capsys):
    measured = {"rows": [{"mode": "1p1d+fp8", "rate": 4.0, "passed": True},
                         {"mode": "monolith-prefill-first+kv8", "rate": 4.0, "passed": False},
                         {"mode": "1p1d", "rate": 4.0, "passed": False}]}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(measured))
    assert plan.measured_levels(str(path), ["fp8", "kv8"]) == {"1p1d": {4.0: True},
                                                               "monolith-prefill-first": {4.0: False}}
    assert plan.measured_levels(str(path)) == {"1p1d": {4.0: False}}  # as they are: the unlabelled rows
    with pytest.raises(ValueError, match=r"1p1d\+fp8 and 1p1d would both be read as 1p1d"):
        plan.measured_levels(str(path), ["", "fp8"])
    with pytest.raises(ValueError, match=r"no rows of \['bf16'\]"):
        plan.measured_levels(str(path), ["bf16"])
    argv = write_inputs(tmp_path) + ["--variants", "1p1d", "--rate", "4", "--repeat", "1", "--duration", "4",
                                     "--ramp", "1", "--measured", str(path), "--measured-labels", "fp8, kv8",
                                     "--out", str(tmp_path / "plan.json")]
    assert plan.main(argv) == 0
    versus = json.loads((tmp_path / "plan.json").read_text())["summary"]["versus_measured"]
    assert versus["labels"] == ["fp8", "kv8"] and [v["measured"] for v in versus["levels"]] == [True]


def test_each_decode_cost_is_needed_only_by_the_variants_that_run_it(tmp_path):
    """`bench step --overlap on` (what --tune emits) has no plain steps: a plan of PD
    alone takes it, a plan with a monolith names what its step JSON lacks."""
    args = write_inputs(tmp_path)
    doc = json.loads((tmp_path / "step.json").read_text())
    doc["rows"] = [r for r in doc["rows"] if r["overlap"]]
    (tmp_path / "step.json").write_text(json.dumps(doc))
    pd_only = plan.PlanConfig(step=args[1], prefill=args[3], variants="1p1d")
    costs_pd, _ = plan.load_costs(pd_only)
    assert costs_pd.step is not None and costs_pd.mono_step is None
    assert plan.describe_costs(costs_pd)["decode_step_monolith"] is None
    with pytest.raises(ValueError, match="0 points with overlap=False"):
        plan.load_costs(plan.PlanConfig(step=args[1], prefill=args[3], variants="1p1d,monolith-prefill-first"))
    write_inputs(tmp_path)  # both kinds of steps again
    mono_only, _ = plan.load_costs(plan.PlanConfig(step=args[1], prefill=args[3], variants="monolith-chunked",
                                                   chunks="512"))
    assert mono_only.step is None and mono_only.mono_step is not None


def test_reserves_sent_together_put_a_clump_into_ps_first_forward(tmp_path):
    """Issue 31: with --reserve-concurrency 1 (P before it) a clump at an idle P starts
    with its first request alone; with 8 its first forward holds all eight, and the
    last of the clump leaves P no later."""
    ends = {}
    for k in (1, 8):
        cfg = config(tmp_path, reserve_concurrency=k)
        clump = [request(i, arrival=1.0, rows=1000, frames=12) for i in range(8)]
        plan.simulate_pd(clump, costs(), 1, cfg)
        starts = sorted({r.stamps["prefill_start"] for r in clump})
        assert len(starts) == (1 if k == 8 else len(starts)) and (k == 8 or len(starts) > 1)
        ends[k] = max(r.stamps["prefill_end"] for r in clump)
    assert ends[8] <= ends[1]


@pytest.mark.parametrize("concurrency", [1, 2])
def test_a_refusal_at_a_busy_p_is_answered_after_its_reserve_not_after_a_forward(tmp_path, concurrency):
    """Issue 24, P's order: D's verdict before the wait for room. P forwards one prompt
    in 200 ms; A is in the forward, B1 fills the next batch, B2 waits for room reserved,
    and C, which no pool holds, arrives during A's forward. With --reserve-concurrency 2
    C is reserved while B2 waits (at the next look at the queue) and refused at once;
    with 1 it waits behind B2, until A's forward ends. C costs P no forward."""
    cfg = config(tmp_path, pool_tokens=2500, max_batch_prompts=1, reserve_concurrency=concurrency)
    c = costs(eager=plan.PrefillCost(base_ms=200.0, per_row_ms=0.0, per_pair_ms=0.0))
    a, b1, b2 = (request(i, at, rows=100, frames=100) for i, at in ((0, 0.0), (1, 0.05), (2, 0.06)))
    late = request(3, 0.1, rows=1000, frames=1000)  # 600 held + 2000 > 2500: no_capacity
    plan.simulate_pd([a, b1, b2, late], c, 1, cfg)
    a_end = a.stamps["prefill_end"]
    # the granted: B2 reserved before the wait for room, into the forward after B1's
    assert b2.stamps["p_reserved"] == pytest.approx(0.06 + c.admit_s + c.reserve_s) and b2.stamps["p_reserved"] < a_end
    assert b1.stamps["prefill_start"] == pytest.approx(a_end)
    assert b2.stamps["prefill_start"] == pytest.approx(b1.stamps["prefill_end"])
    # the refusal: answered its RESERVE's round trip after P took it, never behind a forward
    assert late.refused and not late.times and "prefill_start" not in late.stamps
    taken = late.stamps["p_taken"]
    if concurrency == 2:  # the first look at the queue after it arrived, 5 ms apart
        assert late.stamps["p_admitted"] <= taken <= late.stamps["p_admitted"] + plan._ROOM_POLL_S + 1e-9
        assert taken < a_end
    else:
        assert taken == pytest.approx(a_end)  # behind B2, which waited for A's forward to end
    assert late.stamps["p_reserve_answered"] == pytest.approx(taken + c.reserve_s)
    assert late.answered == pytest.approx(late.stamps["p_reserve_answered"] + c.deliver_s)
    assert len({r.stamps["prefill_start"] for r in (a, b1, b2)}) == 3  # three forwards, none for C
    stages = plan.stage_percentiles([a, b1, b2, late], start_frames=3)
    assert stages["refusal_in after client_send"]["p50"] == pytest.approx((late.answered - 0.1) * 1e3)
    cap = plan.capacity_config(cfg, plan.Variant("x", 2, decoders=1), [1.0]).model_copy(update={"warmup": 0.0})
    assert plan.judge([a, b1, b2, late], cap, 1.0)["error_kinds"] == {"http_429:no_capacity": 1}


def test_p_reserves_on_the_d_with_the_most_free_pool_and_refuses_only_when_none_holds_it(tmp_path):
    """links.reserve at RESERVE: the D's best first (most free pool, then fewest streams),
    the next one on no_capacity. D0 holds one long stream (2400 of 2500 tokens), D1 two
    short ones: the next two go to D1 though it has more streams; a request neither
    holds is refused at its RESERVE and costs P no forward."""
    cfg = config(tmp_path, pool_tokens=2500)
    long = request(0, 0.0, rows=1000, frames=1400)
    short = [request(i, 0.01 * i, rows=100, frames=100) for i in (1, 2)]
    mid = request(3, 0.1, rows=500, frames=500)
    big = request(4, 0.15, rows=1000, frames=1000)  # D0 100 free, D1 1100
    plan.simulate_pd([long, *short, mid, big], costs(), 2, cfg)
    assert [r.refused for r in (long, *short, mid, big)] == [False, False, False, False, True]
    assert all(len(r.times) == r.spec.frames for r in (long, *short, mid))
    assert "prefill_start" not in big.stamps and big.answered is not None


@pytest.mark.timeout(20)
def test_d_idle_after_its_last_stream_takes_a_commit_that_came_during_that_step():
    """A commit during the step that ends D's last stream starts the next step at that
    step's end (the loop once waited for it forever)."""
    c = costs()
    first, second = request(0, 0.0, rows=100, frames=2), request(1, 0.0, rows=100, frames=2)
    step = STEP.ms(1, 101) / 1e3
    plan.simulate_decode([(1.0, first), (1.0 + step / 2, second)], STEP, c, overlap=True)
    assert first.times == pytest.approx([1.0 + c.deliver_s, 1.0 + step + c.deliver_s])
    assert second.times == pytest.approx([1.0 + step / 2 + c.deliver_s, 1.0 + 2 * step + c.deliver_s])


def test_rate_floor_admission_refuses_an_overload_and_keeps_every_admitted_stream_at_the_floor(tmp_path, capsys):
    """A monolith whose steps reach the 42-frames/s budget near 100 streams, at 40
    arrivals/s (ten times the level it passes): without admission the slowest stream
    falls under the floor and no stream keeps it; with --rate-floor 42 the engine's
    verdict refuses about half, each answered at its admission (503 rate_floor), and
    every admitted stream stays at or above 42 in the model."""
    slow = plan.StepCost(base_ms=8.0, per_stream_ms=0.12, per_token_ms=1e-5)
    argv = write_inputs(tmp_path, step=slow) + ["--variants", "monolith-prefill-first", "--rate", "4",
                                                "--overload-rate", "40", "--repeat", "1", "--duration", "6",
                                                "--ramp", "1", "--frames", "105-210"]
    rows = {}
    for floor in ("0", "42"):
        out = tmp_path / f"floor{floor}.json"
        assert plan.main([*argv, "--rate-floor", floor, "--out", str(out)]) == 0
        doc = json.loads(out.read_text())
        [rows[floor]] = [r for r in doc["rows"] if r.get("overload")]
        assert doc["summary"]["overload"]["monolith-prefill-first"]["min_rate"] == rows[floor]["min_rate"]
    off, on = rows["0"], rows["42"]
    assert off["refused"] == 0 and off["min_rate"] < 42 and not off["admitted_kept_floor"]
    assert on["refused"] > 0 and on["errors"] == 0 and on["min_rate"] >= 42 and on["admitted_kept_floor"]
    assert not on["passed"]  # refusing part of a level is the unit's right, and above its capacity
    assert on["goodput_fps"] > off["goodput_fps"]
    assert on["refusal_p99_ms"] == pytest.approx(5.0 + 2.0)  # --admit-ms + --deliver-ms
    assert "monolith-prefill-first at 40/s (--overload-rate, worst of 1 runs): refused" in capsys.readouterr().out
