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


def test_a_full_cache_ends_the_request_and_returns_its_pool_pages(engine):
    replies: dict[int, pb.SubmitReply] = {}
    engine.submit(job(1, 400, replies))
    engine.submit(job(2, 400, replies))  # 800 rows > the cache's 512 slots, the first one pinned
    engine._admit_waiting()
    assert replies[2].status == pb.NO_CAPACITY and "prefix cache full" in replies[2].message
    assert engine.pool.free_pages == POOL - (400 + 4)  # only request 1 holds pages
    assert engine.cancel(1)
    engine._drop_cancelled_prefills()
    assert whole(engine)
