"""The stream table: dispatch of StepFrames into per-stream queues."""

from __future__ import annotations

import asyncio

import numpy as np
from prometheus_client import CollectorRegistry

from pdunit.engine.lb.metrics import LBMetrics
from pdunit.engine.lb.streams import Frames, StreamFailure, StreamTable
from pdunit.engine.proto import pdunit_pb2 as pb


def step(ids: list[int], frames: list[list[int]], finished: list[int], **kw) -> pb.StepFrames:
    return pb.StepFrames(
        step=1,
        request_ids=np.array(ids, dtype="<u8").tobytes(),
        frames=np.array(frames, dtype="<i4").tobytes(),
        finished=bytes(finished),
        **kw,
    )


def run(coro):
    return asyncio.run(coro)


def test_each_stream_gets_its_own_row_and_the_end_reason():
    async def main():
        metrics = LBMetrics(CollectorRegistry())
        table = StreamTable(metrics, lambda: 3)
        a, b = table.open(1 << 63, {}), table.open(5, {})
        table.dispatch(
            step(
                [5, 1 << 63, 99],
                [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
                [1, 0, 0],
                stamps={5: pb.Stamps(ns={"d_last": 10})},
            )
        )
        assert a.drain_ready() == [Frames([[4, 5, 6]], "")]
        assert b.drain_ready() == [Frames([[1, 2, 3]], "eos")]
        assert b.ended and b.stamps == {"d_last": 10}
        assert metrics.unknown_frames._value.get() == 1  # id 99: not a stream of this LB
        table.dispatch(
            step(
                [],
                [],
                [],
                errors=[
                    pb.StreamError(
                        request_id=1 << 63, status=pb.CHECKSUM_MISMATCH, message="rows differ"
                    )
                ],
            )
        )
        assert a.drain_ready() == [StreamFailure("checksum_mismatch", "rows differ")]

    run(main())


def test_a_malformed_step_fails_the_streams_it_names():
    async def main():
        table = StreamTable(LBMetrics(CollectorRegistry()), lambda: 11)
        s = table.open(7, {})
        table.dispatch(step([7], [[1, 2, 3]], [0]))  # 3 ids where 11 are expected
        (event,) = s.drain_ready()
        assert isinstance(event, StreamFailure) and event.code == "decode_protocol_error"

    run(main())


def test_fail_all_reaches_only_streams_still_running_and_wait_empty_follows_close():
    async def main():
        table = StreamTable(LBMetrics(CollectorRegistry()), lambda: 1)
        done, running = table.open(1, {}), table.open(2, {})
        table.dispatch(step([1], [[0]], [2]))
        assert table.fail_all("decode_unavailable", "gone") == 1
        assert running.drain_ready() == [StreamFailure("decode_unavailable", "gone")]
        assert done.drain_ready() == [Frames([[0]], "length")]
        assert not await table.wait_empty(0.01)
        table.close(1)
        table.close(2)
        assert await table.wait_empty(0.01)
        assert await table.wait_empty(0)  # the LB's shutdown with --shutdown-timeout-s 0 (pdunit local's)

    run(main())


def test_a_stream_is_silent_only_while_its_response_is_written_and_until_it_ends():
    async def main():
        s = StreamTable(LBMetrics(CollectorRegistry()), lambda: 11).open(7, {})
        s.last_event = 100.0
        assert s.silent_for(105.0) == 0.0  # not written yet: P may still be prefilling it
        s.writing = True
        assert s.silent_for(105.0) == 5.0
        s.push(Frames([[1] * 11]))  # an event restarts the count
        assert s.silent_for(s.last_event + 0.5) == 0.5
        s.push(StreamFailure("frame_timeout", "x"))
        assert s.ended and s.silent_for(s.last_event + 60) == 0.0  # ended: the watchdog leaves it

    run(main())
