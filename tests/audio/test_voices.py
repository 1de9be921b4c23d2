"""The voice store: validated uploads, atomic writes, list/get/delete, a reopen."""

from __future__ import annotations

import io
import os
import pickle
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from pdunit.engine.audio.errors import FieldError, UnknownVoice
from pdunit.engine.audio.mimi_stream import MimiCodec
from pdunit.engine.audio.pcm import float_to_pcm16, pcm16_to_float, wav_header
from pdunit.engine.audio.voices import STALE_SECONDS, VoiceLimits, VoiceStore
from tests.audio.tiny import tiny_mimi

RATE = 800  # the tiny codec's sample rate
LIMITS = VoiceLimits(min_seconds=1.0, max_seconds=4.0, max_bytes=20_000, max_transcript_chars=50)


@pytest.fixture(scope="module")
def codec() -> MimiCodec:
    return tiny_mimi()


@pytest.fixture
def store(tmp_path: Path, codec: MimiCodec) -> VoiceStore:
    return VoiceStore(tmp_path / "voices", codec, LIMITS)


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.3 * rng.standard_normal(int(RATE * seconds))).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = RATE, channels: int = 1, width: int = 2) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        pcm = float_to_pcm16(np.repeat(samples, channels))
        w.writeframes(pcm if width == 2 else pcm[1::2])
    return out.getvalue()


def files(store: VoiceStore) -> list[str]:
    return sorted(os.listdir(store.root))


def test_a_wav_upload_is_encoded_by_the_codec_listed_got_and_deleted(store: VoiceStore, codec: MimiCodec) -> None:
    audio = clip(2.0)
    voice = store.put("alice", "Hello there.", wav=wav_bytes(audio), speaker=1)
    want = codec.encode(pcm16_to_float(float_to_pcm16(audio)))
    assert np.array_equal(voice.codes, want) and voice.codes.shape == (4, 50)
    got = store.get("alice")
    assert (got.transcript, got.speaker, got.digest) == ("Hello there.", 1, voice.digest)
    assert np.array_equal(got.codes, want)
    assert [v.name for v in store.list()] == ["alice"]
    store.delete("alice")
    assert store.list() == [] and files(store) == []
    with pytest.raises(UnknownVoice, match="no voice named 'alice'") as err:
        store.get("alice")
    assert err.value.field == "voice"
    with pytest.raises(UnknownVoice):
        store.delete("alice")


def test_voices_survive_a_reopen_of_the_directory(store: VoiceStore, codec: MimiCodec) -> None:
    codes = np.arange(4 * 30).reshape(4, 30) % 32
    store.put("bob", "One two three.", codes=codes)
    store.put("carol", "Four.", pcm=float_to_pcm16(clip(1.5, seed=2)))
    reopened = VoiceStore(store.root, codec, LIMITS)
    assert [v.name for v in reopened.list()] == ["bob", "carol"]
    assert np.array_equal(reopened.get("bob").codes, codes)


