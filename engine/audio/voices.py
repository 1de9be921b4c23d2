"""The voice store: reference clips encoded to codec codes, kept on a directory for reuse.

Owns the voice files (one safetensors file per voice: codes, transcript, speaker, codec,
digest), their validation and their life cycle. Several LB processes may share the
directory (a ReadWriteMany volume): a create is exclusive across them (link, else an
O_EXCL placeholder), a replace is temp + fsync + rename, so no reader sees half a voice,
and nothing is cached: every read is the directory's state now. Uploads are parsed as
data only (`wave`, safetensors). Must never serve a voice encoded by another codec.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import struct
import tempfile
import time
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from pdunit.engine.audio.errors import FieldError, UnknownVoice, VoiceExists
from pdunit.engine.audio.pcm import UNKNOWN, pcm16_to_float

log = logging.getLogger(__name__)

SUFFIX = ".voice"
_TEMP_PREFIX = ".tmp-"  # a voice name never starts with "."
# A temp file (or an empty placeholder, below) older than this was left by a crash: its
# writer, in any process sharing the directory, finished within milliseconds.
STALE_SECONDS = 600.0
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class Codec(Protocol):
    """What the store needs of a codec (MimiCodec is one)."""

    sample_rate: int
    frame_rate: float
    num_codebooks: int
    codebook_size: int

    def encode(self, samples: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class VoiceLimits:
    min_seconds: float = 1.0
    max_seconds: float = 30.0
    max_bytes: int = 2 << 20  # an upload: 30 s of 16-bit mono at 24 kHz is 1.4 MB
    max_transcript_chars: int = 1000


@dataclass(frozen=True)
class Voice:
    """A stored voice: `codes` [num_codebooks, frames]; `digest` changes with any of them
    (a prefix cache keys on it, so a replaced voice is never served from stale KV)."""

    name: str
    transcript: str
    speaker: int
    codes: np.ndarray
    digest: str


class VoiceStore:
    """Voices under `root` for one codec; a reopened store sees the same voices."""

    def __init__(self, root: Path, codec: Codec, limits: VoiceLimits | None = None) -> None:
        self.root, self.codec, self.limits = root, codec, limits or VoiceLimits()
        root.mkdir(parents=True, exist_ok=True)
        # Writes cut short by a crash. Only old ones: another LB sharing the directory may
        # be writing its own temp file (or hold a placeholder) right now.
        cutoff = time.time() - STALE_SECONDS
        for stale in [*root.glob(_TEMP_PREFIX + "*"), *root.glob("*" + SUFFIX)]:
            with contextlib.suppress(FileNotFoundError):
                st = stale.stat()
                if st.st_mtime < cutoff and (stale.name.startswith(_TEMP_PREFIX) or st.st_size == 0):
                    stale.unlink(missing_ok=True)

    def _codec_id(self) -> dict[str, str]:
        c = self.codec
        return {
            "sample_rate": str(c.sample_rate), "frame_rate": str(c.frame_rate),
            "num_codebooks": str(c.num_codebooks), "codebook_size": str(c.codebook_size),
        }

    def put(
        self, name: str, transcript: str, *, wav: bytes | None = None, pcm: bytes | None = None,
        codes: np.ndarray | None = None, speaker: int = 0, replace: bool = False,
    ) -> Voice:
        """Validate, encode (a clip) and store one voice. Raises FieldError naming the
        field: `name`, `transcript`, `speaker`, `audio` (the WAV or PCM clip) or `codes`."""
        path = self._path(name)
        if not replace and path.exists():
            raise VoiceExists(name)
        lim = self.limits
        if not isinstance(transcript, str) or not transcript.strip():
            raise FieldError("transcript", "is empty; give the words the clip says")
        if len(transcript) > lim.max_transcript_chars:
            raise FieldError(
                "transcript", f"has {len(transcript)} characters, over the limit of {lim.max_transcript_chars}"
            )
        if isinstance(speaker, bool) or not isinstance(speaker, int) or speaker < 0:
            raise FieldError("speaker", f"must be an integer >= 0 (got {speaker!r})")
        given = [x is not None for x in (wav, pcm, codes)]
        if sum(given) != 1:
            raise FieldError("audio", "give exactly one of a WAV clip, a PCM clip or codec codes")
        if codes is not None:
            frames = self._check_codes(codes)
        else:
            samples = self._wav_samples(wav) if wav is not None else self._pcm_samples(pcm or b"")
            frames = self.codec.encode(samples)
        voice = Voice(name, transcript, speaker, frames, _digest(frames, transcript, speaker))
        self._write(path, voice, exclusive=not replace)
        return voice

    def get(self, name: str) -> Voice:
        """The voice as the directory holds it now (another process may have just written,
        replaced or deleted it). Raises UnknownVoice when there is none."""
        return self._read(self._path(name, field="voice"), name)

    def list(self) -> list[Voice]:
        """Every readable voice, by name (an unreadable file is logged and skipped, one
        deleted or still being created meanwhile is left out)."""
        voices = []
        for path in sorted(self.root.glob("*" + SUFFIX)):
            try:
                voices.append(self._read(path, path.name[: -len(SUFFIX)]))
            except UnknownVoice:
                continue
            except FieldError as exc:
                log.warning("voice store %s: %s", self.root, exc)
        return voices

    def delete(self, name: str) -> None:
        try:
            self._path(name, field="voice").unlink()
        except FileNotFoundError:
            raise UnknownVoice(name) from None

    def _path(self, name: str, field: str = "name") -> Path:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise FieldError(
                field, f"{name!r} is not a voice name: 1-64 of A-Z a-z 0-9 _ . -, starting with a letter or digit"
            )
        return self.root / (name + SUFFIX)

    def _seconds(self, seconds: float, field: str) -> None:
        lim = self.limits
        if not lim.min_seconds <= seconds <= lim.max_seconds:
            raise FieldError(
                field, f"is {seconds:.2f} s long; a voice clip is {lim.min_seconds:g} to {lim.max_seconds:g} s"
            )

    def _check_size(self, data: bytes) -> None:
        if len(data) > self.limits.max_bytes:
            raise FieldError("audio", f"is {len(data)} bytes, over the limit of {self.limits.max_bytes}")

    def _wav_samples(self, data: bytes) -> np.ndarray:
        self._check_size(data)
        try:
            with wave.open(io.BytesIO(data)) as w:
                channels, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
                pcm = w.readframes(n)
        except (wave.Error, EOFError, ValueError, RuntimeError, struct.error) as exc:  # wave's own on bad chunks
            raise FieldError("audio", f"is not a WAV file of PCM samples ({exc})") from None
        if channels != 1:
            raise FieldError("audio", f"has {channels} channels; upload mono")
        if width != 2:
            raise FieldError("audio", f"has {8 * width}-bit samples; upload 16-bit PCM")
        if rate != self.codec.sample_rate:
            raise FieldError(
                "audio", f"is sampled at {rate} Hz; the codec takes {self.codec.sample_rate} Hz: resample it"
            )
        if len(pcm) < 2 * n and n != UNKNOWN // 2:  # a streamed WAV's header says "unknown"
            raise FieldError("audio", f"is truncated: its header says {n} samples, it holds {len(pcm) // 2}")
        return self._pcm_samples(pcm)

    def _pcm_samples(self, data: bytes) -> np.ndarray:
        self._check_size(data)
        if len(data) % 2:
            raise FieldError("audio", f"16-bit PCM has an even byte count (got {len(data)})")
        self._seconds(len(data) / 2 / self.codec.sample_rate, "audio")
        return pcm16_to_float(data)

    def _check_codes(self, codes: np.ndarray) -> np.ndarray:
        c = np.asarray(codes)
        k, size = self.codec.num_codebooks, self.codec.codebook_size
        if c.ndim != 2 or c.shape[0] != k or c.shape[1] < 1:
            raise FieldError("codes", f"have shape {tuple(c.shape)}, expected ({k}, frames >= 1)")
        if not np.issubdtype(c.dtype, np.integer) or c.min() < 0 or c.max() >= size:
            raise FieldError("codes", f"must be integers in [0, {size}) (the codec's codebooks)")
        self._seconds(c.shape[1] / self.codec.frame_rate, "codes")
        return c.astype(np.int64)

    def _write(self, path: Path, voice: Voice, exclusive: bool) -> None:
        from safetensors.numpy import save

        meta = {**self._codec_id(), "transcript": voice.transcript, "speaker": str(voice.speaker),
                "digest": voice.digest}
        blob = save({"codes": voice.codes.astype(np.int32)}, metadata=meta)
        fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self.root)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(blob)
                out.flush()
                os.fsync(out.fileno())
            if exclusive:
                _create(tmp, path, voice.name)
            else:
                os.replace(tmp, path)  # atomic: a reader opens the old file or the new one
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        with contextlib.suppress(OSError):  # the directory entry itself, where supported
            dir_fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _read(self, path: Path, name: str) -> Voice:
        from safetensors.numpy import load

        try:
            with open(path, "rb") as f:  # one open: one inode, whatever a rename does meanwhile
                data = f.read()
        except FileNotFoundError:
            raise UnknownVoice(name) from None
        if not data:  # another process's create, not complete yet (_create's placeholder)
            raise UnknownVoice(name)
        try:
            (size,) = struct.unpack("<Q", data[:8])
            meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
            codes = load(data)["codes"].astype(np.int64)
            voice = Voice(name, meta["transcript"], int(meta["speaker"]), codes, meta["digest"])
        except Exception as exc:  # any parse failure of a stored file: data, never code
            raise FieldError(
                "voice", f"stored voice {name!r} is unreadable ({type(exc).__name__}); upload it again"
            ) from None
        codec = {k: meta.get(k) for k in self._codec_id()}
        if codec != self._codec_id():
            raise FieldError(
                "voice", f"voice {name!r} was encoded for another codec ({json.dumps(codec)}); upload it again"
            )
        return voice


def _create(tmp: str, path: Path, name: str) -> None:
    """Give the written file `tmp` the name `path` only if no process holds that name:
    a hard link fails when the name exists (atomic on local disks, NFS, CephFS). A volume
    without hard links gets an O_EXCL placeholder (empty: readers take it for absent),
    which the rename then replaces. Raises VoiceExists when another create won."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise VoiceExists(name) from None
    except OSError:
        pass  # EPERM / ENOTSUP / EOPNOTSUPP: no hard links on this volume
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        raise VoiceExists(name) from None
    os.replace(tmp, path)


def _digest(codes: np.ndarray, transcript: str, speaker: int) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(codes, dtype="<i8").tobytes())
    h.update(json.dumps([transcript, speaker, list(codes.shape)]).encode())
    return h.hexdigest()[:32]
