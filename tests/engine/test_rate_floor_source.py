"""The rate floor follows the model (ARCHITECTURE.md 4): --rate-floor, else 2 x the loaded
codec's frame rate, else 2 x the model config's, else 42; off on CPU; exported and logged."""

from __future__ import annotations

import copy

import pytest
from prometheus_client import CollectorRegistry

from pdunit.engine import metrics
from pdunit.engine.decode.admission import (
    DEFAULT_FLOOR_FPS,
    AdmissionFields,
    build_admission,
    resolve_floor,
)
from pdunit.engine.model.family_csm import _CSM_TINY, CsmFamily
from pdunit.engine.model.loader import load_model


def test_the_flag_wins_then_codec_then_model_then_default() -> None:
    assert resolve_floor(30.0, True, 12.5, 12.5).fps == 30.0
    assert resolve_floor(30.0, True, 12.5, 12.5).source == "flag"
    assert resolve_floor(0.0, True, 12.5).fps == 0.0  # 0 = off, asked for
    codec = resolve_floor(None, True, 12.5, 21.0)
    assert (codec.fps, codec.source) == (25.0, "codec")
    model = resolve_floor(None, True, None, 12.5)
    assert (model.fps, model.source) == (25.0, "model")
    default = resolve_floor(None, True)
    assert (default.fps, default.source) == (DEFAULT_FLOOR_FPS, "default") and "42" in default.detail


def test_cpu_default_stays_off_and_the_flag_still_turns_it_on() -> None:
    assert resolve_floor(None, False, 12.5, 12.5).fps == 0.0
    assert resolve_floor(None, False).source == "cpu"
    assert resolve_floor(25.0, False).fps == 25.0
    assert build_admission(AdmissionFields(), False) is None


def test_the_floor_is_exported_with_its_source() -> None:
    registry = CollectorRegistry()
    metrics.register_role("decode", registry)
    adm = build_admission(AdmissionFields(), True, resolve_floor(None, True, None, 12.5))
    assert adm is not None and adm.admission.floor_fps == 25.0
    assert registry.get_sample_value("pdunit_rate_floor_frames_per_second", {"source": "model"}) == 25.0
    build_admission(AdmissionFields(), False)  # off on CPU: the series says 0, from "cpu"
    assert registry.get_sample_value("pdunit_rate_floor_frames_per_second", {"source": "model"}) is None
    assert registry.get_sample_value("pdunit_rate_floor_frames_per_second", {"source": "cpu"}) == 0.0


def csm_model(codec_config: dict | None) -> object:
    raw = copy.deepcopy(_CSM_TINY)
    if codec_config is not None:
        raw["codec_config"] = codec_config
    family = CsmFamily()
    return family.build(family.parse_config(raw, "csm-test"), "meta")


def test_csm_frame_rate_comes_from_its_codec_config() -> None:
    # saved with frame_rate (older transformers), or computed as MimiConfig does
    assert csm_model({"codebook_size": 32, "frame_rate": 12.5}).frame_rate_hz == 12.5  # type: ignore[attr-defined]
    assert csm_model({"codebook_size": 32}).frame_rate_hz == 12.5  # type: ignore[attr-defined]
    assert csm_model({"sampling_rate": 800, "upsampling_ratios": [4, 4]}).frame_rate_hz == 25.0  # type: ignore[attr-defined]
    assert csm_model(None).frame_rate_hz is None  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="codec_config.frame_rate"):
        csm_model({"frame_rate": -1})


def test_pdunit_and_csm_tiny_name_no_frame_rate() -> None:
    assert load_model("random:tiny:0").frame_rate_hz is None
    assert load_model("random:csm-tiny:0").frame_rate_hz is None


def test_csm_transformers_default_config_gives_25() -> None:
    transformers = pytest.importorskip("transformers")
    codec = transformers.CsmConfig().to_dict()["codec_config"]
    rate = csm_model({k: v for k, v in codec.items() if k in ("sampling_rate", "upsampling_ratios", "_frame_rate")})
    floor = resolve_floor(None, True, None, rate.frame_rate_hz)  # type: ignore[attr-defined]
    assert floor.fps == 25.0
