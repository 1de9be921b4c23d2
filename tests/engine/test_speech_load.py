"""The load driver's `--api speech` against a real local unit (tiny random CSM + tiny random
Mimi on CPU): voices uploaded, streams of PCM timed at the first audio byte, audio seconds
equal to frames x samples per frame / rate, no stall at a light load, a reused voice a
prefix-cache hit in P as the LB reports it; voice uploads and deletes carry the unit's voices token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from pdunit.engine.loadgen.driver import (
    LoadConfig,
    SpeechTarget,
    fetch_model,
    run_load,
    speech_once,
    speech_target,
    upload_warm_voices,
)
from pdunit.engine.loadgen.workload import StreamSpec, warm_voice
from pdunit.engine.local import LocalConfig, LocalUnit

MODEL, CODEC = "random:csm-tiny:0", "random:mimi-tiny:0"
FRAMES = 24


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalUnit]:
    voices = tmp_path_factory.mktemp("voices")
    cfg = LocalConfig(model=MODEL, codec=CODEC, voices=str(voices), pool_tokens=4096, cache_tokens=4096,
                      lb_port=0, guard=False, log_level="warning")
    with LocalUnit(cfg) as u:
        yield u


def load(unit: LocalUnit, **fields: object) -> LoadConfig:
    base: dict[str, object] = dict(url=unit.url, api="speech", frames=(FRAMES, FRAMES), progress=False, gpus=0,
                                   min_rate=0.0, ttfa_p95_ms=60_000.0, concurrency=[2], requests=6,
                                   voices_token_file=unit.voices_token_file)
    return LoadConfig.model_validate(base | fields)


def test_speech_streams_measure_audio_seconds_without_stalls_at_a_light_load(unit: LocalUnit) -> None:
    audio = httpx.get(f"{unit.url}/v1/model", timeout=10).json()["audio"]
    doc = run_load(load(unit, voices=2, voice_reuse=0.5, seed=11), keep_streams=True)
    row, streams = doc["rows"][0], doc["streams"]
    assert row["api"] == "speech" and doc["config"]["speech"]["model"] == MODEL
    assert (row["streams"], row["ok"], row["errors"]) == (6, 6, 0), row["error_kinds"]
    seconds = FRAMES * audio["samples_per_frame"] / audio["sample_rate"]
    for s in streams:
        assert s["frames"] == FRAMES
        assert s["audio_s"] == pytest.approx(seconds)
        assert s["ttfa_s"] is not None and s["ttfa_s"] <= s["ttft_s"] + 1e-9 <= s["last_frame_s"] + 1e-9
    assert row["audio_s_total"] == pytest.approx(6 * seconds)
    # light load: 2 streams of the tiny model make frames far faster than 25 a second
    assert (row["stalls"], row["audio_stalls"], row["stutter_share"], row["audio_stutter_share"]) == (0, 0, 0, 0)
    # a cold voice (uploaded for its one stream, deleted after) shares no block with any other
    assert row["cold_cache_hit_share"] in (None, 0.0)
    listed = httpx.get(f"{unit.url}/v1/voices", timeout=10).json()["data"]
    assert not [v for v in listed if v["name"].startswith("loadgen-cold-")]


def test_ttfa_is_the_first_audio_byte_at_the_client(unit: LocalUnit) -> None:
    async def go() -> tuple[SpeechTarget, object]:
        cfg = load(unit, voices=1)
        async with httpx.AsyncClient(timeout=60) as client:
            target = await speech_target(client, unit.url, await fetch_model(client, unit.url), cfg)
            await upload_warm_voices(client, unit.url, target, 1)
            spec = StreamSpec(index=0, voice=warm_voice(0), reused=True, text="Hello there.",
                              prompt=np.zeros((0, 5), np.int32), frames=FRAMES, seed=1)
            return target, await speech_once(client, unit.url, spec, target, start_frames=3)

    target, res = asyncio.run(go())
    assert res.error is None and res.status == 200
    assert res.ttfa_s == res.arrivals[0]  # the first chunk's arrival, not the 3rd frame's
    assert res.answered_s is not None and res.answered_s <= res.ttfa_s
    assert int(res.chunk_bytes.sum()) == 2 * FRAMES * target.samples_per_frame
    assert res.audio_s == pytest.approx(FRAMES * target.samples_per_frame / target.sample_rate)


def test_a_reused_voice_is_a_prefix_cache_hit(unit: LocalUnit) -> None:
    doc = run_load(load(unit, voices=1, voice_reuse=1.0, concurrency=[1], requests=3, seed=12), keep_streams=True)
    row, streams = doc["rows"][0], doc["streams"]
    assert row["errors"] == 0, row["error_kinds"]
    assert all(s["voice"] == warm_voice(0) and s["reused"] for s in streams)
    assert all(s["cached_rows"] > 0 for s in streams[1:]), [s["cached_rows"] for s in streams]
    assert row["warm_cache_hit_share"] >= 2 / 3 and row["cached_rows_share"] > 0


def test_without_the_voices_token_the_driver_stops_at_its_first_upload(unit: LocalUnit) -> None:
    with pytest.raises(RuntimeError, match="voice_upload:401:missing_token"):
        run_load(load(unit, voices=1, voices_token_file=""))
