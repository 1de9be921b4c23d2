"""`pdunit bench pipeline`: P's real pipeline, its forward sleeping bench plan's price,
beside the model, on the same requests."""

from __future__ import annotations

import json

from pdunit.bench import pipeline
from tests.bench.test_plan import write_inputs


def test_the_engine_and_the_model_answer_the_same_requests(tmp_path):
    argv = write_inputs(tmp_path) + ["--rate", "6", "--duration", "2", "--reserve-ms", "1",
                                     "--reserve-concurrency", "1,8", "--out", str(tmp_path / "pipe.json")]
    assert pipeline.main(argv) == 0
    every = json.loads((tmp_path / "pipe.json").read_text())["rows"]
    assert [(r["reserve_concurrency"], r["side"]) for r in every] == [(1, "engine"), (1, "model"),
                                                                       (8, "engine"), (8, "model")]
    for side in every:  # the TTFA the model's D gives each side's prefill ends
        assert side["ttfa_p95_ms"] >= side["ttfa_p50_ms"] > 0 and side["ttft_p95_ms"] > 0
    rows = every[:2]
    engine, model = rows
    assert engine["answered"] == model["answered"] > 0  # every request through P's stages
    assert engine["forwards"] >= 1 and engine["prompts_per_forward"] >= 1
    for side in rows:
        for stage in ("p_reserved after p_admitted", "prefill_start after p_reserved",
                      "prefill_end after prefill_start"):
            assert side[f"{stage} p50"] is not None and side[f"{stage} p50"] >= 0, (side["side"], stage)
    # the forward sleeps the model's price: the engine's forwards last as long as the model's
    assert abs(engine["prefill_end after prefill_start p50"] - model["prefill_end after prefill_start p50"]) < 0.5 * \
        model["prefill_end after prefill_start p50"] + 5
