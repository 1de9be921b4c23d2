"""`pdunit bench compare`: variants side by side in one run, ratios of the headline claims."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdunit.bench.compare import (
    CompareConfig,
    levels_for,
    ratios,
    run_compare,
    variant_units,
    waves,
)


def test_ratios_use_capacity_per_gpu_and_the_best_chunk_size():
    r = ratios({"1p1d": 150.0, "monolith-prefill-first": 40.0, "monolith-chunked-8192": 60.0,
                "monolith-chunked-512": 160.0})
    assert r["pd_over_prefill_first"] == 3.75
    assert r["pd_over_chunk_8192"] == 2.5
    assert r["best_chunked"] == "monolith-chunked-512"
    assert r["pd_over_best_chunked"] == round(150 / 160, 3)


def _row(mode, gpus, rate, passed, run=0):
    return {"mode": mode, "gpus": gpus, "rate": rate, "concurrency": None, "passed": passed, "repeat": run}


def test_capacity_and_ratio_bounds_follow_from_the_level_spacing():
    from pdunit.bench.capacity import CapacityConfig, summarize_run

    rows = [_row("1p1d", 2, 28, True), _row("1p1d", 2, 32, True), _row("1p1d", 2, 36, True),
            _row("1p1d", 2, 36, False, run=1),                     # one failed run fails the level
            _row("monolith-prefill-first", 1, 16, True), _row("monolith-prefill-first", 1, 18, True),
            _row("monolith-chunked-8192", 1, 8, False),            # nothing passed
            _row("1p1d+b", 2, 32, True), _row("1p1d+b", 2, 40, False), _row("1p1d+b", 2, 44, True)]
    bounds = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):  # each variant's own summary, as compare reads them
        mine = [dict(r, realtime_streams=None) for r in rows if r["mode"] == mode]
        bounds.update(summarize_run(mine, CapacityConfig(mode_label=mode, gpus=mine[0]["gpus"]))
                      ["capacity_bounds_per_gpu"])
    assert bounds == {"1p1d": [16.0, 18.0], "monolith-prefill-first": [18.0, None],
                      "monolith-chunked-8192": [0.0, 8.0], "1p1d+b": [16.0, 20.0]}
    r = ratios({k: (lo or None) for k, (lo, _) in bounds.items()}, bounds)
    assert r["pd_over_prefill_first"] == round(16 / 18, 3)
    # prefill-first passed its highest level: the ratio over it has no lower bound but 0
    assert r["ratio_bounds"]["pd_over_prefill_first"] == [0.0, 1.0]
    # chunked passed nothing: no capacity, so no upper bound for a ratio over it
    assert r["ratio_bounds"]["pd_over_chunk_8192"] == [2.0, None] and r["pd_over_chunk_8192"] is None
    assert r["ratio_bounds"]["variant_over_base"] == {"1p1d+b": [round(16 / 18, 3), 1.25]}
    assert "1p2d_over_1p1d" not in r["ratio_bounds"]  # 1p2d did not run


def test_the_results_markdown_quotes_each_ratio_with_its_bounds():
    from pdunit.bench.compare import ratios_markdown

    bounds = {"1p1d": (16.0, 18.0), "monolith-prefill-first": (18.0, None), "1p1d+b": (12.0, 14.0)}
    per_gpu = {k: lo for k, (lo, _) in bounds.items()}
    md = ratios_markdown({"capacity_per_gpu": per_gpu, "capacity_bounds_per_gpu": bounds,
                          **ratios(per_gpu, bounds)})
    assert "| 1p1d | 16 | [16, 18) |" in md and "| monolith-prefill-first | 18 | [18, open) |" in md
    assert "| 1P1D / prefill-first | 0.889 | 0 - 1 |" in md
    assert "| 1p1d+b / 1p1d | 0.75 | 0.667 - 0.875 |" in md
    assert "chunked" not in md  # no chunked variant ran: no row for its ratios


def test_ratios_are_none_when_a_variant_has_no_capacity():
    r = ratios({"1p1d": 10.0, "monolith-prefill-first": None})
    assert r["pd_over_prefill_first"] is None and r["pd_over_best_chunked"] is None


def test_compare_runs_every_variant_in_one_results_file(tmp_path):
    """Both variants, one after the other in this process, at one Poisson level with
    clumps sent by two client processes (the closed-loop levels run in the parallel
    test's children, and in tests/bench/test_capacity.py)."""
    out = tmp_path / "capacity.json"
    doc = run_compare(CompareConfig(variants="1p1d,monolith-prefill-first", rate="3", burst_share=0.5, burst_size=3,
                                    duration=3, prompt_rows="50-100", frames="21-42", pool_tokens=8192,
                                    cache_tokens=8192, ramp=0, client_procs=2, out=str(out)), command="test")
    modes = {r["mode"] for r in doc["rows"]}
    assert modes == {"1p1d", "monolith-prefill-first"}
    gpus = {r["mode"]: r["gpus"] for r in doc["rows"]}
    assert gpus == {"1p1d": 2, "monolith-prefill-first": 1}
    saved = json.loads(out.read_text())
    assert set(saved["summary"]["capacity_per_gpu"]) == modes
    assert set(saved["summary"]["capacity_bounds_per_gpu"]) == modes
    # one level each: a variant that passed it has only a lower bound for its capacity
    passed = {m for m in modes if saved["summary"]["capacity_per_gpu"][m] is not None}
    assert saved["summary"]["capacity_lower_bound_only"] == {m: m in passed for m in modes}
    assert all(r["errors"] == 0 for r in saved["rows"])
    assert doc["summary"]["levels"] == "rate"
    # 3-s levels of 42-frame streams: 3 lifetimes at 42 frames/s would be 3 s, so not short
    assert doc["summary"]["levels_too_short"] == {m: False for m in modes} and doc["summary"]["steady_state_s"] == 3.0
    for row in doc["rows"]:
        assert row["rate"] == 3.0 and row["concurrency"] is None and row["ok"] > 0, row
        assert row["client_lag_p99_ms"] is not None  # sent by two client processes, their lags merged
        # listeners = rate x mean audio seconds of the streams that ran (21-42 frames at 21 frames/s)
        mean_frames = row["frames_total"] / row["ok"]
        assert row["realtime_streams"] == round(3.0 * mean_frames / 21.0, 1), row
        if row["passed"]:
            assert doc["summary"]["capacity_per_gpu"][row["mode"]] == 3.0 / row["gpus"]
            assert doc["summary"]["realtime_streams_per_gpu"][row["mode"]] == round(
                row["realtime_streams"] / row["gpus"], 1)
        # the slowest streams of the level, slowest first, the first being the row's minimum
        slow = row["slowest_streams"]
        assert 0 < len(slow) <= 5 and [s["rate"] for s in slow] == sorted(s["rate"] for s in slow)
        assert slow[0]["rate"] == round(row["min_rate"], 1) and slow[0]["started_s"] >= 0
    # every level carries its waterfall (found by arrival rate), and the stages account for the client's time
    for row in saved["rows"]:
        stages = {s["stage"] for s in row["waterfall"]}
        assert {"lb_validated", "lb_last_frame_out"} <= stages, stages
        if row["mode"] == "1p1d":
            assert {"prefill_end", "transfer_end", "d_committed"} <= stages, stages
        assert row["waterfall_check"]["streams"] > 0
    for mode in modes:  # P and D of the unit, or the monolith's one loop, each from its own metrics
        row = next(r for r in saved["rows"] if r["mode"] == mode)
        assert row["engine"]["d_step_ms"] > 0 and row["engine"]["p_forward_ms"] > 0, (mode, row["engine"])
        assert row["engine"]["lb_lag_mean_ms"] >= 0 and 0 <= row["engine"]["lb_lag_over_20ms"] <= 1, row["engine"]
        assert row["engine"]["window"] == "steady"  # read over the arrivals, not the drain
        assert row["engine"]["p_graph_share"] == 0  # no prefill graphs on the CPU: every forward eager
    pd = next(r for r in saved["rows"] if r["mode"] == "1p1d")["engine"]
    assert pd["p_reserve_ms"] > 0, pd  # P's RESERVE round trips to D
    md = out.with_suffix(".md").read_text()
    assert "## Engines per level" in md and "## Capacity per GPU and ratios" in md
    assert "| 1P1D / prefill-first |" in md
    assert "## Waterfalls" in md and "### 1p1d at rate 3" in md and "### monolith-prefill-first at rate 3" in md


def test_each_variant_can_have_its_own_levels():
    cfg = CompareConfig(concurrency="2,4", variant_concurrency="1p1d=64,128; monolith-chunked=32")
    assert levels_for(cfg, "1p1d") == [64, 128]
    assert levels_for(cfg, "monolith-chunked-8192") == [32]
    assert levels_for(cfg, "monolith-prefill-first") == [2, 4]
    with pytest.raises(ValueError, match="unknown variants"):
        levels_for(CompareConfig(variant_concurrency="2p2d=1"), "1p1d")
    with pytest.raises(ValueError, match="is not VARIANT=LEVELS"):
        levels_for(CompareConfig(variant_concurrency="1p1d"), "1p1d")


def test_poisson_levels_per_variant():
    cfg = CompareConfig(rate="2", variant_rate="1p1d=3,4")
    assert levels_for(cfg, "1p1d") == [3.0, 4.0] and levels_for(cfg, "monolith-chunked-2048") == [2.0]
    with pytest.raises(ValueError, match="--variant-rate"):
        levels_for(CompareConfig(variant_rate="1p1d"), "1p1d")


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


def test_a_sweeps_criteria_are_the_rates_its_rows_were_judged_at(monkeypatch):
    """The unit resolves the floor (a CSM unit: 12.5 Hz, 25 frames/s): the summary's
    criteria say the floor the rows were judged at, not the config's unresolved 42."""
    from pdunit.bench import compare

    def fake_run_capacity(cfg, command=None, keep_streams=False, window=None):
        row = {"mode": cfg.mode_label, "gpus": cfg.gpus, "concurrency": cfg.concurrency[0], "rate": None,
               "passed": True, "realtime_streams": None}
        return {"rows": [row], "streams": [], "config": {"fps": 12.5, "min_rate": 25.0}}

    monkeypatch.setattr(compare, "run_capacity", fake_run_capacity)
    doc = compare.run_levels(CompareConfig(concurrency="1"), "1p1d", 2, "http://unused", {}, "test")
    assert doc["summary"]["criteria"]["min_rate"] == 25.0


def _scripted(monkeypatch, passes):
    """run_capacity replaced by a script: a level passes when `passes(level)`; returns the
    levels run, in order."""
    from pdunit.bench import compare

    seen: list[float] = []

    def fake_run_capacity(cfg, command=None, keep_streams=False, window=None):
        level = cfg.rate[0] if cfg.rate else cfg.concurrency[0]
        seen.append(level)
        row = {"mode": cfg.mode_label, "gpus": cfg.gpus, "concurrency": None if cfg.rate else level,
               "rate": level if cfg.rate else None, "passed": passes(level), "realtime_streams": None}
        return {"rows": [row], "streams": [], "config": {}}

    monkeypatch.setattr(compare, "run_capacity", fake_run_capacity)
    return seen


def test_bracket_adds_levels_above_until_one_fails(monkeypatch):
    from pdunit.bench import compare

    seen = _scripted(monkeypatch, lambda level: level <= 42)
    doc = compare.run_levels(CompareConfig(rate="36,38", bracket=4), "1p1d", 2, "http://unused", {}, "test")
    assert seen == [36, 38, 40, 42, 44]  # the step of the two highest listed levels; stops at 44's failure
    assert doc["summary"]["capacity_rate"] == 42 and doc["config"]["rate"] == [36, 38, 40, 42, 44]
    seen.clear()
    compare.run_levels(CompareConfig(rate="36,38", bracket=2), "1p1d", 2, "http://unused", {}, "test")
    assert seen == [36, 38, 40, 42]  # at most --bracket levels, even with the bracket still open


def test_bracket_adds_levels_below_until_one_passes(monkeypatch):
    from pdunit.bench import compare

    seen = _scripted(monkeypatch, lambda level: level <= 11)
    doc = compare.run_levels(CompareConfig(rate="13,14", bracket=3, bracket_step=1), "monolith-prefill-first", 1,
                             "http://unused", {}, "test")
    assert seen == [13, 12, 11]  # 13 failed (14 skipped), then down by --bracket-step to the first pass
    assert doc["summary"]["capacity_rate"] == 11
    seen = _scripted(monkeypatch, lambda level: False)
    compare.run_levels(CompareConfig(concurrency="2,4", bracket=5), "monolith-prefill-first", 1, "http://unused",
                       {}, "test")
    assert seen == [2]  # nothing below 2 - 2: levels stay positive


def test_bracket_adds_nothing_when_the_listed_levels_bracket_the_capacity(monkeypatch):
    from pdunit.bench import compare

    seen = _scripted(monkeypatch, lambda level: level < 3)
    compare.run_levels(CompareConfig(concurrency="1,2,3,4", bracket=3), "1p1d", 2, "http://unused", {}, "test")
    assert seen == [1, 2, 3]
    seen = _scripted(monkeypatch, lambda level: level != 2)  # swept past a failure: 2 caps the capacity
    compare.run_levels(CompareConfig(concurrency="1,2,3", bracket=3, stop_at_failure=False), "1p1d", 2,
                       "http://unused", {}, "test")
    assert seen == [1, 2, 3]


def test_bracket_needs_a_step_it_can_use():
    from pdunit.bench import compare

    with pytest.raises(SystemExit, match="1p1d has one level .*--bracket-step"):
        compare.bracket_step(CompareConfig(rate="38", bracket=2), "1p1d", [38.0], up=True)
    with pytest.raises(SystemExit, match="closed-loop levels are whole streams"):
        compare.bracket_step(CompareConfig(concurrency="8", bracket=2, bracket_step=0.5), "1p1d", [8], up=True)
    assert compare.bracket_step(CompareConfig(rate="38", bracket=2, bracket_step=2), "1p1d", [38.0], up=True) == 2


def test_a_waves_child_brackets_as_its_parent_was_asked_to():
    from pdunit.bench.compare import child_config
    from pdunit.engine.settings import to_argv

    cfg = CompareConfig(variants="1p1d,monolith-prefill-first", device="cuda", parallel_gpus=2,
                        variant_rate="1p1d=38,40;monolith-prefill-first=13", bracket=2, bracket_step=1)
    argv = to_argv(child_config(cfg, "monolith-prefill-first", 0, Path("/tmp/b.json")))
    assert "--bracket=2" in argv and "--bracket-step=1.0" in argv


def test_a_bracket_without_a_step_stops_the_compare_before_any_unit_starts(monkeypatch):
    from pdunit.bench import compare

    def no_unit(*args, **kwargs):
        raise AssertionError("no unit may start")

    monkeypatch.setattr(compare, "run_variant", no_unit)
    cfg = CompareConfig(variants="1p1d,monolith-prefill-first", variant_rate="1p1d=38;monolith-prefill-first=12,14",
                        bracket=1)
    with pytest.raises(SystemExit, match="1p1d has one level"):
        compare.run_compare(cfg, "test")


def _names(plan):
    return [[name for name, _, _ in wave] for wave in plan]


def test_waves_pack_variants_in_order_into_the_gpus_given():
    units = variant_units(CompareConfig(variants="1p1d,monolith-prefill-first,monolith-chunked",
                                        chunks="2048,8192"))
    assert _names(waves(units, 1)) == [["1p1d"], ["monolith-prefill-first"], ["monolith-chunked-2048"],
                                       ["monolith-chunked-8192"]]
    assert _names(waves(units, 2)) == [["1p1d"], ["monolith-prefill-first", "monolith-chunked-2048"],
                                       ["monolith-chunked-8192"]]
    assert _names(waves(units, 3)) == [["1p1d", "monolith-prefill-first"],
                                       ["monolith-chunked-2048", "monolith-chunked-8192"]]
    assert _names(waves(units, 5)) == [["1p1d", "monolith-prefill-first", "monolith-chunked-2048",
                                        "monolith-chunked-8192"]]


def test_a_variant_needing_more_gpus_than_given_runs_alone():
    units = variant_units(CompareConfig(variants="monolith-prefill-first,1p2d,monolith-chunked", chunks="64"))
    assert _names(waves(units, 2)) == [["monolith-prefill-first"], ["1p2d"], ["monolith-chunked-64"]]


def test_a_variant_listed_twice_is_refused():
    with pytest.raises(SystemExit, match="monolith-chunked-64"):
        variant_units(CompareConfig(variants="monolith-chunked", chunks="64,64"))


def test_devices_start_at_gpu_base():
    units = {name: unit for name, _, unit in
             variant_units(CompareConfig(variants="1p1d,1p2d,monolith-prefill-first", device="cuda", gpu_base=1))}
    assert units["monolith-prefill-first"].device == "cuda:1"
    assert (units["1p1d"].device, units["1p1d"].decode_devices) == ("cuda:1", "cuda:2")
    assert (units["1p2d"].device, units["1p2d"].decode_devices) == ("cuda:1", "cuda:2,cuda:3")
    cpu = variant_units(CompareConfig(variants="1p1d", gpu_base=1))[0][2]
    assert (cpu.device, cpu.decode_devices) == ("cpu", "")


def test_engine_deltas_read_each_levels_graph_shares_and_ps_reserve_time():
    from pdunit.bench.compare import _SERIES, engine_deltas

    before = {key: 0.0 for key in _SERIES}  # what _scrape_all returns: one value per key
    after = dict(before, p_forwards=4, p_forward_s=0.2, p_graph=3, p_reserves=5, p_reserve_s=0.02, p_gaps=2,
                 p_gap_s=0.006, p_eager=1, p_cached_rows=300, p_computed_rows=900, d_steps=10, d_step_s=0.1,
                 d_batch_sum=500, d_graph=9, d_eager=1, d_batch_le_256=8, d_waits=4, d_wait_s=0.2, d_waits_le_50ms=3,
                 d_gc0_s=0.002, d_gc2_s=0.008, lb_gc1_s=0.003, decode_compile_s=0.5, prefill_compile_s=0.25)
    got = engine_deltas(before, after, 2.0)
    assert got == {"p_forward_ms": 50.0, "p_busy": 0.1, "p_graph_share": 0.75, "p_cached_share": 0.25,
                   "p_reserve_ms": 4.0, "p_gap_ms": 3.0,
                   "d_step_ms": 10.0, "d_batch": 50.0, "d_batch_over_256": 0.2, "d_graph_share": 0.9,
                   "d_admit_wait_ms": 50.0, "d_admit_wait_over_50ms": 0.25, "compile_s": 0.75,
                   "d_gc_ms_per_s": 5.0, "lb_gc_ms_per_s": 1.5}  # GC pauses: ms per second of the level
    # D's and the LB's pauses are one series name in two processes: one key each
    assert _SERIES["d_gc2_s"] == _SERIES["lb_gc2_s"] == 'pdunit_gc_pause_seconds_sum{generation="2"}'
    assert "p_graph_share" not in engine_deltas(before, dict(after, p_graph=0, p_eager=0), 2.0)


def test_engine_args_reach_p_and_the_monoliths_only_and_bad_ones_stop_the_run(capsys):
    cfg = CompareConfig(variants="1p1d,1p2d,monolith-prefill-first,monolith-chunked", chunks="64",
                        prefill_args="--max-batch-rows=2048 --transfer-workers 2", monolith_args="--max-batch=64")
    units = {name: unit for name, _, unit in variant_units(cfg)}
    for name in ("1p1d", "1p2d"):
        assert units[name].extra_prefill_args == ["--max-batch-rows=2048", "--transfer-workers", "2"]
        assert units[name].extra_monolith_args == []
    units["1p1d"].extra_prefill_args.append("--metrics-port=1")  # as run_variant does: one unit's own list
    assert units["1p2d"].extra_prefill_args[-1] == "2"
    for name in ("monolith-prefill-first", "monolith-chunked-64"):
        assert (units[name].extra_monolith_args, units[name].extra_prefill_args) == (["--max-batch=64"], [])
    with pytest.raises(SystemExit, match="--prefill-args '--max-batch-rowz=1' is not a valid set of flags for P"):
        variant_units(CompareConfig(variants="1p1d", prefill_args="--max-batch-rowz=1"))
    assert "unrecognized arguments: --max-batch-rowz=1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--monolith-args '--max-batch=0' is not a valid set of flags for the mono"):
        variant_units(CompareConfig(variants="monolith-prefill-first", monolith_args="--max-batch=0"))
    assert "invalid max_batch (from --max-batch)" in capsys.readouterr().err


