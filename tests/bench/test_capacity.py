"""run_capacity against a fake LB that streams NDJSON at a controlled frame rate."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn

from pdunit.bench.capacity import CapacityConfig, main, run_capacity
from pdunit.engine.lb.main import _Server, bind_socket
from pdunit.engine.loadgen.driver import StreamResult, summarize_level


@dataclass
class FakeLB:
    """GET /v1/model and POST /v1/tts/stream (binary or JSON body) at `fps` frames/s."""

    fps: float
    ttft_s: float = 0.02
    refuse_every: int = 0  # every n-th request gets 503 before streaming
    refuse_code: str = "draining"  # the 503's error code
    retry_after: str | None = None  # the 503's Retry-After header
    fail_after: int | None = None  # frames before an error record (mid-stream failure)
    frame_rate_hz: float | None = None  # GET /v1/model's real-time frame rate (None: an LB without it)
    requests: int = 0
    max_concurrent: int = 0
    _concurrent: int = 0
    seen_sessions: list[str] = field(default_factory=list)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if scope["path"] == "/v1/model":
            doc: dict[str, Any] = {"n_codebooks": 11, "vocab_sizes": [1024] * 11, "eos_id": None, "max_rows": 4096}
            if self.frame_rate_hz is not None:
                doc.update(frame_rate_hz=self.frame_rate_hz, rate_floor_fps=2 * self.frame_rate_hz)
            await self._json(send, 200, doc)
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.requests += 1
        self.seen_sessions.append(headers.get("x-session-id", ""))
        if self.refuse_every and self.requests % self.refuse_every == 0:
            headers = [(b"retry-after", self.retry_after.encode())] if self.retry_after is not None else []
            await self._json(send, 503, {"error": {"code": self.refuse_code, "message": "fake"}}, headers)
            return
        if headers.get("content-type") == "application/json":
            frames = json.loads(body)["max_frames"]
        else:
            frames = int(headers["x-pdunit-max-frames"])
            assert len(body) % 44 == 0
        self._concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self._concurrent)
        try:
            await asyncio.sleep(self.ttft_s)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")],
                }
            )
            t0 = time.perf_counter()
            for i in range(frames):
                if self.fail_after is not None and i == self.fail_after:
                    await send(
                        {
                            "type": "http.response.body",
                            "more_body": False,
                            "body": b'{"error": {"code": "decode_unavailable", "message": "x"}}\n',
                        }
                    )
                    return
                delay = t0 + i / self.fps - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                line = b'{"i": %d, "frame": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]}\n' % i
                await send({"type": "http.response.body", "body": line, "more_body": True})
            final = json.dumps(
                {"done": True, "reason": "length", "frames": frames, "stages": {}}
            ).encode()
            await send({"type": "http.response.body", "body": final + b"\n", "more_body": False})
        finally:
            self._concurrent -= 1

    async def _json(self, send: Any, status: int, doc: dict, headers: list | None = None) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(doc).encode()})


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[tuple[_Server, threading.Thread]] = []

    def start(app: FakeLB) -> str:
        sock = bind_socket("127.0.0.1", 0)
        server = _Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
        thread = threading.Thread(
            target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True
        )
        thread.start()
        while not server.started:
            time.sleep(0.01)
        started.append((server, thread))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread in started:
        server.should_exit = True
        thread.join(10)


def base_config(url: str, **kw: Any) -> dict[str, Any]:
    cfg = {
        "url": url,
        "concurrency": "2,4",
        "duration": 1.0,
        "prompt_rows": "20-40",
        "frames": "30-40",
        "voices": 2,
        "voice_reuse": 0.5,
        "seed": 1,
        "progress": False,
        "gpus": 2,
        "mode_label": "1p1d",
    }
    cfg.update(kw)
    return cfg


def test_a_fast_unit_shows_no_stutter_and_its_capacity_is_the_top_level(serve, tmp_path):
    fake = FakeLB(fps=200.0)
    url = serve(fake)
    doc = run_capacity(
        base_config(url, out=str(tmp_path), plot=str(tmp_path / "cap.png")), command="test"
    )
    rows = doc["rows"]
    assert [r["concurrency"] for r in rows] == [2, 4]
    for r in rows:
        assert r["streams"] > 0 and r["errors"] == 0
        assert r["stutter_share"] == 0.0
        assert r["min_rate"] > 100 and r["p1_rate"] >= r["min_rate"]
        assert 20 <= r["ttft_p50_ms"] < 500 and r["ttfa_p50_ms"] > r["ttft_p50_ms"]
        assert r["passed"] is True
        assert 0 <= r["client_lag_p99_ms"] <= r["client_lag_max_ms"]  # the load generator's own delay
    assert doc["summary"]["capacity"] == 4
    assert doc["summary"]["capacity_per_gpu"] == {"1p1d": 2.0}
    assert fake.max_concurrent == 4
    assert set(fake.seen_sessions) - {"voice-0", "voice-1"}  # cold voices too
    files = [p for p in doc["files"]]
    assert any(f.endswith(".json") for f in files) and any(f.endswith(".md") for f in files)
    assert (tmp_path / "cap.png").read_bytes()[:4] == b"\x89PNG"
    on_disk = json.loads(next(p for p in tmp_path.glob("capacity-*.json")).read_text())
    assert on_disk["rows"][0]["mode"] == "1p1d" and on_disk["command"] == "test"


def test_a_slow_unit_stutters_and_shows_its_rate_floor(serve):
    fake = FakeLB(fps=15.0)
    url = serve(fake)
    doc = run_capacity(base_config(url, concurrency="2", duration=0.3, frames="45"))
    (row,) = doc["rows"]
    assert row["errors"] == 0 and row["streams"] >= 2
    assert row["stutter_share"] == 1.0 and row["stalls"] > 0
    assert 13.0 < row["min_rate"] < 15.5
    assert row["worst_window"] <= 15
    assert row["passed"] is False
    assert doc["summary"]["capacity"] is None


def test_refusals_and_mid_stream_errors_are_counted_and_fail_the_level(serve):
    url = serve(FakeLB(fps=300.0, refuse_every=3))
    doc = run_capacity(base_config(url, concurrency="2", duration=0.5, body="json"))
    (row,) = doc["rows"]
    assert row["errors"] > 0 and row["error_kinds"].get("http_503:draining", 0) == row["errors"]
    assert row["passed"] is False
    url = serve(FakeLB(fps=300.0, fail_after=5))
    (row,) = run_capacity(base_config(url, concurrency="1", duration=0.3))["rows"]
    assert row["ok"] == 0 and set(row["error_kinds"]) == {"stream:decode_unavailable"}


def test_rate_floor_refusals_are_no_errors_and_the_level_reports_them_and_its_goodput(serve):
    url = serve(FakeLB(fps=300.0, refuse_every=2, refuse_code="rate_floor", retry_after="0"))
    doc = run_capacity(base_config(url, concurrency="2", duration=0.5))
    (row,) = doc["rows"]
    assert row["refused"] > 0 and row["errors"] == 0 and row["error_kinds"] == {}, row
    assert row["refused_share"] == row["refused"] / row["streams"]
    assert row["refusal_p99_ms"] is not None and row["refused_without_retry_after"] == 0
    # the served streams kept the floor (refusing is the unit's right), but a level the unit
    # refused part of is above its capacity: it fails as a capacity level
    assert row["admitted_kept_floor"] is True and row["passed"] is False
    assert doc["summary"]["capacity"] is None, doc["summary"]
    assert doc["summary"]["capacity_per_gpu"] == {"1p1d": None}, doc["summary"]
    assert row["goodput_fps"] == pytest.approx(row["frames_total"] / row["elapsed_s"], rel=0.01)


def test_a_closed_loop_worker_waits_a_refusals_retry_after(serve):
    fake = FakeLB(fps=300.0, refuse_every=1, refuse_code="rate_floor", retry_after="1")
    (row,) = run_capacity(base_config(serve(fake), concurrency="1", duration=0.5))["rows"]
    assert fake.requests == 1 and row["refused"] == 1  # came back after 1 s: the level had ended


def test_goodput_counts_only_the_streams_that_met_the_floor():
    def served(rate: float, stalls: int = 0) -> StreamResult:
        return StreamResult(index=0, voice="v", reused=False, prompt_rows=10, frames_requested=100, started_s=0,
                            send_unix_ns=0, frames=100, rate=rate, ttfa_s=0.1, stalls=stalls)

    refusal = StreamResult(index=1, voice="v", reused=False, prompt_rows=10, frames_requested=100, started_s=0,
                           send_unix_ns=0, status=503, error="http_503:rate_floor", answered_s=0.004)
    cfg = CapacityConfig(min_rate=42.0)
    row = summarize_level([served(50.0), served(30.0), served(60.0, stalls=1), refusal], cfg, 4, None, 10.0)
    assert row["goodput_fps"] == 10.0  # only the first: one fell under the floor, one stalled
    assert row["refused"] == 1 and row["refused_share"] == 0.25 and row["errors"] == 0
    assert row["refusal_p99_ms"] == pytest.approx(4.0) and row["refused_without_retry_after"] == 1
    assert row["passed"] is False  # the admitted streams did not all keep the floor


def test_a_speech_level_is_judged_at_the_codecs_frame_rate_and_on_audio_stalls():
    from pdunit.engine.loadgen.driver import SpeechTarget

    target = SpeechTarget(model="m", sample_rate=24000, samples_per_frame=1920, frame_rate_hz=12.5, n_books=32,
                          code_range=2048)

    def spoken(rate: float, audio_stalls: int = 0, cached: int = 0, reused: bool = True) -> StreamResult:
        return StreamResult(index=0, voice="v", reused=reused, prompt_rows=100, frames_requested=100, started_s=0,
                            send_unix_ns=0, frames=100, rate=rate, ttfa_s=0.1, api="speech", audio_s=8.0,
                            audio_stalls=audio_stalls, cached_rows=cached)

    cfg = CapacityConfig(min_rate=42.0, fps=21.0)  # 2x real time: 25 frames/s at 12.5 Hz
    row = summarize_level([spoken(30.0, cached=80), spoken(26.0), spoken(40.0, reused=False)], cfg, 3, None, 1.0,
                          target)
    assert row["api"] == "speech" and row["rate_floor"] == 25.0 and row["passed"] is True
    assert row["audio_s_total"] == 24.0 and row["audio_stalls"] == 0 and row["audio_stutter_share"] == 0.0
    assert row["warm_cache_hit_share"] == 0.5 and row["cold_cache_hit_share"] == 0.0
    assert row["cached_rows_share"] == round(80 / 300, 4)
    row = summarize_level([spoken(30.0), spoken(30.0, audio_stalls=1)], cfg, 2, None, 1.0, target)
    assert row["audio_stutter_share"] == 0.5 and row["passed"] is False  # an audio stall fails the level
    assert summarize_level([spoken(24.0)], cfg, 1, None, 1.0, target)["passed"] is False
    assert summarize_level([spoken(30.0)], cfg, 1, None, 1.0)["api"] == "frames"


@pytest.mark.parametrize(("unit_hz", "given", "fps", "min_rate"), [
    (12.5, {}, 12.5, 25.0),  # CSM (Mimi): 2x real time is 25 frames/s
    (21.0, {}, 21.0, 42.0),  # the pdunit family
    (None, {}, 21.0, 42.0),  # an LB from before frame_rate_hz
    (12.5, {"min_rate": 30.0}, 12.5, 30.0),  # a given floor wins
    (12.5, {"fps": 21.0}, 21.0, 42.0),  # a given rate wins, the floor 2x it
    (12.5, {"fps": 21.0, "min_rate": 10.0}, 21.0, 10.0),
])
def test_the_rate_and_floor_are_the_units_unless_given(serve, unit_hz, given, fps, min_rate):
    url = serve(FakeLB(fps=300.0, frame_rate_hz=unit_hz))
    doc = run_capacity(base_config(url, concurrency="1", duration=0.2, frames="10", **given))
    config = doc["config"]
    assert (config["fps"], config["min_rate"]) == (fps, min_rate)
    assert doc["summary"]["criteria"]["min_rate"] == min_rate  # the floor the rows were judged at
    source = config["rate_source"]
    assert (source["fps"] == "given") == ("fps" in given) and (source["min_rate"] == "given") == ("min_rate" in given)
    if unit_hz is None and "fps" not in given:
        assert "names no frame rate" in source["fps"]


def test_a_stream_is_judged_at_its_units_floor():
    from pdunit.engine.loadgen.driver import resolve_rates

    def served(rate: float) -> StreamResult:
        return StreamResult(index=0, voice="v", reused=False, prompt_rows=10, frames_requested=100, started_s=0,
                            send_unix_ns=0, frames=100, rate=rate, ttfa_s=0.1)

    csm, _ = resolve_rates(CapacityConfig(), {"frame_rate_hz": 12.5})
    pdunit, _ = resolve_rates(CapacityConfig(), {"frame_rate_hz": 21.0})
    # 30 frames/s is 2.4x CSM's real time and 1.4x the pdunit family's
    assert summarize_level([served(30.0)], csm, 1, None, 1.0)["passed"] is True
    assert summarize_level([served(30.0)], pdunit, 1, None, 1.0)["passed"] is False


def test_poisson_arrivals_with_bursts(serve):
    fake = FakeLB(fps=300.0)
    url = serve(fake)
    doc = run_capacity(
        base_config(url, concurrency="", rate="20", burst_share=0.5, burst_size=4, duration=1.0)
    )
    (row,) = doc["rows"]
    assert row["rate"] == 20.0 and row["concurrency"] is None
    assert 5 <= row["streams"] <= 60 and row["errors"] == 0
    assert "capacity_rate" in doc["summary"]


def test_level_summary_criteria_are_configurable():
    cfg = CapacityConfig(min_rate=10.0, ttfa_p95_ms=1000.0)
    results = []
    for k in range(3):
        r = StreamResult(
            index=k,
            voice="v",
            reused=False,
            prompt_rows=10,
            frames_requested=10,
            started_s=0.0,
            send_unix_ns=0,
            frames=10,
            ttft_s=0.1,
            ttfa_s=0.2 + k * 0.1,
            rate=20.0 + k,
            worst_window=20.0,
        )
        results.append(r)
    row = summarize_level(results, cfg, 3, None, 1.0)
    assert (
        row["passed"] is True
        and row["min_rate"] == 20.0
        and row["ttfa_p50_ms"] == pytest.approx(300.0)
    )
    row = summarize_level(results, CapacityConfig(min_rate=21.0), 3, None, 1.0)
    assert row["passed"] is False


def test_main_prints_the_table(serve, capsys):
    url = serve(FakeLB(fps=200.0))
    rc = main(
        [
            "--url",
            url,
            "--concurrency",
            "1",
            "--duration",
            "0.3",
            "--prompt-rows",
            "10",
            "--frames",
            "30",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "command: pdunit bench capacity --url" in out
    assert "fps 21: 21: GET /v1/model names no frame rate, min_rate 42: 2 x fps" in out
    assert "TTFA p50" in out and "stutter" in out and "summary:" in out


def test_a_level_can_end_after_a_number_of_streams(serve):
    fake = FakeLB(fps=300.0)
    url = serve(fake)
    doc = run_capacity(
        {
            "url": url,
            "concurrency": [3],
            "requests": 7,
            "duration": 60.0,
            "prompt_rows": (10, 20),
            "frames": (20, 20),
            "progress": False,
        }
    )
    (row,) = doc["rows"]
    assert row["streams"] == 7 and fake.requests == 7 and row["errors"] == 0


def test_a_ramped_closed_loop_spreads_its_first_requests_and_skips_the_ramp(serve):
    url = serve(FakeLB(fps=400.0))
    ramped = run_capacity(base_config(url, concurrency="4", duration=1.0, frames="400", ramp=0.8), keep_streams=True)
    first = sorted(s["started_s"] for s in ramped["streams"])[:4]
    assert first[-1] - first[0] >= 0.5  # 0, 0.2, 0.4, 0.6 s
    flat = run_capacity(base_config(url, concurrency="4", duration=0.3, frames="400"), keep_streams=True)
    first = sorted(s["started_s"] for s in flat["streams"])[:4]
    assert first[-1] - first[0] < 0.1  # without a ramp the 4 workers open together
    skipped = run_capacity(base_config(url, concurrency="4", duration=1.0, frames="20", ramp=0.5, warmup=0.5),
                           keep_streams=True)
    assert min(s["started_s"] for s in skipped["streams"]) >= 0.5  # the ramp's streams are not counted


def test_the_window_hook_marks_the_counted_part_of_a_level(serve):
    url = serve(FakeLB(fps=400.0))
    seen: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    run_capacity(base_config(url, concurrency="2", duration=1.0, frames="20", ramp=0.4, warmup=0.4),
                 window=lambda name: seen.append((name, time.perf_counter() - t0)))
    assert [n for n, _ in seen] == ["start", "end"]
    assert 0.35 <= seen[0][1] < seen[1][1] and seen[1][1] >= 0.95  # after the warmup; when arrivals stop
    seen.clear()
    run_capacity(base_config(url, concurrency="2", duration=0.3, frames="20", warmup=0.5),
                 window=lambda name: seen.append((name, 0.0)))
    assert seen == []  # no steady window at all: the hook is not called


def test_config_accepts_flags_and_names_bad_ranges():
    cfg = CapacityConfig.model_validate(
        {"concurrency": "4,8", "prompt_rows": ["1000-2000"], "frames": "105"}
    )
    assert (
        cfg.concurrency == [4, 8] and cfg.prompt_rows == (1000, 2000) and cfg.frames == (105, 105)
    )
    with pytest.raises(ValueError, match="--prompt-rows '9-3'"):
        CapacityConfig.model_validate({"prompt_rows": "9-3"})
    with pytest.raises(ValueError, match="expected binary or json"):
        CapacityConfig.model_validate({"body": "xml"})


def test_a_late_load_generator_says_so_in_the_row_and_out_loud(capsys):
    from pdunit.engine.loadgen.driver import CLIENT_LAG_WARN_MS, client_lag

    quiet = client_lag([0.001] * 99 + [0.002], "1p1d", 8)
    assert quiet == {"client_lag_p99_ms": 1.01, "client_lag_max_ms": 2.0}  # linear interpolation at 99%
    assert "WARNING" not in capsys.readouterr().out
    late = client_lag([0.001] * 90 + [0.2] * 10, "1p1d", 32)
    assert late["client_lag_p99_ms"] == 200.0 > CLIENT_LAG_WARN_MS
    assert "WARNING 1p1d at 32: the load generator's event loop ran 200 ms late" in capsys.readouterr().out
    assert client_lag([], "1p1d", 1) == {"client_lag_p99_ms": None, "client_lag_max_ms": None}


def test_client_processes_send_the_same_poisson_level_as_one_process(serve, capsys):
    """--client-procs 2 sends the level's requests from two spawned processes: the same
    requests (one seeded schedule, split i mod 2) and the same row fields."""
    one, two = FakeLB(fps=300.0), FakeLB(fps=300.0)
    cfg = dict(concurrency="", rate="12", burst_share=0.5, burst_size=3, duration=1.0)
    single = run_capacity(base_config(serve(one), **cfg))["rows"][0]
    sharded = run_capacity(base_config(serve(two), **cfg, client_procs=2))["rows"][0]
    assert "over 2 client processes" in capsys.readouterr().err
    assert two.requests == one.requests > 3
    assert sorted(two.seen_sessions) == sorted(one.seen_sessions)
    assert sharded["streams"] == single["streams"] and sharded["errors"] == 0 and sharded["passed"]
    assert sharded["client_lag_p99_ms"] is not None  # merged from both processes


def test_client_processes_need_poisson_levels():
    with pytest.raises(ValueError, match="client_procs > 1 needs Poisson levels"):
        CapacityConfig.model_validate({"concurrency": [2], "client_procs": 2})


def test_a_capacity_at_the_highest_level_measured_is_flagged_as_a_lower_bound():
    from pdunit.bench.capacity import summarize_run

    cfg = CapacityConfig(mode_label="m", gpus=1)

    def rows(*passed_by_rate):
        return [{"concurrency": None, "rate": rate, "passed": ok, "realtime_streams": 10.0 * rate}
                for rate, ok in passed_by_rate]

    top = summarize_run(rows((8, True), (10, True), (10, True)), cfg)
    assert top["capacity_rate"] == 10 and top["capacity_lower_bound_only"] == {"m": True}
    bounded = summarize_run(rows((8, True), (10, True), (12, False)), cfg)
    assert bounded["capacity_rate"] == 10 and bounded["capacity_lower_bound_only"] == {"m": False}
    # one failing run of the top level is enough to bound it
    assert summarize_run(rows((8, True), (10, True), (10, False)), cfg)["capacity_lower_bound_only"] == {"m": False}
    assert summarize_run(rows((8, False)), cfg)["capacity_lower_bound_only"] == {"m": False}  # no capacity at all
    # the interval the capacity lies in: up to the level that failed above it
    assert top["capacity_bounds_per_gpu"] == {"m": [10.0, None]}
    assert bounded["capacity_bounds_per_gpu"] == {"m": [10.0, 12.0]}
    assert summarize_run(rows((8, False)), cfg)["capacity_bounds_per_gpu"] == {"m": [0.0, 8.0]}


def test_levels_shorter_than_three_stream_lifetimes_are_flagged_as_short():
    from pdunit.bench.capacity import short_levels_warning, steady_duration_s, summarize_run

    rows = [{"concurrency": None, "rate": 10.0, "passed": True, "realtime_streams": 1.0}]
    # BENCHMARKS.md's streams: 630 frames at the 42 frames/s floor last 15 s: 45 s of level
    spec = CapacityConfig(mode_label="m", gpus=1, frames="105-630", duration=12.0)
    assert steady_duration_s(spec) == 45.0
    # no floor (--min-rate 0): the longest stream's lifetime at real time, 630 / 21 = 30 s
    assert steady_duration_s(spec.model_copy(update={"min_rate": 0.0})) == 90.0
    short = summarize_run(rows, spec)
    assert short["levels_too_short"] == {"m": True} and short["steady_state_s"] == 45.0
    assert summarize_run(rows, spec.model_copy(update={"duration": 60.0}))["levels_too_short"] == {"m": False}
    # a level ended by a stream count has no set length to judge
    assert summarize_run(rows, spec.model_copy(update={"requests": 50}))["levels_too_short"] == {"m": False}
    text = short_levels_warning("m", 12.0, 45.0)
    assert "levels of 12 s hold fewer than 3 lifetimes of the longest stream (15 s" in text
    assert "--duration 45 or more" in text
