"""Engine processes set Python's GIL switch interval from their config (a gRPC handler
must not wait Python's default 5 ms for the step-loop thread)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdunit.engine.decode.main import DecodeConfig
from pdunit.engine.monolith.main import MonolithConfig
from pdunit.engine.prefill.main import PrefillConfig
from pdunit.engine.settings import parse_config
from pdunit.engine.step_loop import engine_setup


def test_every_engine_defaults_to_a_half_millisecond_switch_interval():
    for model in (DecodeConfig, PrefillConfig, MonolithConfig):
        assert model().gil_switch_ms == 0.5
    assert parse_config(DecodeConfig, ["--gil-switch-ms", "2"], "pdunit decode").gil_switch_ms == 2.0


def test_engine_setup_applies_the_interval():
    before = sys.getswitchinterval()
    try:
        engine_setup(1, 0.5)
        assert abs(sys.getswitchinterval() - 0.0005) < 1e-9
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("role", ["prefill", "monolith"])
def test_prefill_graphs_on_a_cpu_engine_exit_2_naming_the_reason(role, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pdunit.engine.cli", role, "--socket", str(tmp_path / "s.sock"),
                           "--prefill-graphs"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "CUDA graphs need a CUDA device, the engine runs on cpu" in proc.stdout + proc.stderr