def test_a_labelled_copy_runs_its_variant_with_its_own_flags_beside_it():
    from pdunit.bench.compare import child_config

    cfg = CompareConfig(variants="1p1d,1p1d + b2k,monolith-chunked,monolith-chunked+big", chunks="64,128",
                        prefill_args="--transfer-workers=2", monolith_args="--max-batch=64",
                        variant_args="b2k=--max-batch-rows=2048; big=--max-batch=128",
                        variant_rate="1p1d=10,20;1p1d+b2k=5;monolith-chunked=3")
    units = {name: unit for name, _, unit in variant_units(cfg)}
    assert list(units) == ["1p1d", "1p1d+b2k", "monolith-chunked-64", "monolith-chunked-128",
                           "monolith-chunked-64+big", "monolith-chunked-128+big"]
    assert units["1p1d"].extra_prefill_args == ["--transfer-workers=2"]
    assert units["1p1d+b2k"].extra_prefill_args == ["--transfer-workers=2", "--max-batch-rows=2048"]
    assert units["monolith-chunked-128+big"].extra_monolith_args == ["--max-batch=64", "--max-batch=128"]
    assert units["monolith-chunked-128+big"].chunk_tokens == 128
    # levels: a copy's own entry, else its variant's
    assert levels_for(cfg, "1p1d+b2k") == [5.0] and levels_for(cfg, "monolith-chunked-64+big") == [3.0]
    # a parallel wave's child runs exactly that copy
    child = child_config(cfg, "monolith-chunked-128+big", 1, Path("/tmp/x.json"))
    (name, _, unit), = variant_units(child)
    assert (name, unit.extra_monolith_args, unit.chunk_tokens) == ("monolith-chunked-128+big",
                                                                    ["--max-batch=64", "--max-batch=128"], 128)
    # a copy's D flags: after --decode-args, its P's untouched; its child gets them too
    cfg = CompareConfig(variants="1p1d,1p1d+p16,1p1d+both", decode_args="--max-batch=64",
                        variant_decode_args="p16=--page-size=16 --overlap;both=--max-batch=32",
                        variant_args="both=--max-batch-rows=2048")
    units = {name: unit for name, _, unit in variant_units(cfg)}
    assert units["1p1d"].extra_decode_args == ["--max-batch=64"]
    assert units["1p1d+p16"].extra_decode_args == ["--max-batch=64", "--page-size=16", "--overlap"]
    assert units["1p1d+p16"].extra_prefill_args == []
    assert units["1p1d+both"].extra_decode_args == ["--max-batch=64", "--max-batch=32"]
    assert units["1p1d+both"].extra_prefill_args == ["--max-batch-rows=2048"]
    child = child_config(cfg, "1p1d+p16", 0, Path("/tmp/y.json"))
    (name, _, unit), = variant_units(child)
    assert (name, unit.extra_decode_args) == ("1p1d+p16", ["--max-batch=64", "--page-size=16", "--overlap"])
    # copies do not enter the headline ratios; each is reported over its variant
    got = ratios({"1p1d": 16.0, "1p1d+b2k": 12.0, "monolith-chunked-64": 8.0, "monolith-chunked-64+big": 10.0})
    assert got["best_chunked"] == "monolith-chunked-64" and got["pd_over_best_chunked"] == 2.0
    assert got["variant_over_base"] == {"1p1d+b2k": 0.75, "monolith-chunked-64+big": 1.25}
    assert "variant_over_base" not in ratios({"1p1d": 16.0})


