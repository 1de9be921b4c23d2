"""The monolith's `budget` policy (engine/monolith/policy.py): a step's prompt rows never
make its predicted time exceed the floor's budget beside the decoding streams, they are
the most that fit (in whole blocks), one block always runs, a stream-less step runs the
prompt whole; rows follow admission's trust rule without a fit that prices them; and a
budget without a floor is refused, naming the flag."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from pydantic import ValidationError

from pdunit.engine.decode.admission import AdmissionControl, RateFloorAdmission
from pdunit.engine.decode.hub import FrameHub
from pdunit.engine.decode.step_model import StepCoefficients, StepModel
from pdunit.engine.decode.stream_lives import HeldStream
from pdunit.engine.kv.pool import PagePool
from pdunit.engine.model.loader import load_model
from pdunit.engine.monolith.main import MonolithConfig
from pdunit.engine.monolith.policy import RowBudget, budget_rows
from pdunit.engine.monolith.worker import MonolithEngine
from pdunit.engine.settings import parse_config

BLOCK, MAX_ROWS = 16, 8192
MODELS = [  # an H200-like decode fit with a per-row cost, a slow one, one dominated by context
    StepCoefficients(base_ms=3.23, per_stream_ms=0.0061, per_token_ms=0.000032, per_row_ms=0.0021),
    StepCoefficients(base_ms=5.0, per_stream_ms=0.05, per_token_ms=0.0001, per_row_ms=0.02),
    StepCoefficients(base_ms=1.0, per_stream_ms=0.0, per_token_ms=0.002, per_row_ms=0.004),
]


@pytest.mark.parametrize("model", MODELS)
def test_planned_rows_never_make_the_predicted_step_exceed_the_budget(model: StepCoefficients) -> None:
    budget = 1000 / 42 * 0.9
    for streams, context in itertools.product([1, 2, 8, 32, 64, 128, 256, 512, 1024],
                                              [100, 1000, 2000, 8000]):
        ctx = streams * context
        rows = budget_rows(model, budget, streams, ctx, BLOCK, MAX_ROWS)
        assert BLOCK <= rows <= MAX_ROWS and rows % BLOCK == 0, (streams, context, rows)
        if model.ms(streams, ctx, BLOCK) <= budget:
            assert model.ms(streams, ctx, rows) <= budget, (streams, context, rows)
            # the most that fits: one more block would break the budget, or the forward's cap
            assert rows == MAX_ROWS or model.ms(streams, ctx, rows + BLOCK) > budget, (streams, context, rows)
        else:  # the decode batch leaves less than a block: the minimum chunk still makes progress
            assert rows == BLOCK, (streams, context, rows)


def test_without_a_decoding_stream_the_prompt_runs_whole() -> None:
    assert budget_rows(MODELS[1], 1.0, 0, 0, BLOCK, MAX_ROWS) == MAX_ROWS  # even over any budget


def test_unpriced_rows_are_bounded_by_the_trust_limit_only() -> None:
    free_rows = StepCoefficients(base_ms=1.0, per_stream_ms=0.01, per_token_ms=0.0)
    assert budget_rows(free_rows, 21.4, 8, 8000, BLOCK, MAX_ROWS) == MAX_ROWS
    assert budget_rows(free_rows, 21.4, 8, 8000, BLOCK, MAX_ROWS, trusted_rows=100) == 96  # whole blocks
    assert budget_rows(free_rows, 21.4, 8, 8000, BLOCK, MAX_ROWS, trusted_rows=5) == BLOCK
    with pytest.raises(ValueError, match="block_rows"):
        budget_rows(free_rows, 21.4, 8, 8000, 0, MAX_ROWS)


def admission(seed: StepCoefficients, seeded: bool) -> AdmissionControl:
    return AdmissionControl(RateFloorAdmission(StepModel(seed), 42.0), HeldStream(1500, 420), seeded=seeded)


def test_rows_follow_admissions_trust_rule_without_a_fit_that_prices_them() -> None:
    """No fit file: twice the widest prompt rows one observed step carried (at least a
    block), as admission trusts twice the widest batch; a fit file without a per-row term
    the same; a fit file with one: the model alone."""
    cold = RowBudget(admission(StepCoefficients(0.0, 0.0, 0.0), seeded=False), BLOCK, MAX_ROWS)
    assert cold.trusted_rows() == BLOCK and cold.rows(4, 4000) == BLOCK
    cold.observe(300)
    cold.observe(100)
    assert cold.trusted_rows() == 600 and cold.rows(4, 4000) == 592
    no_rows = RowBudget(admission(StepCoefficients(3.0, 0.01, 0.0), seeded=True), BLOCK, MAX_ROWS)
    no_rows.observe(1000)
    assert no_rows.trusted_rows() == 2000
    priced = RowBudget(admission(MODELS[0], seeded=True), BLOCK, MAX_ROWS)
    assert priced.trusted_rows() is None
    assert priced.rows(64, 64 * 1500) == budget_rows(MODELS[0], 1000 / 42 * 0.9, 64, 64 * 1500, BLOCK, MAX_ROWS)


def test_budget_policy_without_a_rate_floor_is_refused_naming_the_flag() -> None:
    cfg = parse_config(MonolithConfig, ["--policy", "budget", "--rate-floor", "0"], "pdunit monolith")
    assert cfg.policy == "budget"  # a CLI choice; the engine refuses it without a floor
    with pytest.raises(ValidationError, match="policy"):
        MonolithConfig(policy="fastest")
    model = load_model("random:tiny:0", device="cpu")
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="--rate-floor > 0"):
            MonolithEngine(model, "random:tiny:0", PagePool(256, 1), model.new_kv_storage(256), FrameHub(loop),
                           "budget", chunk_tokens=64, max_batch=8, max_batch_rows=256, admission=None)
    finally:
        loop.close()


def test_budget_admission_charges_each_step_one_minimum_chunk() -> None:
    """The policy fills the spare budget with prompt rows, so admission counts as load only
    the chunk that always runs, not the rows it soaked up."""
    model = load_model("random:tiny:0", device="cpu")
    loop = asyncio.new_event_loop()
    try:
        e = MonolithEngine(model, "random:tiny:0", PagePool(256, 1), model.new_kv_storage(256), FrameHub(loop),
                           "budget", chunk_tokens=64, max_batch=8, max_batch_rows=256,
                           admission=admission(MODELS[0], seeded=True), min_chunk_rows=32)
        e._observe(4, 400, 0.01, 500)
        assert e.prefill_rows_per_step() == 32.0
    finally:
        loop.close()
