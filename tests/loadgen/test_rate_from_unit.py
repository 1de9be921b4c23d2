"""The frame rate and the rate floor follow the model end to end (issue 23): a real CSM unit
on CPU whose checkpoint's codec_config names 12.5 Hz (Mimi's) announces it in D's Hello,
the LB's GET /v1/model shows it with its floor of 25 frames/s, and the load generator
judges streams at 12.5 / 25 unless told otherwise; a pdunit-family monolith (no frame rate
named) gets 21 / 42. Real engines and LB; the checkpoint is transformers' own tiny CSM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdunit.engine.loadgen.driver import LoadConfig, run_load
from pdunit.engine.local import LocalConfig, LocalUnit
from tests.engine.test_csm_family import tiny_csm

MIMI_HZ = 12.5


@pytest.fixture(scope="module")
def csm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CSM checkpoint whose codec_config says Mimi's frame rate, as a saved CSM-1B does."""
    directory = tmp_path_factory.mktemp("csm")
    tiny_csm().save_pretrained(str(directory))
    config = json.loads((directory / "config.json").read_text())
    config["codec_config"]["frame_rate"] = MIMI_HZ
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def unit(model: str, mode: str) -> LocalUnit:
    return LocalUnit(LocalConfig(model=model, mode=mode, pool_tokens=4096, cache_tokens=4096, lb_port=0,
                                 guard=False, log_level="warning"))


@pytest.fixture(scope="module")
def csm_pd(csm_dir: Path) -> Iterator[LocalUnit]:
    with unit(str(csm_dir), "pd") as u:
        yield u


@pytest.fixture(scope="module")
def tiny_monolith() -> Iterator[LocalUnit]:
    with unit("random:tiny:0", "monolith") as u:
        yield u


def short_load(url: str, **given: float) -> dict:
    cfg = LoadConfig.model_validate(dict(url=url, concurrency=[1], requests=2, prompt_rows=(20, 30), frames=(6, 6),
                                         voices=1, progress=False, gpus=0, ttfa_p95_ms=60_000.0) | given)
    return run_load(cfg)


def test_a_csm_unit_announces_mimis_rate_and_the_load_generator_judges_at_its_floor(csm_pd: LocalUnit) -> None:
    model = httpx.get(f"{csm_pd.url}/v1/model", timeout=10).json()
    assert (model["frame_rate_hz"], model["rate_floor_fps"]) == (MIMI_HZ, 2 * MIMI_HZ)
    doc = short_load(csm_pd.url)
    assert (doc["config"]["fps"], doc["config"]["min_rate"]) == (MIMI_HZ, 2 * MIMI_HZ)
    assert doc["rows"][0]["ok"] == 2
    # flags win over the unit's
    doc = short_load(csm_pd.url, fps=21.0)
    assert (doc["config"]["fps"], doc["config"]["min_rate"]) == (21.0, 42.0)
    doc = short_load(csm_pd.url, min_rate=0.0)
    assert (doc["config"]["fps"], doc["config"]["min_rate"]) == (MIMI_HZ, 0.0)
    assert doc["config"]["rate_source"]["min_rate"] == "given"


def test_a_pdunit_family_monolith_plays_at_21_with_a_floor_of_42(tiny_monolith: LocalUnit) -> None:
    model = httpx.get(f"{tiny_monolith.url}/v1/model", timeout=10).json()
    assert (model["frame_rate_hz"], model["rate_floor_fps"]) == (21.0, 42.0)
    doc = short_load(tiny_monolith.url)
    assert (doc["config"]["fps"], doc["config"]["min_rate"]) == (21.0, 42.0)
    assert "the unit's frame rate" in doc["config"]["rate_source"]["fps"]
