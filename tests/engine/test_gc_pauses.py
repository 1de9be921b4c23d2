"""Every process times its garbage collections (engine/observability.py): a collection
stops every thread, so in D or the LB it is a stall every stream sees."""

from __future__ import annotations

import gc

from prometheus_client import REGISTRY, generate_latest

from pdunit.engine.observability import _time_gc, setup_logging, watch_gc_pauses


def _count(generation: str) -> float:
    return REGISTRY.get_sample_value("pdunit_gc_pause_seconds_count", {"generation": generation}) or 0.0


def _sum(generation: str) -> float:
    return REGISTRY.get_sample_value("pdunit_gc_pause_seconds_sum", {"generation": generation}) or 0.0


def test_a_full_collection_is_timed_into_the_histogram_once_per_collection():
    setup_logging("test")
    watch_gc_pauses()  # a second call adds no second callback
    assert gc.callbacks.count(_time_gc) == 1
    count, total = _count("2"), _sum("2")
    for _ in range(3):
        junk = [[] for _ in range(20000)]
        for a, b in zip(junk, junk[1:], strict=False):  # cycles only the cyclic collector frees
            a.append(b)
            b.append(a)
        del junk
        gc.collect(2)
    assert _count("2") == count + 3
    assert _sum("2") > total
    assert 'pdunit_gc_pause_seconds_count{generation="2"}' in generate_latest(REGISTRY).decode()
