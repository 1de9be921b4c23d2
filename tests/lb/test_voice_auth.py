"""An attacker on the stream port against the voice store: without the bearer token of
--voices-token-file nobody creates, replaces or deletes a voice (so nobody changes what
another client's /v1/audio/speech sounds like); reading the store stays open."""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from pdunit.engine.lb.config import LBConfig
from pdunit.engine.observability import log_config
from pdunit.engine.security import SECURITY_EVENTS, write_secret_file
from tests.lb.conftest import RunningLB
from tests.lb.fakes import FakeUnit
from tests.lb.test_speech import CODEC, MODEL, speech_unit, wav_bytes

EVENT = "voices_unauthorized"


def events() -> float:
    return SECURITY_EVENTS.labels(what=EVENT)._value.get()


def store_bytes(voices_dir: str) -> dict[str, bytes]:
    """Every file of the store, byte for byte."""
    return {p.name: p.read_bytes() for p in sorted(Path(voices_dir).iterdir())}


@pytest.fixture
def token_file(short_dir: str) -> tuple[str, str]:
    path = os.path.join(short_dir, "voices-token")
    return path, write_secret_file(path).decode()


@pytest.fixture
def guarded(start_lb: Callable[..., RunningLB], fake_unit: FakeUnit, short_dir: str,
            token_file: tuple[str, str]) -> tuple[RunningLB, str]:
    """An LB with --voices-token-file whose store holds `anna`, put there by its owner."""
    speech_unit(fake_unit)
    voices = os.path.join(short_dir, "voices")
    lb = start_lb(model=MODEL, codec=CODEC, voices=voices, voices_token_file=token_file[0])
    lb.lb.speech.store.put("anna", "the owner's words", wav=wav_bytes(1.5), speaker=1)
    return lb, voices


def new_voice(name: str, **extra: Any) -> dict[str, Any]:
    clip = np.random.default_rng(7).integers(-3000, 3000, int(1.5 * 800)).astype("<i2").tobytes()
    return {"name": name, "transcript": "the attacker's words", "audio": base64.b64encode(clip).decode(),
            "audio_format": "pcm", **extra}


