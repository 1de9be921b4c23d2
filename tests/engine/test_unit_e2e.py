"""End to end through real processes: LB + P + D (host transport) and the monolith,
started by `pdunit local`'s LocalUnit with the same commands a pod runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdunit.engine.local import LocalConfig, LocalUnit
from tests.engine.unit_client import (
    load,
    random_prompt,
    stream,
    units_side_by_side,
    wait_empty,
    wait_for,
)

SMALL = dict(pool_tokens=16384, cache_tokens=16384, lb_port=0, guard=False, log_level="warning")
FP8_KV = dict(SMALL, kv_cache_dtype="fp8_e4m3")  # every engine's pool fp8

REQUESTS = [
    (random_prompt(120, seed=1), dict(max_frames=24, min_frames=24)),
    (random_prompt(260, seed=2), dict(max_frames=30, min_frames=30)),
    (random_prompt(64, seed=3), dict(max_frames=18, min_frames=18, temperature=0.9, seed=7)),
    (random_prompt(190, seed=4), dict(max_frames=20, min_frames=0, temperature=1.1, top_k=50, seed=11)),
]


@pytest.fixture(scope="module")
def pd_unit():
    # D runs through an argv wrapper, as under the GPU pod-isolation harness
    wrapped = LocalConfig(mode="pd", wrappers={"decode": ["env", "PDUNIT_TEST_WRAPPED=decode"]}, **SMALL)
    with LocalUnit(wrapped) as unit:
        yield unit


@pytest.fixture(scope="module")
def monolith_unit():
    with LocalUnit(LocalConfig(mode="monolith", **SMALL)) as unit:
        yield unit


@pytest.fixture(scope="module")
def fp8_monolith_unit():
    with LocalUnit(LocalConfig(mode="monolith", **FP8_KV)) as unit:
        yield unit


@pytest.fixture(scope="module")
def chunked_unit():
    # a chunk smaller than the prompts: every prompt is split across iterations that
    # also carry decode steps
    with LocalUnit(LocalConfig(mode="monolith", policy="chunked", chunk_tokens=96, **SMALL)) as unit:
        yield unit


def run_all(url: str) -> list[tuple[list, dict]]:
    # concurrently, so streams share decode steps and prefill batches
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(lambda r: stream(url, r[0], **r[1]), REQUESTS))


def test_pd_frames_identical_to_monolith(pd_unit, monolith_unit):
    pd = run_all(pd_unit.url)
    mono = run_all(monolith_unit.url)
    for (pd_frames, pd_last), (mono_frames, mono_last), (_, params) in zip(pd, mono, REQUESTS, strict=True):
        assert pd_last.get("done"), pd_last
        assert mono_last.get("done"), mono_last
        assert len(pd_frames) >= 1
        if params.get("min_frames"):
            assert len(pd_frames) == params["max_frames"]
        assert pd_frames == mono_frames
    # greedy requests with different prompts must not all produce the same frames
    assert pd[0][0] != pd[1][0]
    # and the frames move over time (the model is not degenerate)
    assert len({tuple(f) for f in pd[1][0]}) > 1


def test_chunked_monolith_frames_identical_to_pd(pd_unit, chunked_unit):
    pd = run_all(pd_unit.url)
    chunked = run_all(chunked_unit.url)
    for (pd_frames, _), (ch_frames, ch_last) in zip(pd, chunked, strict=True):
        assert ch_last.get("done"), ch_last
        assert ch_frames == pd_frames


def test_a_wrapped_child_runs_its_command_through_the_wrapper(pd_unit):
    environ = Path(f"/proc/{pd_unit.child('decode').proc.pid}/environ").read_bytes().split(b"\0")
    assert b"PDUNIT_TEST_WRAPPED=decode" in environ
    assert b"PDUNIT_TEST_WRAPPED=decode" not in Path(
        f"/proc/{pd_unit.child('prefill').proc.pid}/environ").read_bytes().split(b"\0")


def test_every_pd_transfer_was_checked(pd_unit):
    stream(pd_unit.url, random_prompt(50, seed=99), max_frames=4, min_frames=4)
    info = load(pd_unit.url)
    assert info.kv_checks_total >= 1
    assert info.kv_mismatch_total == 0
    assert info.transfer_mode == "host"


def test_reused_voice_hits_prefix_cache(pd_unit):
    voice = random_prompt(320, seed=42)
    text_a = random_prompt(40, seed=43)
    first_frames, first = stream(pd_unit.url, voice + text_a, max_frames=12, min_frames=12)
    again_frames, again = stream(pd_unit.url, voice + text_a, max_frames=12, min_frames=12)
    assert first["done"] and again["done"]
    assert again["cached_tokens"] >= 320 - 16
    assert again["prefill_tokens"] < first["prefill_tokens"]
    assert again_frames == first_frames
    # a different text on the same voice reuses the voice's blocks
    _, other = stream(pd_unit.url, voice + random_prompt(40, seed=44), max_frames=4, min_frames=4)
    assert other["cached_tokens"] >= 320 - 16


@pytest.mark.parametrize("which", ["monolith_unit", "chunked_unit"])
def test_monolith_reused_voice_hits_its_prefix_cache_with_pd_frames(which, pd_unit, request):
    """The monolith keeps the prefix cache P keeps (prefill-first, and chunked with a
    chunk smaller than the prompt): a reused voice computes only its text rows, and
    every frame equals P + D's for the same request."""
    unit = request.getfixturevalue(which)
    voice = random_prompt(320, seed=52)
    params = dict(max_frames=12, min_frames=12)
    first_frames, first = stream(unit.url, voice + random_prompt(40, seed=53), **params)
    again_frames, again = stream(unit.url, voice + random_prompt(40, seed=53), **params)
    other_frames, other = stream(unit.url, voice + random_prompt(30, seed=54), **params)
    assert first["done"] and again["done"] and other["done"]
    assert first["cached_tokens"] == 0 and first["prefill_tokens"] == 360
    assert again["cached_tokens"] >= 320 - 16 and again["prefill_tokens"] == 360 - again["cached_tokens"]
    assert other["cached_tokens"] >= 320 - 16
    assert again_frames == first_frames
    assert other_frames == stream(pd_unit.url, voice + random_prompt(30, seed=54), **params)[0]
    # every page went back once the streams ended (a cache hit's pages too)
    wait_for(lambda: load(unit.url).free_pages == load(unit.url).pool_pages, what="the pool whole again")


