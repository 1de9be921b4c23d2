"""Text (and a voice) -> CSM prompt rows, as transformers' CsmProcessor lays them out.

Owns CSM's prompt layout: per turn `<bos>[speaker]text<eos>`, a turn with audio followed
by one `<|AUDIO|>` row per codec frame and an `<|audio_eos|>` row; the voice's turns
first (a shared prefix), the text to speak last. Rows are `num_codebooks + 1` ids
(docs/models.md): a text row is pads + the token, an audio row its codes + audio_token_id,
the audio-eos row all `codebook_eos` + audio_token_id (transformers embeds it so).
Refuses text holding a special token (it would forge rows) and inputs over the limits,
with a FieldError naming `input`, `voice` or `speaker`. Imports `tokenizers` when used.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pdunit.engine.audio.errors import FieldError

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass(frozen=True)
class Turn:
    """One speaker turn of the context: its transcript and the codec codes of its audio
    ([num_codebooks, frames]; None only for the text to speak)."""

    speaker: int
    text: str
    codes: np.ndarray | None = None


@dataclass(frozen=True)
class CsmLayout:
    """The row ids a CSM checkpoint's config.json fixes (read by the `csm` family)."""

    num_codebooks: int
    audio_vocab_size: int
    audio_token_id: int
    audio_eos_token_id: int
    codebook_pad_token_id: int
    codebook_eos_token_id: int


