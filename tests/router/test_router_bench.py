"""The router bench runs end to end and reports what it measured (no timing asserts)."""

from __future__ import annotations

from pdunit.bench.router_bench import format_table, run


def test_router_bench_reports_decision_percentiles_per_request_kind() -> None:
    result = run(n_units=20, n_requests=3000, print_table=False)
    rows = {r["requests"]: r for r in result["rows"]}
    assert rows["all"]["n"] == rows["session key"]["n"] + rows["no key"]["n"] == 3000
    for row in rows.values():
        assert 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
    summary = result["summary"]
    # 20 units: one drains, one is unready, one unreachable.
    assert summary["routable_units"] == 17
    assert summary["decision_p99_us"] == rows["all"]["p99_us"]
    shares = (
        summary["share_affinity"]
        + summary["share_walked_past_bound"]
        + summary["share_least_loaded"]
    )
    assert abs(shares - 1.0) < 1e-3
    assert {"bench", "machine", "command", "config", "rows", "summary"} <= set(result)
    assert "| session key |" in format_table(result)
