"""A small client of the unit's HTTP API for end-to-end tests (docs/api.md)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdunit.bench.fault_unit import wait_until
from pdunit.engine.lb.load import LoadDocument, read_load_document
from pdunit.engine.local import LocalConfig, LocalUnit, demo_clip


@contextmanager
def units_side_by_side(*configs: LocalConfig) -> Iterator[list[LocalUnit]]:
    """Units that boot at the same time rather than one after the other (a unit's start is
    mostly its processes' imports and loads): spawned from the caller's thread (a child
    dies with the thread that spawned it: PR_SET_PDEATHSIG), each supervised once all are
    ready, all stopped at once."""
    units = [LocalUnit(cfg) for cfg in configs]
    try:
        for unit in units:
            unit.start()
        for unit in units:
            unit.wait_ready()
            unit.supervise()
        yield units
    finally:
        with ThreadPoolExecutor(len(units)) as stopping:
            list(stopping.map(LocalUnit.stop, units))


def random_prompt(rows: int, seed: int, vocab: int = 1024, cols: int = 11) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab - 2, size=(rows, cols)).tolist()


def stream(url: str, prompt: list[list[int]], timeout: float = 120.0, **params) -> tuple[list[list[int]], dict]:
    """Returns (frames, last record). The last record is the `done` or `error` line."""
    body = {"prompt": prompt, **params}
    frames: list[list[int]] = []
    last: dict = {}
    with httpx.stream("POST", f"{url}/v1/tts/stream", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return [], {"http_status": r.status_code, **r.json()}
        for line in r.iter_lines():
            if not line:
                continue
            rec = json.loads(line)
            if "frame" in rec:
                frames.append(rec["frame"])
            else:
                last = rec
    return frames, last


def load(url: str) -> LoadDocument:
    """The unit's /v1/load, parsed strictly: a field missing or of a wrong type fails the test."""
    return read_load_document(httpx.get(f"{url}/v1/load", timeout=5.0).content)


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1, what: str = "condition"):
    return wait_until(predicate, timeout, what, interval)


def wait_empty(url: str, timeout: float = 20.0, what: str = "an empty unit") -> LoadDocument:
    """The unit's /v1/load once it reports empty: a stream's last frame reaches the client
    before D, P and the proxy have released it, so one read right after can still see it."""
    return wait_for(lambda: (lambda d: d if d.empty else None)(load(url)), timeout=timeout, what=what)


def upload_demo_voice(url: str, token_file: str, name: str = "demo", seconds: float = 1.0) -> dict[str, Any]:
    """Stores a demo voice (a synthetic clip at the codec's rate) in a speaking unit's store,
    with the bearer token of its LB's --voices-token-file; returns /v1/model's `audio`
    (sample_rate, samples_per_frame, ...)."""
    audio: dict[str, Any] = httpx.get(f"{url}/v1/model", timeout=10).json()["audio"]
    clip = base64.b64encode(demo_clip(audio["sample_rate"], seconds=seconds)).decode()
    token = Path(token_file).read_text().strip()
    resp = httpx.post(f"{url}/v1/voices", timeout=60, headers={"Authorization": f"Bearer {token}"}, json={
        "name": name, "transcript": "a demo voice", "audio": clip, "audio_format": "pcm"})
    assert resp.status_code == 201, resp.text
    return audio