def test_the_digest_changes_with_the_voice_so_a_cache_never_serves_a_replaced_one(store: VoiceStore) -> None:
    codes = np.zeros((4, 30), dtype=np.int64)
    first = store.put("v", "Same words.", codes=codes)
    with pytest.raises(FieldError, match="a voice named 'v' exists") as err:
        store.put("v", "Same words.", codes=codes)
    assert err.value.field == "name"
    second = store.put("v", "Same words.", codes=codes + 1, replace=True)
    assert first.digest != second.digest == store.get("v").digest


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        (dict(wav=b"RIFF\x00\x00not a wav at all"), "audio", "is not a WAV file"),
        (dict(wav=wav_bytes(clip(2.0), channels=2)), "audio", "has 2 channels; upload mono"),
        (dict(wav=wav_bytes(clip(2.0), width=1)), "audio", "has 8-bit samples; upload 16-bit PCM"),
        (dict(wav=wav_bytes(clip(2.0), rate=RATE * 2)), "audio", "sampled at 1600 Hz; the codec takes 800 Hz"),
        (dict(wav=wav_bytes(clip(0.5))), "audio", "is 0.50 s long; a voice clip is 1 to 4 s"),
        (dict(wav=wav_bytes(clip(5.0))), "audio", "is 5.00 s long"),
        (dict(wav=wav_bytes(clip(20.0))), "audio", "bytes, over the limit of 20000"),
        (dict(wav=wav_header(RATE, 2000) + b"\x00" * 100), "audio", "truncated: its header says 2000 samples"),
        (dict(pcm=b"\x00" * 2001), "audio", "even byte count"),
        (dict(), "audio", "exactly one of"),
        (dict(pcm=b"\x00" * 2000, codes=np.zeros((4, 30), np.int64)), "audio", "exactly one of"),
        (dict(codes=np.zeros((3, 30), np.int64)), "codes", r"shape \(3, 30\), expected \(4, frames >= 1\)"),
        (dict(codes=np.full((4, 30), 32)), "codes", r"integers in \[0, 32\)"),
        (dict(codes=np.zeros((4, 30), np.float32)), "codes", "integers"),
        (dict(codes=np.zeros((4, 5), np.int64)), "codes", "is 0.20 s long"),
        (dict(codes=np.zeros((4, 30), np.int64), transcript=" "), "transcript", "is empty"),
        (dict(codes=np.zeros((4, 30), np.int64), transcript="x" * 51), "transcript", "51 characters"),
        (dict(codes=np.zeros((4, 30), np.int64), speaker=-1), "speaker", ">= 0"),
        (dict(codes=np.zeros((4, 30), np.int64), name="../etc"), "name", "is not a voice name"),
        (dict(codes=np.zeros((4, 30), np.int64), name=".hidden"), "name", "is not a voice name"),
        (dict(codes=np.zeros((4, 30), np.int64), name="a/b"), "name", "is not a voice name"),
        (dict(codes=np.zeros((4, 30), np.int64), name=""), "name", "is not a voice name"),
    ],
)
def test_each_bad_upload_is_refused_naming_its_field_and_writes_nothing(
    store: VoiceStore, kwargs: dict, field: str, message: str
) -> None:
    args = {"name": "v", "transcript": "Words.", **kwargs}
    with pytest.raises(FieldError, match=message) as err:
        store.put(args.pop("name"), args.pop("transcript"), **args)
    assert err.value.field == field
    assert files(store) == []


def test_a_write_that_fails_midway_leaves_nothing_behind(
    store: VoiceStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put("kept", "Words.", codes=np.zeros((4, 30), np.int64))

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        store.put("new", "Words.", codes=np.zeros((4, 30), np.int64))
    assert files(store) == ["kept.voice"]


def test_a_temp_file_left_by_a_crash_is_removed_on_open(store: VoiceStore, codec: MimiCodec) -> None:
    old = time.time() - STALE_SECONDS - 1
    for name, data in ((".tmp-abc123", b"half a voice"), ("placeholder.voice", b"")):
        (store.root / name).write_bytes(data)
        os.utime(store.root / name, (old, old))
    VoiceStore(store.root, codec, LIMITS)
    assert files(store) == []


def test_an_lb_starting_on_a_shared_directory_leaves_another_lbs_write_in_progress(
    store: VoiceStore, codec: MimiCodec
) -> None:
    """Another LB's temp file and create placeholder are young: a starting LB keeps them."""
    (store.root / ".tmp-other").write_bytes(b"being written")
    (store.root / "creating.voice").write_bytes(b"")
    VoiceStore(store.root, codec, LIMITS)
    assert files(store) == [".tmp-other", "creating.voice"]
    with pytest.raises(UnknownVoice):
        store.get("creating")  # a placeholder is no voice yet
    assert store.list() == []


def test_a_stored_file_is_parsed_as_data_never_unpickled(store: VoiceStore, tmp_path: Path) -> None:
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self) -> tuple:
            return (Path.touch, (marker,))

    (store.root / "evil.voice").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(FieldError, match="stored voice 'evil' is unreadable"):
        store.get("evil")
    assert store.list() == [] and not marker.exists()


def test_a_voice_encoded_by_another_codec_is_refused(store: VoiceStore) -> None:
    store.put("v", "Words.", codes=np.zeros((4, 30), np.int64))
    other = VoiceStore(store.root, tiny_mimi(sampling_rate=1600), LIMITS)
    with pytest.raises(FieldError, match="voice 'v' was encoded for another codec") as err:
        other.get("v")
    assert err.value.field == "voice"
