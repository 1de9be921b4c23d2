"""`pdunit bench compare`: variants side by side in one run, ratios of the headline claims."""

from __future__ import annotations

import json

import pytest

from pdunit.bench.compare import CompareConfig, levels_for, ratios, run_compare


def test_ratios_use_capacity_per_gpu_and_the_best_chunk_size():
    r = ratios({"1p1d": 150.0, "monolith-prefill-first": 40.0, "monolith-chunked-8192": 60.0,
                "monolith-chunked-512": 160.0})
    assert r["pd_over_prefill_first"] == 3.75
    assert r["pd_over_chunk_8192"] == 2.5
    assert r["best_chunked"] == "monolith-chunked-512"
    assert r["pd_over_best_chunked"] == round(150 / 160, 3)


def test_ratios_are_none_when_a_variant_has_no_capacity():
    r = ratios({"1p1d": 10.0, "monolith-prefill-first": None})
    assert r["pd_over_prefill_first"] is None and r["pd_over_best_chunked"] is None


def test_compare_runs_every_variant_in_one_results_file(tmp_path):
    out = tmp_path / "capacity.json"
    doc = run_compare(CompareConfig(variants="1p1d,monolith-prefill-first", concurrency="1", duration=2,
                                    prompt_rows="50-100", frames="21-42", pool_tokens=8192, cache_tokens=8192,
                                    ramp=0, out=str(out)), command="test")
    modes = {r["mode"] for r in doc["rows"]}
    assert modes == {"1p1d", "monolith-prefill-first"}
    assert {r["gpus"] for r in doc["rows"] if r["mode"] == "1p1d"} == {2}
    saved = json.loads(out.read_text())
    assert set(saved["summary"]["capacity_per_gpu"]) == modes
    assert all(r["errors"] == 0 for r in saved["rows"])
    # every level carries its waterfall, and the stages account for the client's time
    for row in saved["rows"]:
        stages = {s["stage"] for s in row["waterfall"]}
        assert {"lb_validated", "lb_last_frame_out"} <= stages, stages
        if row["mode"] == "1p1d":
            assert {"prefill_end", "transfer_end", "d_committed"} <= stages, stages
        assert row["waterfall_check"]["streams"] > 0
    for mode in modes:  # P and D of the unit, or the monolith's one loop, each from its own metrics
        row = next(r for r in saved["rows"] if r["mode"] == mode)
        assert row["engine"]["d_step_ms"] > 0 and row["engine"]["p_forward_ms"] > 0, (mode, row["engine"])
        assert row["engine"]["window"] == "steady"  # read over the arrivals, not the drain
    md = out.with_suffix(".md").read_text()
    assert "## Engines per level" in md
    assert "## Waterfalls" in md and "### 1p1d at concurrency 1" in md


def test_each_variant_can_have_its_own_levels():
    cfg = CompareConfig(concurrency="2,4", variant_concurrency="1p1d=64,128; monolith-chunked=32")
    assert levels_for(cfg, "1p1d") == [64, 128]
    assert levels_for(cfg, "monolith-chunked-8192") == [32]
    assert levels_for(cfg, "monolith-prefill-first") == [2, 4]
    with pytest.raises(ValueError, match="unknown variants"):
        levels_for(CompareConfig(variant_concurrency="2p2d=1"), "1p1d")
    with pytest.raises(ValueError, match="is not VARIANT=LEVELS"):
        levels_for(CompareConfig(variant_concurrency="1p1d"), "1p1d")


def test_poisson_levels_per_variant_and_realtime_streams(tmp_path):
    cfg = CompareConfig(rate="2", variant_rate="1p1d=3,4")
    assert levels_for(cfg, "1p1d") == [3.0, 4.0] and levels_for(cfg, "monolith-chunked-2048") == [2.0]
    with pytest.raises(ValueError, match="--variant-rate"):
        levels_for(CompareConfig(variant_rate="1p1d"), "1p1d")
    out = tmp_path / "capacity.json"
    doc = run_compare(CompareConfig(variants="1p1d", rate="3", burst_share=0.5, burst_size=3, duration=3,
                                    prompt_rows="50-100", frames="21-42", pool_tokens=8192, cache_tokens=8192,
                                    ramp=0, out=str(out)), command="test")
    row = doc["rows"][0]
    assert row["rate"] == 3.0 and row["concurrency"] is None and row["ok"] > 0, row
    # listeners = rate x mean audio seconds of the streams that ran (21-42 frames at 21 frames/s)
    mean_frames = row["frames_total"] / row["ok"]
    assert row["realtime_streams"] == round(3.0 * mean_frames / 21.0, 1), row
    assert doc["summary"]["levels"] == "rate"
    if row["passed"]:
        assert doc["summary"]["capacity_per_gpu"]["1p1d"] == 1.5
        assert doc["summary"]["realtime_streams_per_gpu"]["1p1d"] == round(row["realtime_streams"] / 2, 1)
    assert row["waterfall_check"].get("streams", 0) > 0, row["waterfall_check"]  # found by arrival rate
    assert "### 1p1d at rate 3" in out.with_suffix(".md").read_text()


def test_repeated_levels_run_each_with_its_own_seed_and_all_must_pass(tmp_path, monkeypatch):
    """--repeat N: N runs per level (seed, seed+1, ...); one failing run ends the capacity
    below that level. The level outcomes here are scripted: this tests the bookkeeping."""
    from pdunit.bench import compare

    seen: list[tuple[int, int]] = []
    outcome = {(1, 0): True, (1, 1): True, (2, 0): True, (2, 1): False, (3, 0): True, (3, 1): True}

    def fake_run_capacity(cfg, command=None, keep_streams=False, window=None):
        level = cfg.concurrency[0]
        seen.append((level, cfg.seed))
        row = {"mode": cfg.mode_label, "gpus": cfg.gpus, "concurrency": level, "rate": None,
               "passed": outcome[(level, cfg.seed)], "realtime_streams": None}
        return {"rows": [row], "streams": [], "config": {}}

    monkeypatch.setattr(compare, "run_capacity", fake_run_capacity)
    cfg = CompareConfig(concurrency="1,2,3", repeat=2, stop_at_failure=False)
    doc = compare.run_levels(cfg, "monolith-prefill-first", 1, "http://unused", {}, "test")
    assert seen == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert [r["repeat"] for r in doc["rows"]] == [0, 1, 0, 1, 0, 1]
    assert doc["summary"]["capacity"] == 1  # level 2 failed once: 3 cannot count


def test_a_sweep_stops_at_its_first_failing_level_unless_asked_not_to(monkeypatch):
    from pdunit.bench import compare

    seen: list[int] = []

    def fake_run_capacity(cfg, command=None, keep_streams=False, window=None):
        seen.append(cfg.concurrency[0])
        row = {"mode": cfg.mode_label, "gpus": cfg.gpus, "concurrency": cfg.concurrency[0], "rate": None,
               "passed": cfg.concurrency[0] < 2, "realtime_streams": None}
        return {"rows": [row], "streams": [], "config": {}}

    monkeypatch.setattr(compare, "run_capacity", fake_run_capacity)
    doc = compare.run_levels(CompareConfig(concurrency="1,2,3,4"), "1p1d", 2, "http://unused", {}, "test")
    assert seen == [1, 2] and doc["summary"]["capacity"] == 1
    seen.clear()
    compare.run_levels(CompareConfig(concurrency="1,2,3,4", stop_at_failure=False), "1p1d", 2, "http://unused",
                       {}, "test")
    assert seen == [1, 2, 3, 4]