@pytest.mark.parametrize("kw, message", [
    (dict(variants="1p1d+x"), r"labels \['x'\] that neither --variant-args nor --variant-decode-args defines"),
    (dict(variants="1p1d", variant_decode_args="x=--max-batch=9"),
     r"--variant-decode-args defines labels \['x'\] that no variant"),
    (dict(variants="monolith-prefill-first+x", variant_decode_args="x=--max-batch=9"),
     r"monolith-prefill-first\+x is a monolith, it has no D"),
    (dict(variants="1p1d+x", variant_decode_args="x=--page-size=0"),
     "--variant-decode-args x '--page-size=0' is not a valid set of flags for D"),
    (dict(variants="1p1d", variant_args="x=--max-batch-rows=1"), r"defines labels \['x'\] that no variant"),
    (dict(variants="1p1d+"), "has an empty label"),
    (dict(variants="2p1d+x", variant_args="x=--a"), "unknown variant '2p1d\\+x'"),
    (dict(variants="1p1d+x", variant_args="x"), "'x' is not LABEL=FLAGS"),
    (dict(variants="1p1d+x", variant_args="x=--a=1;x=--b=2"), "defines 'x' twice"),
    (dict(variants="1p1d+x", variant_args="x=--max-batch=3"), "--variant-args x '--max-batch=3' is not a valid set "
                                                             "of flags for P"),
])
def test_bad_labelled_copies_stop_the_run_naming_what_is_wrong(kw, message, capsys):
    with pytest.raises(SystemExit, match=message):
        variant_units(CompareConfig(**kw))


