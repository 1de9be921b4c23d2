"""The load driver's frames API against a real local csm-tiny unit on CPU (issue 23): its
prompts follow the row rule GET /v1/model shows, so the LB admits every one (no 422
invalid_row) and each stream gets its frames."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdunit.engine.loadgen.driver import LoadConfig, run_load
from pdunit.engine.local import LocalConfig, LocalUnit

MODEL, FRAMES = "random:csm-tiny:0", 6


@pytest.fixture(scope="module")
def unit() -> Iterator[LocalUnit]:
    cfg = LocalConfig(model=MODEL, pool_tokens=4096, cache_tokens=4096, lb_port=0, guard=False,
                      log_level="warning")
    with LocalUnit(cfg) as u:
        yield u


def test_a_short_load_of_csm_rows_is_admitted_and_streams_every_frame(unit: LocalUnit) -> None:
    cfg = LoadConfig(url=unit.url, concurrency=[2], requests=6, prompt_rows=(20, 40), frames=(FRAMES, FRAMES),
                     voices=2, voice_reuse=0.5, seed=5, progress=False, gpus=0, min_rate=0.0,
                     ttfa_p95_ms=60_000.0)
    doc = run_load(cfg, keep_streams=True)
    assert doc["config"]["model"]["row_rule"] is not None  # the model has a rule: csm's rows
    row = doc["rows"][0]
    assert (row["streams"], row["ok"], row["errors"], row["error_kinds"]) == (6, 6, 0, {})
    assert all(s["status"] == 200 and s["frames"] == FRAMES for s in doc["streams"])
    assert {s["reused"] for s in doc["streams"]} == {True, False}  # warm and cold voices both sent
