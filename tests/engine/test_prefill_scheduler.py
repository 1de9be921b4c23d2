"""What P runs next (engine/prefill/scheduler.py): prompts in arrival order, and a
forward's batch bounded by prompt count and rows, a prompt alone always making one."""

from __future__ import annotations

import numpy as np
import pytest

from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.prefill.scheduler import PrefillJob, PrefillScheduler, joins_batch


def job(rid: int, rows: int = 4) -> PrefillJob:
    return PrefillJob(rid, np.zeros((rows, 11), dtype=np.int64), SamplingParams(), 0, {})


def test_a_prompt_joins_the_batch_while_both_bounds_hold():
    assert joins_batch(prompts=1, rows=40, next_rows=60, max_prompts=3, max_rows=100)
    assert not joins_batch(prompts=1, rows=40, next_rows=61, max_prompts=3, max_rows=100)  # 101 rows
    assert not joins_batch(prompts=3, rows=30, next_rows=1, max_prompts=3, max_rows=100)  # 4 prompts


def test_a_prompt_alone_makes_a_batch_even_over_the_row_bound():
    assert joins_batch(prompts=0, rows=0, next_rows=500, max_prompts=1, max_rows=100)
    assert not joins_batch(prompts=1, rows=500, next_rows=1, max_prompts=2, max_rows=100)


def test_the_queue_hands_out_prompts_in_arrival_order_and_put_back_goes_first():
    s = PrefillScheduler(16, 8192)
    for rid in (1, 2, 3):
        s.put(job(rid))
    first = s.take(0)
    assert first is not None and first.request_id == 1
    s.put_back(first)
    assert [s.take(0).request_id for _ in range(3)] == [1, 2, 3]  # type: ignore[union-attr]
    assert s.take(0) is None and len(s) == 0


def test_a_cancelled_prompt_leaves_the_queue_marked_and_is_never_taken():
    s = PrefillScheduler(16, 8192)
    for rid in (1, 2):
        s.put(job(rid))
    cancelled = s.cancel(1)
    assert cancelled is not None and cancelled.cancelled and s.cancel(1) is None
    assert s.request_ids() == [2]
    taken = s.take(0)
    assert taken is not None and taken.request_id == 2


@pytest.mark.parametrize("bounds", [(0, 10), (10, 0)])
def test_bounds_below_one_are_refused_naming_both(bounds):
    with pytest.raises(ValueError, match="max_batch_prompts and max_batch_rows must be >= 1"):
        PrefillScheduler(*bounds)