ATTACKS: dict[str, Callable[[httpx.Client, dict[str, str]], httpx.Response]] = {
    "create": lambda c, h: c.post("/v1/voices", json=new_voice("mallory"), headers=h),
    "replace": lambda c, h: c.post("/v1/voices", json=new_voice("anna", replace=True), headers=h),
    "replace_multipart": lambda c, h: c.post(
        "/v1/voices", data={"name": "anna", "transcript": "x", "replace": "true"},
        files={"audio": ("a.wav", wav_bytes(1.5), "audio/wav")}, headers=h),
    "delete": lambda c, h: c.delete("/v1/voices/anna", headers=h),
    "delete_missing": lambda c, h: c.delete("/v1/voices/nobody", headers=h),  # no 404 oracle either
}
CREDENTIALS = {
    "none": ({}, 401, "missing_token"),
    "empty_bearer": ({"Authorization": "Bearer"}, 401, "missing_token"),
    "wrong_scheme": ({"Authorization": "Basic dXNlcjpwYXNz"}, 401, "missing_token"),
    "wrong_token": ({"Authorization": "Bearer " + "0" * 64}, 403, "invalid_token"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("credential", sorted(CREDENTIALS))
def test_a_client_without_the_voices_token_changes_no_voice(
    guarded: tuple[RunningLB, str], token_file: tuple[str, str], attack: str, credential: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    lb, voices = guarded
    headers, status, code = CREDENTIALS[credential]
    before, count = store_bytes(voices), events()
    caplog.set_level(logging.WARNING, logger="pdunit.security")
    with lb.client() as c:
        resp = ATTACKS[attack](c, headers)
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert (error["param"], error["code"], error["type"]) == ("Authorization", code, "invalid_request_error")
        assert "--voices-token-file" in error["message"]
        if status == 401:
            assert resp.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/voices/anna").json()["transcript"] == "the owner's words"
    assert store_bytes(voices) == before  # byte-identical, nothing created, nothing left half-written
    assert events() == count + 1
    logged = [r for r in caplog.records if getattr(r, "security_event", None) == EVENT]
    assert len(logged) == 1 and logged[0].path.startswith("/v1/voices")  # type: ignore[attr-defined]
    assert token_file[1] not in caplog.text


def test_the_owner_with_the_token_creates_replaces_and_deletes(guarded: tuple[RunningLB, str],
                                                             token_file: tuple[str, str]) -> None:
    lb, voices = guarded
    auth = {"Authorization": f"Bearer {token_file[1]}"}
    with lb.client() as c:
        assert c.post("/v1/voices", json=new_voice("bert"), headers=auth).status_code == 201
        old = c.get("/v1/voices/anna").json()["digest"]
        replaced = c.post("/v1/voices", json=new_voice("anna", replace=True), headers=auth)
        assert replaced.status_code == 201 and replaced.json()["digest"] != old
        assert c.delete("/v1/voices/bert", headers=auth).json()["deleted"] is True
    assert sorted(store_bytes(voices)) == ["anna.voice"]


def test_reading_the_store_needs_no_token(guarded: tuple[RunningLB, str]) -> None:
    """A speech client names a voice; listing and reading them is what it needs to choose."""
    lb, _ = guarded
    with lb.client() as c:
        assert [v["id"] for v in c.get("/v1/voices").json()["data"]] == ["anna"]
        assert c.get("/v1/voices/anna").status_code == 200


def test_without_a_token_file_the_store_takes_no_write(start_lb: Callable[..., RunningLB], fake_unit: FakeUnit,
                                                      short_dir: str) -> None:
    speech_unit(fake_unit)
    voices = os.path.join(short_dir, "voices")
    lb = start_lb(model=MODEL, codec=CODEC, voices=voices)
    lb.lb.speech.store.put("anna", "the owner's words", wav=wav_bytes(1.5))
    before, count = store_bytes(voices), events()
    with lb.client() as c:
        for attack in ATTACKS.values():
            resp = attack(c, {"Authorization": "Bearer " + "0" * 64})
            assert resp.status_code == 403, resp.text
            error = resp.json()["error"]
            assert error["param"] == "Authorization" and error["code"] == "voice_writes_disabled"
            assert "--voices-token-file" in error["message"]
        assert c.get("/v1/voices/anna").status_code == 200
    assert store_bytes(voices) == before
    assert events() == count + len(ATTACKS)


def test_the_logged_config_names_the_token_file_never_the_token(token_file: tuple[str, str],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    path, token = token_file
    caplog.set_level(logging.INFO, logger="pdunit.test")
    config = LBConfig(model=MODEL, codec=CODEC, voices=os.path.dirname(path), voices_token_file=path)
    log_config(logging.getLogger("pdunit.test"), config)
    (record,) = caplog.records
    assert record.config["voices_token_file"] == path  # type: ignore[attr-defined]
    assert token not in repr(record.__dict__)


def test_the_token_file_goes_with_a_voice_store_and_must_be_a_secret(short_dir: str, capsys) -> None:
    from pydantic import ValidationError

    from pdunit.engine.lb.main import main

    with pytest.raises(ValidationError, match="--voices-token-file needs --voices"):
        LBConfig(voices_token_file="/run/secrets/voices")
    open_file = os.path.join(short_dir, "open-token")
    with open(open_file, "w") as f:
        f.write("x" * 64)
    os.chmod(open_file, 0o644)
    argv = ["--host", "127.0.0.1", "--port", "0", "--admin-port", "0", "--model", MODEL, "--codec", CODEC,
            "--voices", os.path.join(short_dir, "voices"), "--voices-token-file", open_file]
    assert main(argv) == 2
    assert "--voices-token-file" in capsys.readouterr().err