def test_parallel_variants_run_in_processes_of_their_own_into_one_results_file(tmp_path, short_dir, capsys):
    out = tmp_path / "capacity.json"
    run = Path(short_dir) / "run"  # the variants' sockets: tmp_path can be too long for them
    # the chunked monolith as a labelled copy: its child gets the label's flags (logging
    # at info shows them in its resolved config)
    doc = run_compare(CompareConfig(variants="monolith-prefill-first,monolith-chunked+b", chunks="64",
                                    variant_args="b=--log-level=info --max-batch=32",
                                    parallel_gpus=2, concurrency="1", duration=2, prompt_rows="50-100",
                                    frames="21-42", pool_tokens=8192, cache_tokens=8192, ramp=0,
                                    run_dir=str(run), out=str(out)), command="test")
    names = ["monolith-prefill-first", "monolith-chunked-64+b"]
    assert [r["mode"] for r in doc["rows"]] == names
    assert all(r["gpus"] == 1 and r["engine"]["d_step_ms"] > 0 and r["waterfall"] for r in doc["rows"])
    # the engine's and the LB's GC pauses per level (settled for serving, a process may
    # not collect at all in a 2-s level; tests/engine/test_gc_pauses.py checks the export)
    assert all(r["engine"]["d_gc_ms_per_s"] >= 0 and r["engine"]["lb_gc_ms_per_s"] >= 0 for r in doc["rows"])
    saved = json.loads(out.read_text())
    assert saved["summary"]["waves"] == [names]
    assert set(saved["summary"]["capacity_per_gpu"]) == set(names)
    assert saved["config"]["parallel_gpus"] == 2
    assert [r["mode"] for r in saved["rows"]] == names
    assert doc["files"] == [str(out), str(out.with_suffix(".md"))]
    assert "### monolith-chunked-64+b at concurrency 1" in out.with_suffix(".md").read_text()
    for name in names:  # each child kept its unit's logs under <run_dir>/<variant>
        assert (run / name / "logs").is_dir()
    assert '"max_batch": 32' in (run / names[1] / "logs" / "monolith.log").read_text()
    assert "resolved config" not in (run / names[0] / "logs" / "monolith.log").read_text()
    assert saved["summary"]["variant_over_base"] == {"monolith-chunked-64+b": None}  # its variant did not run
    printed = capsys.readouterr().out
    assert "waves: [monolith-prefill-first | monolith-chunked-64+b]" in printed
    assert "== monolith-chunked-64+b (running alongside monolith-prefill-first on cpu)" in printed
    assert "== monolith-prefill-first: output of its process" in printed


