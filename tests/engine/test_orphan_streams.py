"""No orphan decodes (issue 32, finding 6): a stream whose frames subscriber (the LB) is
gone, with no subscriber of the same name back within the grace, is ended by D. The
FrameHub's rule on its own (a recording `end`), then through real processes: the LB of
a local unit killed mid-stream, and D ends the stream long before its max frames."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import httpx
import numpy as np
import pytest

from pdunit.bench.fault_unit import wait_until
from pdunit.bench.report import scrape_metrics
from pdunit.engine.decode.hub import ORPHANED_STREAMS, FrameHub
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.ports import free_port
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto import pdunit_pb2_grpc as pbg
from tests.engine.unit_client import random_prompt

GRACE_S = 0.05


def step(running: list[int], finished: list[int] = ()) -> pb.StepFrames:
    ids = list(running) + list(finished)
    return pb.StepFrames(request_ids=np.array(ids, dtype="<u8").tobytes(),
                         frames=np.zeros((len(ids), 2), dtype="<i4").tobytes(),
                         finished=bytes([0] * len(running) + [2] * len(finished)))


class Engine:
    """What the hub calls: records the streams it is told to end."""

    def __init__(self) -> None:
        self.running: set[int] = set()
        self.ended: list[int] = []

    def end(self, request_ids: list[int]) -> int:
        found = [rid for rid in request_ids if rid in self.running]
        self.running -= set(found)
        self.ended += found
        return len(found)

    def live(self) -> list[int]:
        return list(self.running)


class Subscriber:
    def __init__(self, hub: FrameHub, name: str) -> None:
        self.received: list[pb.StepFrames] = []
        self._task = asyncio.ensure_future(self._read(hub.subscribe(name)))

    async def _read(self, messages) -> None:
        async for msg in messages:
            self.received.append(msg)

    async def leave(self) -> None:  # the LB's call ends (its process died, or it closed it)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def hub_and_engine() -> tuple[FrameHub, Engine]:
    hub = FrameHub(asyncio.get_running_loop(), orphan_grace_s=GRACE_S)
    engine = Engine()
    hub.end_orphans_with(engine.end, engine.live)
    return hub, engine


async def settle(seconds: float = 10 * GRACE_S) -> None:
    await asyncio.sleep(seconds)


def test_a_stream_whose_lb_left_is_ended_after_the_grace():
    async def scenario() -> None:
        hub, engine = await hub_and_engine()
        lb = Subscriber(hub, "lb:unit:aaaa")
        engine.running |= {7, 8}
        hub.publish(step([7, 8]))
        hub.publish(step([7], finished=[8]))  # 8 ended normally: never ended again
        await settle(0)
        before = ORPHANED_STREAMS._value.get()
        await lb.leave()
        deadline = time.monotonic() + 10
        while not engine.ended and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.ended == [7]
        assert ORPHANED_STREAMS._value.get() == before + 1

    asyncio.run(scenario())


def test_a_stranger_subscribing_and_leaving_ends_nothing_of_the_lb():
    async def scenario() -> None:
        hub, engine = await hub_and_engine()
        Subscriber(hub, "lb:unit:aaaa")
        stranger = Subscriber(hub, "stranger")
        engine.running.add(7)
        hub.publish(step([7]))  # both saw its first frame: owned by both
        await settle(0)
        await stranger.leave()
        await settle()
        assert engine.ended == []  # the LB still receives it

    asyncio.run(scenario())


def test_the_same_subscriber_back_within_the_grace_keeps_its_streams():
    async def scenario() -> None:
        hub = FrameHub(asyncio.get_running_loop(), orphan_grace_s=0.5)
        engine = Engine()
        hub.end_orphans_with(engine.end, engine.live)
        lb = Subscriber(hub, "lb:unit:aaaa")
        engine.running.add(7)
        hub.publish(step([7]))
        await settle(0)
        await lb.leave()
        Subscriber(hub, "lb:unit:aaaa")  # reconnected (a transient break)
        await asyncio.sleep(1.5)
        assert engine.ended == []
        other = FrameHub(asyncio.get_running_loop(), orphan_grace_s=0.5)  # control: nobody comes back
        control = Engine()
        other.end_orphans_with(control.end, control.live)
        gone = Subscriber(other, "lb:unit:aaaa")
        control.running.add(7)
        other.publish(step([7]))
        await settle(0)
        await gone.leave()
        Subscriber(other, "lb:unit:bbbb")  # a restarted LB: a new name, it never knew stream 7
        await asyncio.sleep(1.5)
        assert control.ended == [7]

    asyncio.run(scenario())


def test_streams_cancelled_without_a_last_frame_are_forgotten():
    async def scenario() -> None:
        hub, engine = await hub_and_engine()
        Subscriber(hub, "lb")
        engine.running |= {1, 2}
        hub.publish(step([1, 2]))
        for rid in range(3, 5000):  # each cancelled right after its first frame
            engine.running.add(rid)
            hub.publish(step([rid]))
            await settle(0)
            engine.running.discard(rid)
        await settle(0)
        assert len(hub._owners) <= 200  # bounded: not one entry per stream ever seen
        assert {1, 2} <= set(hub._owners)  # the running ones are still tracked

    asyncio.run(scenario())


# ------------------------------------------------------------------ real processes

SLOW_FRAMES = 4096  # max_frames_limit: what D would decode for nobody without the rule


@pytest.fixture
def unit():
    d_metrics = free_port()
    cfg = LocalConfig(mode="pd", pool_tokens=16384, cache_tokens=16384, lb_port=0, guard=False,
                      log_level="warning", extra_decode_args=["--metrics-port", str(d_metrics)])
    with LocalUnit(cfg) as u:
        u.d_metrics_port = d_metrics  # type: ignore[attr-defined]
        yield u


def d_info(u: LocalUnit) -> pb.InfoReply:
    with grpc.insecure_channel(f"unix:{u.sock('decode')}") as ch:
        return pbg.DecodeStub(ch).Info(pb.Empty(), timeout=5)


def d_metric(u: LocalUnit, name: str) -> float:
    return sum(v for k, v in scrape_metrics(u.d_metrics_port).items() if k == name or k.startswith(name + "{"))


def start_long_stream(u: LocalUnit) -> threading.Thread:
    """A client that reads its stream until the connection breaks (its LB dies)."""

    def read() -> None:
        body = {"prompt": random_prompt(64, seed=5), "max_frames": SLOW_FRAMES, "min_frames": SLOW_FRAMES}
        try:
            with httpx.stream("POST", f"{u.url}/v1/tts/stream", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(240)
def test_d_ends_the_streams_of_a_killed_lb(unit):
    frames0 = d_metric(unit, "pdunit_decode_frames_total")
    start_long_stream(unit)
    wait_until(lambda: d_info(unit).in_flight == 1, 60, "the stream decoding in D")
    lb = unit.child("lb").proc
    lb.send_signal(signal.SIGKILL)
    lb.wait(10)
    wait_until(lambda: d_info(unit).in_flight == 0, 120, "D to end the stream nobody receives")
    decoded = d_metric(unit, "pdunit_decode_frames_total") - frames0
    assert decoded < SLOW_FRAMES / 2, f"D decoded {decoded} frames of a stream nobody received"
    assert d_metric(unit, "pdunit_decode_orphaned_streams_total") == 1
