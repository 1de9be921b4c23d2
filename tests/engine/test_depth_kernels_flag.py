"""`--depth-kernels` (D's, the monolith's and `pdunit bench step`'s): auto by default (fused
on CUDA where it runs, else torch); `fused` reaches the model's depth decoder through `set_depth_kernels`, so where it cannot
run (here: the CPU, no Triton interpreter) each entry point stops at start naming the
flag and the reason, as `--mixed-graphs` does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdunit.bench import step
from pdunit.engine.decode.main import DecodeConfig
from pdunit.engine.model.family_csm import set_depth_kernels
from pdunit.engine.model.loader import load_model
from pdunit.engine.monolith.main import MonolithConfig
from pdunit.engine.settings import ConfigError, parse_config
from tests.kernels.paging import gpu


@pytest.mark.parametrize("config", [DecodeConfig, MonolithConfig])
def test_the_flag_parses_auto_by_default_and_fused_and_names_a_bad_value(config, capsys) -> None:
    assert parse_config(config, [], "x", env={}).depth_kernels == "auto"
    assert parse_config(config, ["--depth-kernels", "torch"], "x", env={}).depth_kernels == "torch"
    assert parse_config(config, ["--depth-kernels", "fused"], "x", env={}).depth_kernels == "fused"
    with pytest.raises(ConfigError, match=r"argument --depth-kernels: invalid choice: 'triton'"):
        parse_config(config, ["--depth-kernels", "triton"], "x", env={})
    err = capsys.readouterr().err
    assert "torch" in err and "fused" in err and "auto" in err


@pytest.mark.parametrize("spec", ["random:csm-tiny:0", "random:tiny:0"])
def test_auto_resolves_to_torch_off_cuda_and_without_a_depth_decoder(spec: str) -> None:
    model = load_model(spec, device="cpu", dtype="float16")
    assert set_depth_kernels(model, "auto") == "torch"
    fg = model.frame_generator
    assert getattr(fg, "fused", None) is None  # the torch modules stay the passes' kernels
    assert set_depth_kernels(model, "torch") == "torch"


@gpu
def test_auto_resolves_to_fused_for_a_csm_model_on_cuda() -> None:
    model = load_model("random:csm-tiny:0", device="cuda", dtype="bfloat16")
    assert set_depth_kernels(model, "auto") == "fused"
    assert model.frame_generator.fused is not None


@pytest.mark.parametrize("role", ["decode", "monolith"])
def test_an_engine_asked_for_fused_depth_kernels_off_the_gpu_path_exits_2_naming_the_flag(role: str,
                                                                                         tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdunit.engine.cli", role, "--socket", str(tmp_path / "s.sock"),
                           "--model", "random:csm-tiny:0", "--dtype", "float16", "--pool-tokens", "1024",
                           "--depth-kernels", "fused"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "--depth-kernels fused runs the GPU path's Triton kernels" in out and "device cpu" in out
    assert "Traceback" not in out


def test_bench_step_takes_the_flag_and_refuses_fused_off_the_gpu_path(capsys) -> None:
    with pytest.raises(SystemExit, match="--depth-kernels fused runs the GPU path's Triton kernels"):
        step.main(["--device", "cpu", "--model", "csm-tiny", "--depth-kernels", "fused", "--batches", "1",
                   "--contexts", "9", "--iters", "1", "--warmup", "0"])
    with pytest.raises(SystemExit):
        step.main(["--device", "cpu", "--depth-kernels", "triton"])
    assert "--depth-kernels: invalid choice: 'triton'" in capsys.readouterr().err
    doc = step.run_step(step.StepConfig(model="csm-tiny", device="cpu", page_size=4, batches=[2], contexts=[9],
                                        iters=1, warmup=0, overlap="on", depth_kernels="torch"))
    assert doc["config"]["depth_kernels"] == "torch" and doc["rows"][0]["frames"] == 2
    doc = step.run_step(step.StepConfig(model="csm-tiny", device="cpu", page_size=4, batches=[2], contexts=[9],
                                        iters=1, warmup=0, overlap="on"))
    assert doc["config"]["depth_kernels"] == "auto" and doc["summary"]["depth_kernels"] == "torch"
