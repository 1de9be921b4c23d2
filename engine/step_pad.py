"""The synthetic step cost of tests and benchmarks (`--synthetic-step-ms`): each step of
D or the monolith that decodes or prefills sleeps until it lasts base + per_stream x
streams + per_row x prompt rows (ms), so a step's time is a known function of its batch
and the model's own CPU time (moving 2-3x with a shared machine's load) a minor part.

Owns the flags (P's `--synthetic-forward-ms` pads its forwards alike), the pad and its
gauge. Never on in a pod unseen: off by default, logged at start and exported
(`pdunit_synthetic_step_ms{term}`) when on, so a figure measured with it is never taken
for the model's. It sleeps on the step-loop (P: forward) thread only, the GIL released:
gRPC handlers run meanwhile; a longer step is left as it is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Annotated, Any

from prometheus_client import Gauge
from pydantic import AfterValidator, BaseModel, Field

from pdunit.engine import metrics as m

SYNTHETIC_STEP_MS = m.role_metric(Gauge(
    "pdunit_synthetic_step_ms", "The synthetic step cost each step is padded to (--synthetic-step-ms; tests and "
    "benchmarks only), ms per unit of each term: all 0 = off, the steps are the model's own",
    ["term"], registry=None), "decode", "monolith", "prefill")


@dataclass(frozen=True)
class StepPad:
    """step ms >= base_ms + per_stream_ms x streams + per_row_ms x prompt rows."""

    base_ms: float = 0.0
    per_stream_ms: float = 0.0
    per_row_ms: float = 0.0

    @property
    def on(self) -> bool:
        return self.base_ms > 0 or self.per_stream_ms > 0 or self.per_row_ms > 0

    def ms(self, streams: int, rows: int = 0) -> float:
        return self.base_ms + self.per_stream_ms * streams + self.per_row_ms * rows

    def wait(self, t0: float, streams: int, rows: int = 0) -> None:
        """Sleeps until the step begun at `t0` (time.perf_counter()) that decoded
        `streams` and computed `rows` prompt rows has lasted its pad. Off: returns at once."""
        if not self.on or (streams <= 0 and rows <= 0):
            return
        left = t0 + self.ms(streams, rows) / 1000 - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def export(self, log: logging.Logger) -> None:
        """The gauge (all 0 when off), and a warning at start when on."""
        for term, value in asdict(self).items():
            SYNTHETIC_STEP_MS.labels(term=term).set(value)
        if self.on:
            log.warning("synthetic step cost on: every step is padded (tests and benchmarks only)",
                        extra={"synthetic_step_ms": asdict(self)})


def _checked(text: str) -> str:
    parse_step_pad(text)
    return text


# A pad flag's value: the text, checked by parse_step_pad (kept as given, so a config's
# flags rebuild it); each Fields class below turns it into a StepPad.
_PadText = Annotated[str, AfterValidator(_checked)]


def _pad_field(what: str) -> Any:
    """A pad flag, off by default; `what` says which terms pad what."""
    return Field("", description=f"tests and benchmarks only, never in a pod: {what}; empty = off")


class SyntheticForwardFields(BaseModel):
    """P's synthetic forward cost (a prefill forward padded as a step is, per prompt and row)."""

    synthetic_forward_ms: _PadText = _pad_field(
        "BASE,PER_PROMPT[,PER_ROW] pads every prefill forward, by sleeping, to BASE + PER_PROMPT x prompts + "
        "PER_ROW x computed rows ms (exported as pdunit_synthetic_step_ms, per_stream_ms = per prompt)")

    def forward_pad(self) -> StepPad:
        return parse_step_pad(self.synthetic_forward_ms)


class SyntheticStepFields(BaseModel):
    """The synthetic step cost flag of every engine that decodes (D, the monolith)."""

    synthetic_step_ms: _PadText = _pad_field(
        "BASE,PER_STREAM[,PER_ROW] pads every step, by sleeping, to BASE + PER_STREAM x decoding streams + "
        "PER_ROW x prompt rows ms, so step times are a known function of the batch (exported as "
        "pdunit_synthetic_step_ms)")

    def step_pad(self) -> StepPad:
        return parse_step_pad(self.synthetic_step_ms)


def parse_step_pad(text: str) -> StepPad:
    """"BASE,PER_STREAM[,PER_ROW]" (ms, each >= 0) -> StepPad; "" -> off. A ValueError names the term."""
    if not text.strip():
        return StepPad()
    parts = [p.strip() for p in text.split(",")]
    if not 2 <= len(parts) <= 3:
        raise ValueError(f"expected BASE,PER_STREAM[,PER_ROW] in ms (got {text!r}: {len(parts)} terms)")
    values = []
    for name, part in zip(("BASE", "PER_STREAM", "PER_ROW"), parts, strict=False):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{name} of {text!r} is {part!r}: expected a number of ms >= 0") from None
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"{name} of {text!r} is {part!r}: expected a finite number of ms >= 0")
        values.append(value)
    return StepPad(*values)
