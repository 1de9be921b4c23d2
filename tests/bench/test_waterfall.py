"""The waterfall: stage gaps from stamped timestamps, and the adds-up check."""

from __future__ import annotations

from pdunit.bench.waterfall import WaterfallConfig, analyze, run_waterfall


def synthetic(send: int, gaps_ms: list[float], tail_ms: float) -> dict:
    names = ["lb_received", "lb_validated", "prefill_end", "first_frame_step", "lb_last_frame_out"]
    t, stages = send, {}
    for name, gap in zip(names, gaps_ms, strict=True):
        t += int(gap * 1e6)
        stages[name] = t
    last = (t - send) / 1e9 + tail_ms / 1e3
    return {"send_unix_ns": send, "last_frame_s": last, "final": {"done": True, "stages": stages}}


def test_gaps_are_ordered_and_measured():
    streams = [synthetic(10**18 + i * 10**9, [1, 0.5, 40, 5, 400], 1) for i in range(10)]
    rows, summary = analyze(streams)
    assert [r["stage"] for r in rows] == ["lb_received", "lb_validated", "prefill_end", "first_frame_step",
                                         "lb_last_frame_out", "client_last_frame"]
    prefill = next(r for r in rows if r["stage"] == "prefill_end")
    assert abs(prefill["p50_ms"] - 40) < 1e-6
    assert summary["adds_up"]


def test_unstamped_time_fails_the_check():
    # 100 ms after the LB's last stamp that nobody accounts for: ~20% of the client's time
    streams = [synthetic(10**18 + i * 10**9, [1, 0.5, 40, 5, 400], 100) for i in range(10)]
    _, summary = analyze(streams)
    assert not summary["adds_up"]
    assert summary["unexplained_p95"] > 0.15


def test_local_cpu_unit_waterfall_accounts_for_the_clients_time(tmp_path):
    png = tmp_path / "waterfall.png"
    doc = run_waterfall(WaterfallConfig(requests=10, concurrency=2, prompt_rows="100-200", frames="60",
                                        plot=str(png)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stages = {r["stage"] for r in doc["rows"]}
    for stage in ("lb_validated", "p_admitted", "prefill_end", "transfer_end", "d_committed",
                  "first_frame_step", "lb_first_frame_out", "lb_last_frame_out"):
        assert stage in stages
    s = doc["summary"]
    assert s["streams"] == 10
    # The stamps cover the client's time: at the median within 10%, and never more than
    # it (one clock). The 5% at p95 is the GPU runs' check (bench compare's waterfalls,
    # <= 0.7% there), not this one's: here the client and four engine processes share
    # two cores under the rest of the suite, and one receive descheduled for ~16 ms puts
    # a 320-ms stream past 5% (it failed a clean-clone CI run once, 2026-11-30).
    assert 0.9 <= s["stamped_over_client_p50"] <= 1.0, s
