"""Every process times its garbage collections (engine/observability.py): a collection
stops every thread, so in D or the LB it is a stall every stream sees."""

from __future__ import annotations

import gc
import logging
import weakref
from urllib.parse import urlparse

import pytest
from prometheus_client import REGISTRY, generate_latest

from pdunit.engine.observability import (
    SERVING_GC_THRESHOLDS,
    _time_gc,
    settle_gc_for_serving,
    setup_logging,
    watch_gc_pauses,
)


def _count(generation: str) -> float:
    return REGISTRY.get_sample_value("pdunit_gc_pause_seconds_count", {"generation": generation}) or 0.0


def _sum(generation: str) -> float:
    return REGISTRY.get_sample_value("pdunit_gc_pause_seconds_sum", {"generation": generation}) or 0.0


def test_a_full_collection_is_timed_into_the_histogram_once_per_collection():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging("test")  # what every process calls first: it starts the timing
    finally:  # the process-wide logging setup would leak into later tests (their caplog)
        root.handlers[:], root.level = handlers, level
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
    assert _count("2") >= count + 3  # the three asked for (the collector may run one more itself)
    assert _sum("2") > total
    assert 'pdunit_gc_pause_seconds_count{generation="2"}' in generate_latest(REGISTRY).decode()


@pytest.mark.parametrize("mode", ["pd", "monolith"])
def test_every_serving_process_freezes_its_start_up_objects(mode):
    """LB, P and D (or the monolith) each move what start-up left alive out of the
    collector's reach: a full collection in D walked ~200k objects, ~89 ms on this CPU."""
    from pdunit.bench.report import scrape_metrics
    from pdunit.engine.local import LocalConfig, LocalUnit
    from pdunit.engine.ports import free_port

    ports = {role: free_port() for role in (("prefill", "decode") if mode == "pd" else ("monolith",))}
    extra = {f"extra_{role}_args": ["--metrics-port", str(port)] for role, port in ports.items()}
    cfg = LocalConfig(mode=mode, pool_tokens=4096, cache_tokens=4096, lb_port=0, guard=False, log_level="warning",
                      **extra)
    with LocalUnit(cfg) as unit:
        ports["lb"] = int(urlparse(unit.url).port or 0)  # the LB serves /metrics on its own port
        scraped = {role: scrape_metrics(port) for role, port in ports.items()}
    frozen = {role: values["pdunit_gc_frozen_objects"] for role, values in scraped.items()}
    # thousands each: the imports alone leave tens of thousands of tracked objects
    assert all(n > 10_000 for n in frozen.values()), frozen
    # and each times its collections (start-up collects before the settling)
    for role, values in scraped.items():
        assert any(k.startswith("pdunit_gc_pause_seconds_count{") for k in values), role
    assert 'pdunit_gc_pause_seconds_count{generation="0"}' in scraped["lb"]


def test_settling_freezes_what_start_up_left_and_collects_the_young_generation_less_often():
    class Node:
        other: object = None

    thresholds = gc.get_threshold()
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    garbage = weakref.ref(a)
    del a, b
    kept = [[i] for i in range(5000)]  # lists: always tracked by the collector
    try:
        settle_gc_for_serving(logging.getLogger("test"))
        assert garbage() is None  # start-up garbage collected first, not frozen
        assert gc.get_threshold() == SERVING_GC_THRESHOLDS
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(x) in tracked for x in kept)  # alive at the call: out of the collector's reach
        # read at scrape: a frozen object another thread frees meanwhile (a test before
        # this one's leftovers) leaves the count, which only falls until the next freeze
        before = gc.get_freeze_count()
        exported = REGISTRY.get_sample_value("pdunit_gc_frozen_objects")
        assert exported is not None and before >= exported >= gc.get_freeze_count() > len(kept)
    finally:  # this test process is not a server
        gc.unfreeze()
        gc.set_threshold(*thresholds)
