"""The synthetic TTS workload of BENCHMARKS.md section 1: prompts, voices, lengths, arrivals.

Frames (`/v1/tts/stream`): a voice's reference rows (fixed per voice: P's prefix cache)
then text rows, `prompt_rows` in all, ids uniform per column (GET /v1/model), or under
the model's `row_rule` only rows the rule allows (the LB refuses any other). Speech
(`/v1/audio/speech`): a sentence (SPEECH_TEXTS, or made from its words) and a stored
voice's name; `voice_clip` / `voice_codes` make a voice's upload, fixed per name. Either
way a `voice_reuse` share uses one of `voices` warm voices, the rest a voice never seen
(a cold prefill); `frames` is sent as max_frames = min_frames. Arrivals: Poisson at
`rate`, a `burst_share` in clumps of `burst_size`. Seeded; never does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from pdunit.engine.model.request_rules import RowRule
from pdunit.engine.packing import pack

TRANSCRIPT_SHARE = 0.2  # under a row rule: a voice's reference is its transcript, then its clip


@dataclass(frozen=True)
class WorkloadConfig:
    n_codebooks: int
    vocab_sizes: tuple[int, ...]
    prompt_rows: tuple[int, int] = (1000, 2000)
    frames: tuple[int, int] = (105, 630)
    voices: int = 8
    voice_reuse: float = 0.5
    reference_share: float = 0.75  # reference rows = this share of prompt_rows' low end
    seed: int = 0
    speech: bool = False  # text + a voice's name (/v1/audio/speech) instead of rows
    row_rule: RowRule | None = None  # the model's (GET /v1/model): rows it allows; None: any ids

    def __post_init__(self) -> None:
        lo, hi = self.prompt_rows
        if not 1 <= lo <= hi:
            raise ValueError(f"prompt_rows {self.prompt_rows} must satisfy 1 <= low <= high")
        if not 1 <= self.frames[0] <= self.frames[1]:
            raise ValueError(f"frames {self.frames} must satisfy 1 <= low <= high")
        if not 0.0 <= self.voice_reuse <= 1.0:
            raise ValueError(f"voice_reuse {self.voice_reuse} must lie in [0, 1]")
        if self.voices < 1 and self.voice_reuse > 0:
            raise ValueError("voice_reuse > 0 needs at least one voice (--voices)")
        if len(self.vocab_sizes) != self.n_codebooks:
            raise ValueError(
                f"{len(self.vocab_sizes)} vocab sizes for {self.n_codebooks} codebooks"
            )
        rule = self.row_rule
        if rule is not None:
            if rule.width != self.n_codebooks:
                raise ValueError(f"the row rule reads rows of {rule.width} ids, the model has "
                                 f"{self.n_codebooks} codebooks")
            tokens = self.vocab_sizes[rule.marker_column]
            if len(_tokens_excluded(rule, tokens)) >= tokens:
                raise ValueError(f"the row rule leaves column {rule.marker_column} no text token "
                                 f"below its vocab size {tokens}")

    @property
    def reference_rows(self) -> int:
        return max(1, min(self.prompt_rows[0], round(self.reference_share * self.prompt_rows[0])))


@dataclass(frozen=True)
class StreamSpec:
    index: int
    voice: str
    reused: bool  # a warm voice (its reference may be in P's prefix cache)
    prompt: np.ndarray  # int32 [rows, n_codebooks]
    frames: int
    seed: int
    text: str = ""  # speech: the input to speak (`prompt` is then empty)

    @property
    def rows(self) -> int:
        return int(self.prompt.shape[0])

    def body(self, body_format: str) -> tuple[bytes, dict[str, str]]:
        """The request body and headers, `json` or `binary` (docs/api.md)."""
        headers = {"X-Session-Id": self.voice}
        if body_format == "binary":
            headers.update(
                {
                    "Content-Type": "application/octet-stream",
                    "X-Pdunit-Dtype": "int32",
                    "X-Pdunit-Row-Width": str(self.prompt.shape[1]),
                    "X-Pdunit-Max-Frames": str(self.frames),
                    "X-Pdunit-Min-Frames": str(self.frames),
                    "X-Pdunit-Seed": str(self.seed),
                }
            )
            return pack(self.prompt, "i4"), headers
        if body_format == "json":
            headers["Content-Type"] = "application/json"
            doc = {
                "prompt": self.prompt.tolist(),
                "max_frames": self.frames,
                "min_frames": self.frames,
                "seed": self.seed,
            }
            return json.dumps(doc, separators=(",", ":")).encode(), headers
        raise ValueError(f"body format {body_format!r}: expected json or binary")


class Workload:
    """An endless, seeded sequence of StreamSpecs."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        self._vocab = np.asarray(config.vocab_sizes, dtype=np.int64)
        self._references: dict[int, np.ndarray] = {}
        self._count = 0

    def _ids(self, rng: np.random.Generator, rows: int, vocab: np.ndarray | None = None) -> np.ndarray:
        vocab = self._vocab if vocab is None else vocab
        return (rng.random((rows, self.config.n_codebooks)) * vocab).astype(np.int32)

    def _text(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        """Text rows: uniform ids, or under a rule its text rows (`_text_rows`)."""
        if self.config.row_rule is None:
            return self._ids(rng, rows)
        return self._text_rows(rng, rows, self.config.row_rule)

    def _text_rows(self, rng: np.random.Generator, rows: int, rule: RowRule) -> np.ndarray:
        """The rule's text rows: its first empty id in the frame columns, a token other than
        the frame marker and the frame-end id in the marker column, the rest uniform."""
        m = rule.marker_column
        excluded = _tokens_excluded(rule, int(self._vocab[m]))
        vocab = self._vocab.copy()
        vocab[m] -= len(excluded)
        out = self._ids(rng, rows, vocab)
        out[:, : rule.frame_columns] = rule.empty_ids[0]
        for token in excluded:  # ascending: each lifts the draws at or past it by one
            out[:, m] += out[:, m] >= token
        return out

    def _frame_rows(self, rng: np.random.Generator, rows: int, rule: RowRule) -> np.ndarray:
        """The rule's audio-frame rows: codes below its code limit, the marker in its column."""
        vocab = self._vocab.copy()
        vocab[: rule.frame_columns] = np.minimum(vocab[: rule.frame_columns], rule.code_limit)
        out = self._ids(rng, rows, vocab)
        out[:, rule.marker_column] = rule.marker_id
        return out

    def _voice_rows(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        """A voice's reference: uniform ids, or under a rule its transcript's text rows
        (TRANSCRIPT_SHARE of them, at least one) then its clip's audio-frame rows, the last
        the audio's end frame when the rule has one (as CSM's prompts are laid out)."""
        rule = self.config.row_rule
        if rule is None:
            return self._ids(rng, rows)
        n_text = min(rows, max(1, round(rows * TRANSCRIPT_SHARE)))
        out = np.concatenate([self._text_rows(rng, n_text, rule), self._frame_rows(rng, rows - n_text, rule)])
        if rows > n_text and rule.frame_end_id >= 0:
            out[-1, : rule.frame_columns] = rule.frame_end_code
        return out

    def _reference(self, voice: int) -> np.ndarray:
        ref = self._references.get(voice)
        if ref is None:
            # Its own stream per voice: a voice's reference never depends on draw order.
            rng = np.random.default_rng([self.config.seed, 1, voice])
            ref = self._voice_rows(rng, self.config.reference_rows)
            self._references[voice] = ref
        return ref

    def next(self) -> StreamSpec:
        cfg = self.config
        rng = self._rng
        index = self._count
        self._count += 1
        total = int(rng.integers(cfg.prompt_rows[0], cfg.prompt_rows[1] + 1))
        frames = int(rng.integers(cfg.frames[0], cfg.frames[1] + 1))
        seed = int(rng.integers(0, 2**63))
        reused = cfg.voices > 0 and bool(rng.random() < cfg.voice_reuse)
        if cfg.speech:
            v = int(rng.integers(0, max(1, cfg.voices)))
            voice = warm_voice(v) if reused else f"{COLD_PREFIX}{cfg.seed}-{index}"
            return StreamSpec(index=index, voice=voice, reused=reused, text=speech_text(rng),
                              prompt=np.zeros((0, cfg.n_codebooks), np.int32), frames=frames, seed=seed)
        if reused:
            v = int(rng.integers(0, cfg.voices))
            voice, reference = f"voice-{v}", self._reference(v)
        else:
            voice, reference = f"cold-{cfg.seed}-{index}", self._voice_rows(rng, cfg.reference_rows)
        text = self._text(rng, max(0, total - reference.shape[0]))
        prompt = np.concatenate([reference, text]) if text.size else reference.copy()
        return StreamSpec(
            index=index, voice=voice, reused=reused, prompt=prompt, frames=frames, seed=seed
        )

    def __iter__(self) -> Iterator[StreamSpec]:
        while True:
            yield self.next()


def row_rule_of(model: Mapping[str, Any]) -> RowRule | None:
    """GET /v1/model's `row_rule` as the RowRule the LB checks rows with (None: it has none)."""
    doc = model.get("row_rule")
    if doc is None:
        return None
    missing = [f.name for f in fields(RowRule) if f.name not in doc]
    if missing:
        raise ValueError(f"GET /v1/model's row_rule lacks {', '.join(missing)}")
    values = {f.name: doc[f.name] for f in fields(RowRule)}
    return RowRule(**(values | {"empty_ids": tuple(values["empty_ids"])}))


def _tokens_excluded(rule: RowRule, vocab: int) -> list[int]:
    """The ids below `vocab` a text row's token may not be, ascending."""
    return sorted({t for t in (rule.marker_id, rule.frame_end_id) if 0 <= t < vocab})


# ------------------------------------------------------------------ speech

SPEECH_TEXTS = (
    "Hello there, how are you today?",
    "The weather is clear and the wind is calm.",
    "Please hold the line, your call matters to us.",
    "Turn left at the next corner, then go straight on.",
    "Your order has shipped and will arrive on Tuesday.",
    "We measured the time to the first byte of audio.",
    "A stream must never stall while the listener waits.",
    "Read me the news, then play some quiet music.",
    "The meeting starts at ten, in the second room.",
    "Thank you for waiting, the doctor will see you now.",
    "Seven cats sat on a warm wall in the sun.",
    "Streaming speech should sound smooth from start to end.",
)
WORDS = tuple(sorted({w.strip(",.?").lower() for t in SPEECH_TEXTS for w in t.split()}))
WARM_PREFIX, COLD_PREFIX = "loadgen-", "loadgen-cold-"


def warm_voice(v: int) -> str:
    """Warm voice v's name: the same for every seed, so a rerun finds it warm."""
    return f"{WARM_PREFIX}{v}"


def speech_text(rng: np.random.Generator) -> str:
    """A sentence of SPEECH_TEXTS (half the draws), else 4-12 of their words in a new order."""
    if rng.random() < 0.5:
        return SPEECH_TEXTS[int(rng.integers(0, len(SPEECH_TEXTS)))]
    words = [WORDS[int(i)] for i in rng.integers(0, len(WORDS), int(rng.integers(4, 13)))]
    return " ".join(words).capitalize() + "."


def _name_seed(name: str) -> list[int]:
    return [3, *name.encode()]  # a voice's content depends on its name only


def voice_clip(name: str, sample_rate: int, seconds: float) -> bytes:
    """A synthetic reference clip, 16-bit little-endian mono PCM, fixed per name: a tone
    gliding from a pitch of its own, with a little noise (a stand-in for a recording)."""
    rng = np.random.default_rng(_name_seed(name))
    t = np.arange(int(sample_rate * seconds)) / sample_rate
    f0 = sample_rate * float(rng.uniform(0.02, 0.08))
    x = 0.3 * np.sin(2 * np.pi * (f0 + 0.01 * sample_rate * t) * t) + 0.02 * rng.standard_normal(t.size)
    return (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def voice_codes(name: str, n_books: int, size: int, frames: int) -> list[list[int]]:
    """Synthetic codec codes [n_books][frames], uniform in [0, size), fixed per name."""
    rng = np.random.default_rng(_name_seed(name))
    return rng.integers(0, size, (n_books, frames)).tolist()  # type: ignore[no-any-return]


def arrival_times(
    rate: float, duration_s: float, burst_share: float = 0.0, burst_size: int = 1, seed: int = 0
) -> list[tuple[float, int]]:
    """(time, how many requests) events in [0, duration): Poisson, with clumps.

    An event is a clump of `burst_size` with probability p, else one request, where p
    makes the clumped share of requests equal `burst_share`; events come at a rate that
    keeps the request rate at `rate`.
    """
    if rate <= 0:
        raise ValueError(f"rate {rate} must be > 0")
    if not 0.0 <= burst_share < 1.0:
        raise ValueError(f"burst_share {burst_share} must lie in [0, 1)")
    if burst_size < 1:
        raise ValueError(f"burst_size {burst_size} must be >= 1")
    b = burst_size
    p = 0.0 if b == 1 or burst_share == 0 else burst_share / (b - burst_share * (b - 1))
    event_rate = rate / (p * b + (1 - p))
    rng = np.random.default_rng([seed, 2])
    events: list[tuple[float, int]] = []
    t = float(rng.exponential(1 / event_rate))
    while t < duration_s:
        events.append((t, b if rng.random() < p else 1))
        t += float(rng.exponential(1 / event_rate))
    return events


def parse_range(text: str, name: str) -> tuple[int, int]:
    """ "1000-2000" -> (1000, 2000); "500" -> (500, 500)."""
    parts = [p.strip() for p in str(text).split("-")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{name} {text!r}: expected N or LOW-HIGH") from None
    if len(values) == 1:
        return values[0], values[0]
    if len(values) != 2 or values[0] > values[1]:
        raise ValueError(f"{name} {text!r}: expected N or LOW-HIGH with LOW <= HIGH")
    return values[0], values[1]


def parse_list(text: str, name: str, kind: type = int) -> list:
    try:
        values = [kind(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"{name} {text!r}: expected a comma-separated list of numbers") from None
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def shares(specs: Sequence[StreamSpec]) -> dict[str, float]:
    """Share of warm-voice requests and of those whose voice was already used before."""
    seen: set[str] = set()
    repeat = 0
    for s in specs:
        if s.voice in seen:
            repeat += 1
        seen.add(s.voice)
    n = max(1, len(specs))
    return {"reused": sum(s.reused for s in specs) / n, "prefix_repeat": repeat / n}
