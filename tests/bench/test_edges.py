"""The LB validate+pack benchmark runs and reports one row per body format (no timing asserts)."""

from __future__ import annotations

import json

from pdunit.bench.edges import main, run_edges


def test_run_edges_times_json_and_both_binary_dtypes():
    doc = run_edges({"rows": 200, "iterations": 20, "others": False})
    assert [r["format"] for r in doc["rows"]] == ["json", "binary-int32", "binary-int64"]
    for row in doc["rows"]:
        assert row["rows"] == 200 and row["cols"] == 11 and row["iterations"] == 20
        assert 0 < row["min_us"] <= row["median_us"] <= row["p99_us"]
        assert row["target_median_us"] in (100.0, 2000.0)
    assert set(doc["summary"]) >= {"lb_validate_pack_json_median_us", "all_within_target"}


def test_edges_main_writes_results_beside_a_markdown_table(tmp_path, capsys):
    main(["--rows", "50", "--iterations", "10", "--no-others", "--out", str(tmp_path / "edges.json")])
    out = capsys.readouterr().out
    assert "lb_validate_pack" in out and "command: pdunit bench edges --rows 50" in out
    doc = json.loads((tmp_path / "edges.json").read_text())
    assert doc["bench"] == "edges" and len(doc["rows"]) == 3 and "machine" in doc
    assert (tmp_path / "edges.md").exists()


def test_edges_also_report_router_and_scaler_latency():
    doc = run_edges({"rows": 50, "iterations": 10, "units": 5})
    edges = {r["edge"] for r in doc["rows"]}
    assert {"lb_validate_pack", "router_decision", "keda_get_metrics"} <= edges
    router = next(r for r in doc["rows"] if r["edge"] == "router_decision")
    assert 0 < router["median_us"] <= router["p99_us"]
