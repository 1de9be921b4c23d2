"""`--cuda-graphs` (D's and the monolith's decode CUDA graphs): on by default where the
model takes its GPU path (every family, csm included), silently off elsewhere; asked for
off that path (CPU here), a start error naming the flag, as `--prefill-graphs` is."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdunit.engine.decode.main import DecodeConfig
from pdunit.engine.decode.step_forward import resolve_decode_graphs
from pdunit.engine.model.loader import load_model
from pdunit.engine.monolith.main import MonolithConfig
from pdunit.engine.settings import parse_config


def test_default_is_off_on_cpu_and_for_csm_without_an_error() -> None:
    for spec in ("random:tiny:0", "random:csm-tiny:0"):
        model = load_model(spec)
        assert resolve_decode_graphs(None, model) is False
        assert resolve_decode_graphs(False, model) is False
    assert parse_config(DecodeConfig, [], "pdunit decode").cuda_graphs is None
    assert parse_config(MonolithConfig, ["--no-cuda-graphs"], "pdunit monolith").cuda_graphs is False


@pytest.mark.parametrize("spec", ["random:tiny:0", "random:csm-tiny:0"])
def test_asking_for_them_on_cpu_names_the_flag_and_the_device(spec: str) -> None:
    with pytest.raises(ValueError, match=r"--cuda-graphs\) need the model's GPU path.*device cpu"):
        resolve_decode_graphs(True, load_model(spec))


@pytest.mark.parametrize("role", ["decode", "monolith"])
def test_an_engine_asked_for_decode_graphs_off_the_gpu_path_exits_2_naming_the_flag(role: str, tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdunit.engine.cli", role, "--socket", str(tmp_path / "s.sock"),
                           "--model", "random:csm-tiny:0", "--pool-tokens", "1024", "--cuda-graphs"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "decode CUDA graphs (--cuda-graphs) need the model's GPU path" in out
    assert "Traceback" not in out
