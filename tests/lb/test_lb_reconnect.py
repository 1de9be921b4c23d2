"""A unit's processes that serve late (the pod's start) or again (a restart) are reached
soon: the LB is ready once they answer, not a probe interval later; its frames
subscription and every in-pod gRPC channel retry at most half a second apart (gRPC's
default reconnect backoff is 1 s growing to 120 s; issue 33: every local unit's start
waited it out)."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from pdunit.engine import grpc_server
from pdunit.engine.lb import streams
from pdunit.engine.lb.metrics import LBMetrics
from pdunit.engine.lb.unit import UnitClient
from tests.lb.conftest import wait_until

LONGEST_BACKOFF_MS = 500


def test_an_lb_is_ready_once_a_late_d_answers_not_a_probe_interval_later(start_lb, fake_unit, loop_thread,
                                                                          short_dir):
    fake_unit.decode_socket = f"{short_dir}/late-d.sock"
    # a probe interval no test outlives: only probing sooner while not ready makes it ready
    lb = start_lb(wait_ready=False, decode_socket=fake_unit.decode_socket, probe_interval_s=3600.0)
    with lb.client() as c:
        assert c.get("/readyz").status_code == 503
        loop_thread.run(fake_unit.start_decode())
        wait_until(lambda: c.get("/readyz").status_code == 200, what="ready once D answers")
        assert c.get("/v1/model").status_code == 200


def test_the_frames_subscription_to_a_d_not_serving_retries_at_most_half_a_second_apart(monkeypatch, short_dir):
    pauses: list[float] = []

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 12:
            raise asyncio.CancelledError

    # the subscription's own pauses only (gRPC's loop keeps the real asyncio)
    monkeypatch.setattr(streams, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "sleep": sleep}))

    async def main() -> None:
        metrics = LBMetrics(CollectorRegistry())
        async with grpc.aio.insecure_channel(f"unix://{short_dir}/absent.sock") as channel:
            sub = streams.FrameSubscription(streams.StreamTable(metrics, lambda: 11), channel, "lb:test", metrics)
            try:
                await sub.run()
            except asyncio.CancelledError:
                pass

    asyncio.run(main())
    assert len(pauses) == 12 and pauses[0] == 0.05
    assert max(pauses) == LONGEST_BACKOFF_MS / 1000  # it doubled up to the cap, and no further


def _longest_backoff(options: Any) -> int:
    found = [v for k, v in options if k == "grpc.max_reconnect_backoff_ms"]
    # gRPC takes an argument's first occurrence
    return found[0] if found else 120_000


def test_every_in_pod_channel_reconnects_at_most_half_a_second_apart(monkeypatch, short_dir):
    made: list[tuple[str, Any]] = []
    real_aio, real_sync = grpc.aio.insecure_channel, grpc.insecure_channel

    def aio(target: str, options: Any = None, **kw: Any) -> Any:
        made.append((target, options or []))
        return real_aio(target, options=options, **kw)

    def sync(target: str, options: Any = None, **kw: Any) -> Any:
        made.append((target, options or []))
        return real_sync(target, options=options, **kw)

    monkeypatch.setattr(grpc.aio, "insecure_channel", aio)
    monkeypatch.setattr(grpc, "insecure_channel", sync)

    async def aio_channels() -> None:
        # the LB's: P's, each D's and the proxy's
        unit = UnitClient(f"{short_dir}/p.sock", [f"{short_dir}/d0.sock", f"{short_dir}/d1.sock"],
                          f"{short_dir}/proxy.sock", LBMetrics(CollectorRegistry()), 1 << 20)
        await unit.close()
        await grpc_server.channel(f"{short_dir}/p.sock").close()  # the quiesce guard's

    asyncio.run(aio_channels())
    grpc_server.sync_channel(f"{short_dir}/d.sock").close()  # P's link to each D
    assert len(made) == 6
    assert all(_longest_backoff(options) <= LONGEST_BACKOFF_MS for _, options in made), made