@pytest.mark.timeout(180)  # a wave that waits on its stopped children hangs: the timeout fails it
def test_a_failing_child_names_its_variant_and_stops_the_wave():
    with pytest.raises(SystemExit, match=r"variant monolith-\S+ failed \(exit code") as exc:
        run_compare(CompareConfig(model="random:nope:0", variants="monolith-prefill-first,monolith-chunked",
                                  chunks="64", parallel_gpus=2, concurrency="1", duration=2), command="test")
    assert "end of its log" in str(exc.value)


def test_a_run_cut_short_keeps_the_variants_it_finished_marked_partial(tmp_path, monkeypatch):
    from pdunit.bench import compare

    def fake_variant(cfg, name, gpus, unit_cfg, command):
        if name == "monolith-chunked-64":
            raise KeyboardInterrupt  # the device call's limit, in the second wave
        row = {"mode": name, "gpus": gpus, "concurrency": 1, "passed": True, "repeat": 0}
        return {"rows": [row], "summary": {"capacity_per_gpu": {name: 1.0}}}

    monkeypatch.setattr(compare, "run_variant", fake_variant)
    out = tmp_path / "capacity.json"
    with pytest.raises(KeyboardInterrupt):
        run_compare(CompareConfig(variants="monolith-prefill-first,monolith-chunked", chunks="64", concurrency="1",
                                  out=str(out)), command="test")
    saved = json.loads(out.read_text())
    assert [r["mode"] for r in saved["rows"]] == ["monolith-prefill-first"]
    assert saved["summary"]["capacity_per_gpu"] == {"monolith-prefill-first": 1.0}
    assert saved["summary"]["partial"] == "1 of 2 variants run so far"