@dataclass(frozen=True)
class PromptLimits:
    max_input_chars: int = 4096  # OpenAI's limit for `input`
    max_input_tokens: int = 1024
    max_voice_frames: int = 375  # 30 s of Mimi frames (12.5 Hz)
    max_rows: int = 2048  # the whole prompt, voice included

    def __post_init__(self) -> None:
        for name in ("max_input_chars", "max_input_tokens", "max_voice_frames", "max_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"PromptLimits.{name} must be >= 1 (got {getattr(self, name)})")


class CsmPrompter:
    """Builds one request's rows with the checkpoint's own tokenizer."""

    def __init__(
        self, tokenizer: Tokenizer, layout: CsmLayout, bos_token: str, eos_token: str,
        limits: PromptLimits | None = None,
    ) -> None:
        self.tokenizer, self.layout, self.limits = tokenizer, layout, limits or PromptLimits()
        self.bos, self.eos = bos_token, eos_token
        self.audio = _token(tokenizer, layout.audio_token_id, "audio_token_id")
        self.audio_eos = _token(tokenizer, layout.audio_eos_token_id, "audio_eos_token_id")
        for name, tok in (("bos_token", bos_token), ("eos_token", eos_token)):
            if tokenizer.token_to_id(tok) is None:
                raise ValueError(f"tokenizer_config.json {name} {tok!r} is not in tokenizer.json")
        self._special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}

    @classmethod
    def from_checkpoint(cls, directory: Path, limits: PromptLimits | None = None) -> CsmPrompter:
        """`tokenizer.json`, `tokenizer_config.json` and `config.json` (model_type csm) of a
        local checkpoint directory, as transformers saves a CSM model and its processor."""
        from tokenizers import Tokenizer

        from pdunit.engine.model.family_csm import CsmExtras, CsmFamily

        raw = _json(directory / "config.json")
        parsed = CsmFamily().parse_config(raw, directory.name)
        extras: CsmExtras = parsed.extras
        if extras.audio_eos_token_id is None:
            raise ValueError("config.json audio_eos_token_id is missing: a voice's audio ends with it")
        layout = CsmLayout(
            num_codebooks=extras.n_audio, audio_vocab_size=parsed.model.vocab_sizes[0],
            audio_token_id=extras.audio_token_id, audio_eos_token_id=extras.audio_eos_token_id,
            codebook_pad_token_id=extras.codebook_pad_token_id,
            codebook_eos_token_id=parsed.model.eos_id,
        )
        tok_config = _json(directory / "tokenizer_config.json")
        names = [_content(tok_config.get(k), k) for k in ("bos_token", "eos_token")]
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path} is missing (a CSM checkpoint has it beside the weights)")
        tokenizer = Tokenizer.from_file(str(path))
        return cls(tokenizer, layout, names[0], names[1], limits)

    def render(self, turns: Sequence[Turn]) -> str:
        """The prompt text CSM's chat template renders, `<|AUDIO|>` expanded per frame."""
        parts = []
        for t in turns:
            parts.append(f"{self.bos}[{t.speaker}]{t.text}{self.eos}")
            if t.codes is not None:
                parts.append(self.audio * t.codes.shape[1] + self.audio_eos)
        return "".join(parts)

    def rows(self, text: str, speaker: int = 0, voice: Sequence[Turn] = ()) -> np.ndarray:
        """The prompt rows [n, num_codebooks + 1] (int64) of `voice`'s turns then `text`."""
        lim, lay = self.limits, self.layout
        if not isinstance(text, str) or not text.strip():
            raise FieldError("input", "is empty; give the text to speak")
        if len(text) > lim.max_input_chars:
            raise FieldError("input", f"has {len(text)} characters, over the limit of {lim.max_input_chars}")
        self._check_plain(text, "input")
        n_tokens = len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if n_tokens > lim.max_input_tokens:
            raise FieldError("input", f"is {n_tokens} tokens, over the limit of {lim.max_input_tokens}")
        if isinstance(speaker, bool) or not isinstance(speaker, int) or speaker < 0:
            raise FieldError("speaker", f"must be a speaker id, an integer >= 0 (got {speaker!r})")
        frames = 0
        for i, turn in enumerate(voice):
            self._check_plain(turn.text, "voice", f"turn {i} transcript ")
            frames += self._check_codes(turn, i)
        if frames > lim.max_voice_frames:
            raise FieldError(
                "voice", f"has {frames} frames of audio, over the limit of {lim.max_voice_frames}"
            )
        turns = [*voice, Turn(speaker, text)]
        ids = np.asarray(self.tokenizer.encode(self.render(turns), add_special_tokens=False).ids, np.int64)
        if len(ids) > lim.max_rows:
            raise FieldError(
                "input", f"with its voice makes {len(ids)} prompt rows, over the limit of "
                f"{lim.max_rows}: shorten the input or use a shorter voice"
            )
        k = lay.num_codebooks
        rows = np.full((len(ids), k + 1), lay.codebook_pad_token_id, dtype=np.int64)
        rows[:, k] = ids
        audio = np.flatnonzero(ids == lay.audio_token_id)
        if len(audio):
            rows[audio, :k] = np.concatenate([t.codes for t in voice if t.codes is not None], axis=1).T
        eos = ids == lay.audio_eos_token_id
        rows[eos, :k] = lay.codebook_eos_token_id
        rows[eos, k] = lay.audio_token_id
        return rows

    def _check_plain(self, text: str, field: str, where: str = "") -> None:
        if not isinstance(text, str):
            raise FieldError(field, f"{where}must be a string")
        for token in self._special:
            if token in text:
                raise FieldError(field, f"{where}holds the special token {token!r}; remove it")

    def _check_codes(self, turn: Turn, i: int) -> int:
        lay = self.layout
        c = turn.codes
        if isinstance(turn.speaker, bool) or not isinstance(turn.speaker, int) or turn.speaker < 0:
            raise FieldError("voice", f"turn {i} speaker must be an integer >= 0 (got {turn.speaker!r})")
        if c is None:
            raise FieldError("voice", f"turn {i} has no audio codes: a voice turn is a clip + its transcript")
        if c.ndim != 2 or c.shape[0] != lay.num_codebooks or c.shape[1] < 1:
            raise FieldError(
                "voice", f"turn {i} codes have shape {tuple(c.shape)}, expected "
                f"({lay.num_codebooks}, frames >= 1)"
            )
        if not np.issubdtype(c.dtype, np.integer) or c.min() < 0 or c.max() >= lay.audio_vocab_size:
            raise FieldError("voice", f"turn {i} codes must be integers in [0, {lay.audio_vocab_size})")
        return int(c.shape[1])


def _token(tokenizer: Tokenizer, token_id: int, name: str) -> str:
    token = tokenizer.id_to_token(token_id)
    if token is None or token_id not in tokenizer.get_added_tokens_decoder():
        raise ValueError(
            f"config.json {name} {token_id} is not a special token of tokenizer.json: "
            "the tokenizer and the model are not from one checkpoint"
        )
    return token


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is missing (a CSM checkpoint has it beside the weights)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _content(value: object, name: str) -> str:
    """A tokenizer_config.json special token: a string or {"content": string}."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"tokenizer_config.json {name} must name a token (got {value!r})")
    return value
