"""GPU clocks, power and temperature sampled through a benchmark level (`nvidia-smi`).

Owns the sampler `bench compare` runs beside each level: every `period_s` one
`nvidia-smi` query of the variant's GPUs (in its own thread), reported as the lowest SM
clock, the mean power and the highest temperature beside the engines' own metrics, so a
GPU held below its clocks (power, thermal, another tenant) shows in the level it slowed
(why: docs/performance.md, "What each benchmark measures"). Must never run anything on
the GPUs; where there is no `nvidia-smi` (CPU runs, CI) it reports nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

QUERY = "index,clocks.sm,power.draw,temperature.gpu"


@dataclass(frozen=True)
class Sample:
    index: int
    sm_mhz: float
    power_w: float
    temp_c: float


def parse(text: str) -> list[Sample]:
    """`nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits` output; a field the
    driver does not report ("[N/A]") makes its row unusable and it is skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            out.append(Sample(int(parts[0]), float(parts[1]), float(parts[2]), float(parts[3])))
        except ValueError:
            continue
    return out


def summarize(samples: Sequence[Sample]) -> dict[str, float]:
    """The lowest SM clock, the mean power and the highest temperature over `samples`
    (all GPUs sampled together: a variant's GPUs, whichever was lowest or hottest)."""
    if not samples:
        return {}
    return {
        "gpu_sm_mhz_min": min(s.sm_mhz for s in samples),
        "gpu_power_w_mean": round(sum(s.power_w for s in samples) / len(samples), 1),
        "gpu_temp_c_max": max(s.temp_c for s in samples),
    }


@dataclass
class GpuSampler:
    """Samples `gpus` (nvidia-smi indices) every `period_s` between `start` and `stop`."""

    gpus: Sequence[int]
    period_s: float = 2.0
    command: Sequence[str] = ("nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits")
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def available(cls) -> bool:
        return shutil.which("nvidia-smi") is not None

    def start(self) -> GpuSampler:
        self._thread = threading.Thread(target=self._run, name="gpu-clocks", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return summarize(self.samples)

    def _run(self) -> None:
        wanted = set(self.gpus)
        while not self._stop.is_set():
            try:
                done = subprocess.run(list(self.command), capture_output=True, text=True, timeout=10, check=False)
            except (OSError, subprocess.SubprocessError):
                return  # no sampler: the level reports no clocks, not wrong ones
            self.samples += [s for s in parse(done.stdout) if s.index in wanted]
            self._stop.wait(self.period_s)