def test_stream_lengths_default_to_benchmarks_md_on_a_gpu_and_short_on_cpu():
    from pdunit.bench.compare import stream_frames

    assert stream_frames(CompareConfig(device="cuda")) == "105-630"
    assert stream_frames(CompareConfig()) == "105-210"
    assert stream_frames(CompareConfig(device="cuda", frames="105-420")) == "105-420"
    from pdunit.bench.compare import resolved_config

    assert resolved_config(CompareConfig(device="cuda")) == {
        **CompareConfig(device="cuda").model_dump(), "frames": "105-630", "client_procs": 4}


def test_decode_args_reach_every_d_and_are_checked_on_the_runs_device(capsys):
    cfg = CompareConfig(variants="1p1d,1p2d,monolith-prefill-first", decode_args="--max-batch=128")
    units = {name: unit for name, _, unit in variant_units(cfg)}
    assert units["1p1d"].extra_decode_args == units["1p2d"].extra_decode_args == ["--max-batch=128"]
    assert units["monolith-prefill-first"].extra_decode_args == []
    # a pool sized to the device needs a GPU: refused here, on a cpu run, before anything starts
    with pytest.raises(SystemExit, match="--decode-args '--pool-tokens=0' is not a valid set of flags for D"):
        variant_units(CompareConfig(variants="1p1d", decode_args="--pool-tokens=0"))
    assert "invalid pool_tokens (from --pool-tokens)" in capsys.readouterr().err
    gpu = CompareConfig(variants="1p1d", device="cuda", decode_args="--pool-tokens=0")
    assert variant_units(gpu)[0][2].extra_decode_args == ["--pool-tokens=0"]


