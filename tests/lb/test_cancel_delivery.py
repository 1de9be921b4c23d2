"""Cancels are delivered (issue 32, finding 6): the LB asks P and D again, with backoff,
until each answers (found or not found) or the stream's deadline passes, and keeps no
unbounded queue. `UnitClient` against a P and a D on unix sockets whose Cancel fails,
hangs or answers as each test needs; then through real processes: D stopped
(SIGSTOP) when the client leaves, its cancel arrives after SIGCONT and the stream ends
long before its max frames."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from pdunit.bench.fault_unit import wait_until
from pdunit.bench.report import scrape_metrics
from pdunit.engine.grpc_server import unix_target
from pdunit.engine.lb.metrics import LBMetrics
from pdunit.engine.lb.unit import UnitClient
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.ports import free_port
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from tests.engine.unit_client import random_prompt


class Target(pbg.PrefillServicer, pbg.DecodeServicer):
    """Cancel: fails with UNAVAILABLE `failures` times, or hangs while `hang` is set,
    then answers `found`."""

    def __init__(self, failures: int = 0, found: bool = True, hang: bool = False) -> None:
        self.failures = failures
        self.found = found
        self.hang = hang
        self.calls = 0
        self.answered: list[int] = []

    async def Cancel(self, request, context):  # noqa: N802 - gRPC names
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not now")
        while self.hang:
            await asyncio.sleep(0.01)
        self.answered.append(request.request_id)
        return pb.CancelReply(found=self.found)


@pytest.fixture
def sockets() -> Iterator[tuple[str, str]]:
    d = tempfile.mkdtemp(prefix="pdcd", dir="/tmp")  # unix socket paths stay short
    yield str(Path(d) / "p.sock"), str(Path(d) / "d.sock")
    shutil.rmtree(d, ignore_errors=True)


async def serve(sock: str, target: Target) -> grpc.aio.Server:
    server = grpc.aio.server()
    pbg.add_PrefillServicer_to_server(target, server)
    pbg.add_DecodeServicer_to_server(target, server)
    server.add_insecure_port(unix_target(sock))
    await server.start()
    return server


def count(metrics: LBMetrics, target: str, result: str) -> float:
    return metrics.cancels.labels(target=target, result=result)._value.get()


async def run_cancels(sockets, prefill: Target, decode: Target, cancels: list[dict], **client_kw):
    servers = [await serve(sockets[0], prefill), await serve(sockets[1], decode)]
    metrics = LBMetrics(CollectorRegistry())
    unit = UnitClient(sockets[0], sockets[1], "", metrics, max_message_bytes=1 << 20, **client_kw)
    for kw in cancels:
        unit.cancel(**kw)
    await unit.wait_background(timeout=60)
    pending = len(unit._background)
    await unit.close()
    for server in servers:
        await server.stop(None)
    return metrics, pending


def test_a_cancel_is_retried_until_d_answers(sockets):
    p, d = Target(), Target(failures=3)
    metrics, pending = asyncio.run(run_cancels(sockets, p, d, [dict(request_id=7, timeout=1.0, decode=0)]))
    assert pending == 0
    assert d.calls == 4 and d.answered == [7] and p.answered == [7]
    assert count(metrics, "decode", "retried") == 3 and count(metrics, "decode", "found") == 1
    assert count(metrics, "prefill", "found") == 1 and count(metrics, "prefill", "retried") == 0


def test_not_found_is_an_answer(sockets):
    p, d = Target(found=False), Target(found=False)
    metrics, _ = asyncio.run(run_cancels(sockets, p, d, [dict(request_id=7, timeout=1.0)]))
    assert p.calls == d.calls == 1
    assert count(metrics, "decode", "not_found") == 1 and count(metrics, "prefill", "not_found") == 1


def test_a_cancel_nobody_answers_is_given_up_at_the_deadline(sockets):
    import time

    p, d = Target(), Target(hang=True)
    metrics, pending = asyncio.run(run_cancels(
        sockets, p, d, [dict(request_id=7, timeout=0.1, deadline=time.monotonic() + 1.0)]))
    assert pending == 0  # no task outlives the deadline
    assert d.calls >= 2 and d.answered == []
    assert count(metrics, "decode", "given_up") == 1 and count(metrics, "decode", "found") == 0


def test_cancels_beyond_the_limit_are_dropped_and_counted(sockets):
    import time

    p, d = Target(hang=True), Target(hang=True)
    soon = time.monotonic() + 0.5
    metrics, _ = asyncio.run(run_cancels(
        sockets, p, d, [dict(request_id=rid, timeout=0.1, deadline=soon) for rid in (1, 2, 3)],
        max_pending_cancels=4))  # two cancels of two targets each fill it
    assert count(metrics, "decode", "given_up") == 3 and count(metrics, "prefill", "given_up") == 3
    assert {c for c in (p.calls, d.calls)} and p.calls >= 2  # the first two were tried
    assert d.calls < 3 * 5  # the third was never sent: a bounded number of tries of two cancels


# ------------------------------------------------------------------ real processes

SLOW_FRAMES = 4096  # max_frames_limit: what D would decode for nobody without the retries
CLIENT = f"""
import sys, httpx
body = {{"prompt": {random_prompt(64, seed=6)}, "max_frames": {SLOW_FRAMES}, "min_frames": {SLOW_FRAMES}}}
with httpx.stream("POST", sys.argv[1] + "/v1/tts/stream", json=body, timeout=120) as r:
    for i, _ in enumerate(r.iter_lines()):
        if i == 0:
            print("streaming", flush=True)
"""


@pytest.mark.timeout(240)
def test_cancels_to_a_stopped_d_arrive_after_sigcont_and_end_its_stream():
    d_metrics = free_port()
    cfg = LocalConfig(mode="pd", pool_tokens=16384, cache_tokens=16384, lb_port=0, guard=False,
                      log_level="warning", extra_decode_args=["--metrics-port", str(d_metrics)])
    with LocalUnit(cfg) as unit:
        def d_metric(name: str) -> float:
            return sum(v for k, v in scrape_metrics(d_metrics).items() if k == name or k.startswith(name + "{"))

        def lb_cancels(result: str) -> float:
            text = httpx.get(f"{unit.url}/metrics", timeout=5).text
            return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                       if line.startswith("pdunit_lb_cancels_total{") and 'target="decode"' in line
                       and f'result="{result}"' in line)

        frames0 = d_metric("pdunit_decode_frames_total")
        client = subprocess.Popen([sys.executable, "-c", CLIENT, unit.url], stdout=subprocess.PIPE, text=True)
        try:
            assert client.stdout is not None and client.stdout.readline().strip() == "streaming"
            d = unit.child("decode").proc
            d.send_signal(signal.SIGSTOP)
            try:
                client.kill()  # the client goes away: the LB cancels its stream in P and D
                wait_until(lambda: lb_cancels("retried") >= 1, 30, "the LB retrying its cancel to the stopped D")
            finally:
                d.send_signal(signal.SIGCONT)
        finally:
            client.kill()
            client.wait(10)
        wait_until(lambda: lb_cancels("found") + lb_cancels("not_found") >= 1, 60, "the cancel delivered")
        wait_until(lambda: d_metric("pdunit_decode_streams") == 0, 60, "D to end the cancelled stream")
        decoded = d_metric("pdunit_decode_frames_total") - frames0
        assert decoded < SLOW_FRAMES / 2, f"D decoded {decoded} frames of a cancelled stream"
        assert lb_cancels("given_up") == 0