def test_disconnecting_client_frees_its_pages(pd_unit):
    body = {"prompt": random_prompt(100, seed=5), "max_frames": 1500, "min_frames": 1500}
    with httpx.stream("POST", f"{pd_unit.url}/v1/tts/stream", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        wait_for(lambda: load(pd_unit.url).decode_in_flight >= 1, what="the stream decoding in D")
    wait_for(lambda: load(pd_unit.url).decode_in_flight == 0, what="stream cancelled in D")
    # Every page, not "as many as before": an earlier test's stream may still have been
    # returning its pages when this one started.
    after = wait_for(lambda: (lambda x: x if x.free_pages == x.pool_pages else None)(load(pd_unit.url)),
                     what="every page of D's pool back in the free list")
    assert after.held_pages == 0


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return bool(stat) and stat.split()[2] != "Z"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_pdunit_local_leaves_no_process_behind(tmp_path, how):
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdunit.engine.cli", "local", "--lb-port", "0", "--pool-tokens", "4096",
         "--cache-tokens", "4096", "--log-level", "warning", "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "unit ready" in line, line
        kids = _children(proc.pid)
        assert len(kids) >= 3  # decode, prefill, lb (+ sidecars)
        proc.send_signal(how)
        assert proc.wait(timeout=30) == 0
        time.sleep(0.2)
        assert [k for k in kids if _alive(k)] == []
    finally:
        if proc.poll() is None:
            proc.kill()


def _lb_streams_seen(url: str) -> float:
    """Streams the LB holds now plus those it answered (any outcome), from its /metrics."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5.0).text)
    return sum(sample.value for family in families for sample in family.samples
               if sample.name in ("pdunit_lb_streams_in_flight", "pdunit_lb_requests_total"))


@pytest.mark.parametrize("when", ["starting", "loading"])
def test_pdunit_local_stopped_while_starting_or_loading_leaves_no_process_behind(tmp_path, when):
    """A signal before the unit is ready abandons the start, one during `--load-streams`
    the load: every child started so far is stopped and the command exits 0 (the signal
    handler raised KeyboardInterrupt once, and a signal that landed in the GC callback was
    lost there: the unit then served on)."""
    load = ["--load-streams", "4", "--load-requests", "400", "--load-frames", "200"] if when == "loading" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdunit.engine.cli", "local", "--lb-port", "0", "--pool-tokens", "16384",
         "--cache-tokens", "4096", "--log-level", "warning", "--run-dir", str(tmp_path / "run"), *load],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        if when == "starting":
            kids = wait_for(lambda: _children(proc.pid) or None, what="the first child started")
        else:
            line = proc.stdout.readline()
            assert "unit ready at " in line, line
            kids = _children(proc.pid)
            # the load is running (400 requests take far longer): its first request reached the LB
            url = line.split("unit ready at ")[1].split()[0]
            wait_for(lambda: _lb_streams_seen(url), interval=0.05, what="the load's first request at the LB")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        if when == "starting":
            assert "unit ready" not in proc.stdout.read()
        time.sleep(0.2)
        assert [k for k in kids if _alive(k)] == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("transfer, pool", [("proxy", "full"), ("tcp", "full"), ("proxy", "fp8"), ("tcp", "fp8")])
def test_pd_over_the_proxy_and_tcp_transports_matches_the_monolith(transfer, pool, request):
    """Each transport carries P's rows to D as they are: full precision, and fp8 rows
    (--kv-cache-dtype fp8_e4m3 on P, D and the monolith), checksummed, frame for frame
    the monolith's with the same pool."""
    unit = LocalUnit(LocalConfig(mode="pd", transfer=transfer, **(SMALL if pool == "full" else FP8_KV)))
    try:
        # Spawned from this thread (a child dies with the thread that spawned it:
        # PR_SET_PDEATHSIG); P, D and the LB boot while the monolith (started at its first
        # use in the module) starts and answers: two units' starts, not one after the other
        unit.start()
        with ThreadPoolExecutor(1) as waiter:
            ready = waiter.submit(unit.wait_ready)
            mono = request.getfixturevalue("monolith_unit" if pool == "full" else "fp8_monolith_unit")
            want = [stream(mono.url, p, **params) for p, params in REQUESTS[:2]]
            ready.result()
        unit.supervise()
        got = [stream(unit.url, p, **params) for p, params in REQUESTS[:2]]
        info = wait_empty(unit.url)
    finally:
        unit.stop()
    for (frames, last), (mono_frames, _) in zip(got, want, strict=True):
        assert last.get("done"), last
        assert frames == mono_frames
    assert info.transfer_mode == transfer
    assert info.kv_checks_total == 2 and info.kv_mismatch_total == 0


def test_fp8_prefill_gemms_reach_p_and_the_monolith_and_keep_pd_equal_to_it(pd_unit):
    """--prefill-gemm fp8 on both engines (the CPU reference arithmetic): PD still equals
    the prefill-first monolith frame for frame, and the frames are not bf16's."""
    fp8 = dict(SMALL, prefill_gemm="fp8")
    every = ["--fp8-min-rows", "0"]  # these prompts are far below the engines' default threshold
    with units_side_by_side(LocalConfig(mode="pd", extra_prefill_args=every, **fp8),
                            LocalConfig(mode="monolith", extra_monolith_args=every, **fp8)) as (pd8, mono8):
        got, want = run_all(pd8.url), run_all(mono8.url)
    bf16 = run_all(pd_unit.url)
    for (frames, last), (mono_frames, mono_last) in zip(got, want, strict=True):
        assert last.get("done") and mono_last.get("done"), (last, mono_last)
        assert frames == mono_frames
    assert [f for f, _ in got] != [f for f, _ in bf16]


def test_fp8_kv_cache_keeps_pd_equal_to_both_monoliths(pd_unit, fp8_monolith_unit):
    """--kv-cache-dtype fp8_e4m3 on every engine: P writes fp8 rows, they cross to D
    (host transport, checksummed; tcp and proxy: the transports test above), D decodes
    from them, and the frames equal both monoliths' (their pools fp8 too: prefill-first,
    and chunked, which reads its earlier chunks back from the pool), and differ from the
    full-precision pool's."""
    with units_side_by_side(LocalConfig(mode="pd", **FP8_KV),
                            LocalConfig(mode="monolith", policy="chunked", chunk_tokens=96, **FP8_KV)) as (pd8, chunk8):
        got, chunked = run_all(pd8.url), run_all(chunk8.url)
        info = load(pd8.url)
    want = run_all(fp8_monolith_unit.url)
    full = run_all(pd_unit.url)
    for (frames, last), (mono_frames, mono_last), (chunk_frames, _) in zip(got, want, chunked, strict=True):
        assert last.get("done") and mono_last.get("done"), (last, mono_last)
        assert frames == mono_frames == chunk_frames
    assert info.kv_checks_total == len(REQUESTS) and info.kv_mismatch_total == 0
    assert [f for f, _ in got] != [f for f, _ in full]


def test_p_refuses_a_d_whose_kv_cache_dtype_differs(tmp_path):
    """P fp8, D full precision: no transfer could be right, so P stops at Hello, naming
    both dtypes and the flag to fix, and the unit never reports ready."""
    cfg = LocalConfig(mode="pd", run_dir=str(tmp_path), ready_timeout_s=60,
                      extra_prefill_args=["--kv-cache-dtype", "fp8_e4m3"], **SMALL)
    with pytest.raises(RuntimeError, match="prefill exited") as err, LocalUnit(cfg):
        pass
    assert "float8_e4m3fn" in str(err.value) and "--kv-cache-dtype" in str(err.value)