def test_a_waves_child_gets_its_own_levels_when_other_waves_run_labelled_copies():
    """--variant-rate names copies of every wave; a child runs one variant, so it gets that
    variant's levels alone (on the H200s the children refused the other waves' entries,
    and a labelled chunked copy's entry, and the run lost its monoliths)."""
    from pdunit.bench.compare import child_config

    cfg = CompareConfig(variants="1p1d+fp8,monolith-prefill-first+kv8,monolith-chunked+kv8", chunks="8192",
                        device="cuda", parallel_gpus=2, variant_args="fp8=--kv-cache-dtype=fp8_e4m3;kv8=--max-batch=64",
                        variant_decode_args="fp8=--kv-cache-dtype=fp8_e4m3",
                        variant_rate="1p1d+fp8=34,38;monolith-prefill-first+kv8=12,14;monolith-chunked+kv8=10")
    got = {}
    for name, _, _ in variant_units(cfg):
        child = child_config(cfg, name, 0, Path("/tmp/z.json"))
        (child_name, _, _), = variant_units(child)
        assert child_name == name
        got[name] = levels_for(child, child_name)
    assert got == {"1p1d+fp8": [34.0, 38.0], "monolith-prefill-first+kv8": [12.0, 14.0],
                   "monolith-chunked-8192+kv8": [10.0]}
    # a misspelt entry still stops the whole run, before any unit starts
    with pytest.raises(ValueError, match="unknown variants"):
        levels_for(cfg.model_copy(update={"variant_rate": "1p1d+fp9=3"}), "1p1d+fp8")


def test_one_label_can_run_a_whole_family_and_its_ratios_are_reported_among_themselves():
    from pdunit.bench.compare import ratios_markdown

    cfg = CompareConfig(variants="1p1d+fp8,monolith-prefill-first+fp8,monolith-chunked+fp8", chunks="8192",
                        variant_args="fp8=--kv-cache-dtype=fp8_e4m3", variant_decode_args="fp8=--max-batch=64")
    units = {name: unit for name, _, unit in variant_units(cfg)}
    assert units["1p1d+fp8"].extra_prefill_args == ["--kv-cache-dtype=fp8_e4m3"]
    assert units["1p1d+fp8"].extra_decode_args == ["--max-batch=64"]
    for name in ("monolith-prefill-first+fp8", "monolith-chunked-8192+fp8"):  # --variant-args only: no D
        assert units[name].extra_monolith_args == ["--kv-cache-dtype=fp8_e4m3"]
    per_gpu = {"1p1d+fp8": 19.0, "monolith-prefill-first+fp8": 12.0, "monolith-chunked-8192+fp8": 10.0}
    bounds = {"1p1d+fp8": [19.0, 20.0], "monolith-prefill-first+fp8": [12.0, 14.0],
              "monolith-chunked-8192+fp8": [10.0, 12.0]}
    got = ratios(per_gpu, bounds)
    assert got["pd_over_prefill_first"] is None  # the headline is of the variants as they are
    assert got["label_ratios"] == {"fp8": {"pd_over_prefill_first": 1.583, "pd_over_chunk_8192": 1.9,
                                           "pd_over_best_chunked": 1.9}}
    assert got["ratio_bounds"]["label_ratios"]["fp8"]["pd_over_prefill_first"] == [1.357, 1.667]
    text = ratios_markdown({**got, "capacity_per_gpu": per_gpu, "capacity_bounds_per_gpu": bounds})
    assert "| 1P1D / prefill-first, both +fp8 | 1.583 | 1.357 - 1.667 |" in text
    # a copy alone (no other variant with its label) has no family ratios
    assert "label_ratios" not in ratios({"1p1d": 16.0, "1p1d+b2k": 12.0})


def test_serving_compiles_are_read_once_per_engine_process(monkeypatch):
    """The monolith's one process exports both D's and P's series; its compile seconds
    must count once, and a PD unit's P and D each once."""
    from pdunit.bench import compare

    serving = 'pdunit_kernel_compile_seconds_total{phase="serving"}'
    by_port = {1: {serving: 2.0}, 2: {serving: 0.5}, 3: {serving: 0.25}}
    monkeypatch.setattr(compare.report, "scrape_metrics", lambda port: by_port[port])
    zero = {key: 0.0 for key in compare._SERIES}
    mono = compare._scrape_all({"monolith": 1})
    assert compare.engine_deltas(zero, mono, 1.0)["compile_s"] == 2.0
    pd = compare._scrape_all({"decode": 2, "prefill": 3})
    assert compare.engine_deltas(zero, pd, 1.0)["compile_s"] == 0.75


def test_each_level_keeps_the_admissions_refusals_and_its_state_at_the_windows_end(monkeypatch):
    """Why a level refused: the refusals over the window (deltas) and the admission's
    gauges at its end (the step model's terms, under-prediction, feedback, headroom),
    read from D or the monolith only, and shown as a table."""
    from pdunit.bench import compare

    decode = {"pdunit_rate_floor_refusals_total": 7.0, "pdunit_rate_floor_life_refusals_total": 2.0,
              "pdunit_rate_floor_headroom_streams": 3.0, "pdunit_step_model_under_prediction": 1.25,
              "pdunit_rate_floor_feedback_factor": 0.9, 'pdunit_step_model_coefficient_ms{term="per_token_ms"}': 2e-5,
              'pdunit_step_model_coefficient_ms{term="stall_per_stream_ms"}': 0.05}
    prefill = {"pdunit_rate_floor_headroom_streams": 99.0}  # P exports no admission: never read from it
    monkeypatch.setattr(compare.report, "scrape_metrics", lambda port: {2: decode, 3: prefill}[port])
    before = {key: 0.0 for key in compare._SERIES} | {"d_refusals": 4.0, "d_life_refusals": 1.0}
    got = compare.engine_deltas(before, compare._scrape_all({"decode": 2, "prefill": 3}), 1.0)
    assert {k: v for k, v in got.items() if k.startswith(("adm_", "d_ref", "d_life"))} == {
        "d_refusals": 3.0, "d_life_refusals": 1.0, "adm_headroom": 3.0, "adm_under_prediction": 1.25,
        "adm_feedback": 0.9, "adm_per_token_ms": 2e-5, "adm_stall_per_stream_ms": 0.05}
    assert "d_refusals" not in compare.engine_deltas(before, before, 1.0)  # none refused: no column
    table = compare.admission_markdown([{"mode": "monolith-prefill-first", "rate": 28.0, "concurrency": None, "engine": got}])
    assert table[-1].startswith("| monolith-prefill-first | 28 | 3.0 | 1.0 | 3.0 | 1.25 | 0.9 | - | - | 2e-05 |")
    assert compare.admission_markdown([{"mode": "1p1d", "rate": 2.0, "concurrency": None, "engine": {"d_step_ms": 3.0}}]) == []


