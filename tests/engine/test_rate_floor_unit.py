"""Rate-floor admission through a real unit (LB + P + D as processes): D refuses a
stream that would break the floor, the client gets 503 + Retry-After naming
`rate_floor` before any prefill, nothing stays held, and /v1/load and D's metrics carry
the headroom. The step model is a seed file so that the verdicts do not depend on this
machine's speed: 8 ms per stream + 0.004 ms per context token against a 42 frames/s
floor (budget 23.8 ms less 10% = 21.4 ms) admits exactly two streams of 64 rows x 400
frames (19.7 ms at their end; three: 29.6), and no stream of 4000 frames even alone
(24.3 ms at its end)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdunit.engine.decode.step_model import StepCoefficients
from pdunit.engine.local import LocalConfig, LocalUnit
from pdunit.engine.ports import free_port_block
from tests.engine.unit_client import load, random_prompt, stream, wait_empty

SMALL = dict(pool_tokens=16384, cache_tokens=16384, lb_port=0, guard=False, log_level="warning")


@pytest.fixture(scope="module")
def floor_unit(tmp_path_factory: pytest.TempPathFactory):
    fit = Path(tmp_path_factory.mktemp("fit")) / "step.fit.json"
    fit.write_text(StepCoefficients(base_ms=0.0, per_stream_ms=8.0, per_token_ms=0.004).to_json())
    # --no-step-model-refit: D keeps the fit as it is; its own steps on this (loaded)
    # machine would move a refitted model and how many of the five streams it admits
    decode = ["--rate-floor", "42", "--step-model", str(fit), "--headroom-stream", "64:400", "--no-step-model-refit"]
    cfg = LocalConfig(mode="pd", extra_decode_args=decode, metrics_port=free_port_block(4), **SMALL)
    with LocalUnit(cfg) as unit:
        yield unit


def test_streams_beyond_the_floor_are_refused_with_503_and_nothing_held(floor_unit: LocalUnit) -> None:
    """One test, in this order (the verdicts rest on the fit, which D keeps as it is)."""
    url = floor_unit.url
    doc = load(url)
    assert doc.headroom_streams == 2 and doc.decoders[0].headroom_streams == 2, doc
    # a stream that alone would break the floor: a 4xx naming it, not a retry
    frames, last = stream(url, random_prompt(64, seed=9), max_frames=4000, min_frames=4000)
    assert frames == [] and last["http_status"] == 422, last
    assert "even alone" in last["error"]["message"] and "rate_floor" in last["error"]["message"], last
    prompts = [random_prompt(64, seed=i) for i in range(5)]
    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(lambda p: stream(url, p, max_frames=400, min_frames=400), prompts))
    done = [frames for frames, last in results if last.get("finish_reason") or last.get("done")]
    refused = [last for frames, last in results if last.get("http_status") == 503]
    assert len(done) == 2, results
    assert all(len(frames) == 400 for frames in done)
    assert len(refused) == 3, [last for _, last in results]
    for last in refused:
        assert last["error"]["code"] == "rate_floor", last
        assert "rate_floor" in last["error"]["message"]
    # nothing held once the admitted two ended, and the headroom is the fit's again
    assert wait_empty(url, what="the unit empty").headroom_streams == 2
    (d_metrics,) = [u for name, u in floor_unit.metrics_urls().items() if name.startswith("decode")]
    text = httpx.get(d_metrics, timeout=5).text
    assert "pdunit_rate_floor_refusals_total 3.0" in text, text  # the 4xx is no refusal to retry
    assert 'pdunit_step_model_coefficient_ms{term="per_stream_ms"}' in text
