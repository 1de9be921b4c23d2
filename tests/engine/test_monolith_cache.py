"""The monolith's prefix cache on the paths a stream rarely takes end to end: a request
cancelled while queued or mid-prefill, and a cache with every slot pinned. Nothing
leaks: no lease, no pool page."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from pdunit.engine.decode.hub import FrameHub
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.kv.prefix_cache import PrefixCache
from pdunit.engine.model.loader import load_model
from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.monolith.worker import MonolithEngine
from pdunit.engine.prefill.scheduler import PrefillJob
from pdunit.engine.proto import pdunit_pb2 as pb

POOL, CACHE = 2048, 512


@pytest.fixture
def engine():
    model = load_model("random:tiny:0", device="cpu")
    loop = asyncio.new_event_loop()
    e = MonolithEngine(model, "random:tiny:0", PagePool(POOL, 1), model.new_kv_storage(POOL + CACHE),
                       FrameHub(loop), "chunked", chunk_tokens=64, max_batch=8, max_batch_rows=4096,
                       cache=PrefixCache(CACHE, 16))
    yield e
    loop.close()


def job(rid: int, rows: int, replies: dict[int, pb.SubmitReply]) -> PrefillJob:
    prompt = np.random.default_rng(rid).integers(0, 100, size=(rows, 11), dtype=np.int64)  # tiny: 11 codebooks
    return PrefillJob(rid, prompt, SamplingParams(max_frames=4), int(time.time() * 1000) + 30_000, {},
                      done=lambda reply: replies.__setitem__(rid, reply))


def whole(e: MonolithEngine) -> bool:
    stats = e.cache.stats()
    return (e.pool.free_pages == POOL and stats["pinned_blocks"] == 0
            and stats["free_slots"] + 16 * stats["cached_blocks"] == CACHE)


def test_a_request_cancelled_while_queued_leaves_nothing_behind(engine):
    replies: dict[int, pb.SubmitReply] = {}
    queued = job(1, 100, replies)
    engine.submit(queued)
    assert queued.prefix_chain is not None and len(queued.prefix_chain) == 100 // 16  # hashed at submit
    assert engine.cancel(1)
    assert replies[1].status == pb.CANCELLED and whole(engine)


def test_a_request_cancelled_mid_prefill_returns_its_lease_and_pages(engine):
    replies: dict[int, pb.SubmitReply] = {}
    engine.submit(job(1, 200, replies))
    engine._admit_waiting()
    assert engine.prefilling and engine.prefilling[0].lease is not None
    assert engine.pool.free_pages < POOL and engine.cache.stats()["free_slots"] < CACHE
    assert engine._run_step()  # one chunk of 64 of its 200 rows
    assert engine.prefilling[0].done_rows == 64
    assert engine.cancel(1)
    engine._drop_cancelled_prefills()
    assert replies[1].status == pb.CANCELLED and whole(engine)


def test_a_prompt_waits_queued_while_prompts_in_flight_pin_the_cache_then_runs(engine):
    """The cache's slots pinned by a prompt in flight: the next one stays queued holding
    nothing (no pool pages, no lease), and runs once they come back."""
    replies: dict[int, pb.SubmitReply] = {}
    engine.submit(job(1, 400, replies))
    engine.submit(job(2, 400, replies))  # 800 rows > the cache's 512 slots, the first one pinned
    engine._admit_waiting()
    assert [p.job.request_id for p in engine.prefilling] == [1] and 2 not in replies
    assert engine.waiting.request_ids() == [2]
    assert engine.pool.free_pages == POOL - (400 + 4)  # only request 1 holds pages
    for _ in range(200):
        if 1 in replies and 2 in replies:
            break
        engine._admit_waiting()
        engine._run_step()
    assert replies[1].status == replies[2].status == pb.STATUS_OK
    while engine._run_step():  # both decode their 4 frames and end
        pass
    assert whole(engine)


def test_a_prompt_larger_than_the_idle_cache_is_refused_and_returns_its_pool_pages(engine):
    replies: dict[int, pb.SubmitReply] = {}
    engine.submit(job(1, 600, replies))  # > the cache's 512 slots with nothing in flight
    engine.submit(job(2, 100, replies))
    engine._admit_waiting()
    assert replies[1].status == pb.NO_CAPACITY and "prefix cache full" in replies[1].message
    assert [p.job.request_id for p in engine.prefilling] == [2]  # the queue goes on behind it
    assert engine.cancel(2)
    engine._drop_cancelled_prefills()
    assert whole(engine)


def test_admission_stops_at_a_forwards_worth_of_prompt_rows(engine):
    """Prompts past `max_batch_rows` pending rows stay queued, holding no pages."""
    replies: dict[int, pb.SubmitReply] = {}
    engine.max_batch_rows = 250
    engine.cache = None  # the pool alone: nothing else limits admission here
    for rid in range(1, 5):
        engine.submit(job(rid, 100, replies))
    engine._admit_waiting()
    assert [p.job.request_id for p in engine.prefilling] == [1, 2, 3]  # 300 rows: the third crosses 250
    assert engine.waiting.request_ids() == [4]
    assert engine.pool.free_pages == POOL - 3 * (100 + 4)