def test_host_cpu_shares_per_level_from_proc_stat(tmp_path):
    from pdunit.bench.compare import engine_deltas, host_cpu_ticks

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal (guest fields after are ignored)
    stat.write_text("cpu  100 0 50 800 30 5 5 10 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    before = host_cpu_ticks(str(stat))
    assert before == {"host_total": 1000.0, "host_busy": 160.0, "host_steal": 10.0}
    stat.write_text("cpu  400 0 150 1100 30 15 15 90 0 0\n")
    after = host_cpu_ticks(str(stat))
    got = engine_deltas(before, after, 1.0)
    # 800 ticks passed: 420 busy (user 300, system 100, irq 10, softirq 10), 80 stolen, 300 idle
    assert (got["host_busy"], got["host_steal"]) == (0.525, 0.1)
    assert host_cpu_ticks(str(tmp_path / "missing")) == {}


def test_an_overload_level_runs_after_the_sweep_and_reports_goodput_against_the_variant(tmp_path, monkeypatch):
    """--overload-rate: one Poisson level with clumps per variant after its sweep, kept out
    of its capacity; the summary gives each variant's goodput and refused share there, and
    a labelled copy's (admission on) goodput over its variant's (admission off)."""
    from pdunit.bench import compare

    seen: list[tuple[list[int], list[float], float]] = []

    def fake_run_capacity(cfg, command=None, keep_streams=False, window=None):
        seen.append((cfg.concurrency, cfg.rate, cfg.burst_share))
        on = "+" in cfg.mode_label
        row = {"mode": cfg.mode_label, "gpus": cfg.gpus, "concurrency": cfg.concurrency[0] if cfg.concurrency
               else None, "rate": cfg.rate[0] if cfg.rate else None, "realtime_streams": None,
               "passed": not cfg.rate, "admitted_kept_floor": not cfg.rate or on, "goodput_fps": 900.0 if on else 300.0,
               "refused_share": 0.4 if on and cfg.rate else 0.0, "stutter_share": 0.0 if on else 0.8,
               "min_rate": 45.0 if on else 20.0, "ttfa_p95_ms": 300.0, "refusal_p99_ms": 8.0 if on else None,
               "errors": 0 if on else 7, "error_kinds": {} if on else {"http_429:no_capacity": 7}}
        return {"rows": [row], "streams": [], "config": {}}

    monkeypatch.setattr(compare, "run_capacity", fake_run_capacity)
    cfg = CompareConfig(variants="1p1d,1p1d+floor", variant_decode_args="floor=--rate-floor=42", concurrency="1,2",
                        overload_rate=8.0, out=str(tmp_path / "c.json"))
    docs = {name: compare.run_levels(cfg, name, 2, "http://unused", {}, "test") for name in ("1p1d", "1p1d+floor")}
    assert seen[2] == ([], [8.0], 0.2)  # Poisson at the overload rate, with clumps
    base = docs["1p1d"]
    assert [r["concurrency"] for r in base["rows"]] == [1, 2] and base["summary"]["capacity"] == 2
    assert [r["rate"] for r in base["overload_rows"]] == [8.0] and base["overload_rows"][0]["overload"]
    out = compare.write_results(cfg, docs, compare.waves(variant_units(cfg), 1), "test", partial=False)
    overload = out["summary"]["overload"]
    assert overload["levels"]["1p1d+floor"]["refused_share"] == 0.4
    assert overload["levels"]["1p1d"]["stutter_share"] == 0.8
    assert overload["against_base"] == {"1p1d+floor": {"goodput_over_base": 3.0, "refused_share": 0.4,
                                                       "base_refused_share": 0.0}}
    # a wave's child hands its results file up: the parent reads the overload from its summary
    child = json.loads(Path(out["files"][0]).read_text())
    again = compare.overload_summary({"1p1d+floor": child, "1p1d": docs["1p1d"]})
    assert again["against_base"] == overload["against_base"]
    md = Path(out["files"][1]).read_text()
    assert "## Overload level" in md and "1p1d+floor / 1p1d: goodput x3, refused 40.0% vs 0.0%" in md
    # the errors' kinds are kept: a pool's 429s are not the rate floor's 503s
    assert overload["levels"]["1p1d"]["error_kinds"] == {"http_429:no_capacity": 7}
    assert "| 7 (http_429:no_capacity 7) | False |" in md and "| 0 | True |" in md
