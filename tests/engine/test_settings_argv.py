"""`to_argv`: the flags that rebuild a config through `parse_config` (bench compare's child runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdunit.bench.capacity import CapacityConfig
from pdunit.bench.compare import CompareConfig
from pdunit.engine.settings import parse_config, to_argv


def test_flags_rebuild_the_config():
    cfg = CompareConfig(model="random:tiny:1", duration=2.5, repeat=3, stop_at_failure=False, variants="1p1d",
                        prefill_gemm="fp8",
                        variant_concurrency="1p1d=4,8;monolith-chunked=2", plot="", gpu_base=2)
    argv = to_argv(cfg, env={})
    assert "--no-stop-at-failure" in argv and "--duration=2.5" in argv and "--repeat=3" in argv
    assert "--prefill-gemm=fp8" in argv
    assert parse_config(CompareConfig, argv, "x", env={}) == cfg


def test_default_fields_give_no_flags_unless_the_env_sets_them():
    assert to_argv(CompareConfig(), env={}) == []
    assert to_argv(CompareConfig(stop_at_failure=True, duration=60.0), env={}) == []
    # PDUNIT_DURATION would replace the default in the parsing process: the flag must win
    env = {"PDUNIT_DURATION": "5"}
    argv = to_argv(CompareConfig(), env=env)
    assert argv == ["--duration=60.0"]
    assert parse_config(CompareConfig, argv, "x", env=env) == CompareConfig()


def test_values_starting_with_a_dash_and_lists_round_trip():
    cfg = CapacityConfig(concurrency=[1, 2], rate=[], seed=-1, prompt_rows=(50, 100), progress=False)
    argv = to_argv(cfg, env={})
    assert "--concurrency=1,2" in argv and "--no-progress" in argv
    assert parse_config(CapacityConfig, argv, "x", env={}) == cfg


def test_a_list_item_with_a_comma_has_no_flag_form():
    from pdunit.engine.local import LocalConfig

    with pytest.raises(ValueError, match="--extra-lb-args"):
        to_argv(LocalConfig(extra_lb_args=["--x=a,b"]), env={})


@pytest.mark.parametrize("prog,config", [("pdunit prefill", "PrefillConfig"), ("pdunit monolith", "MonolithConfig")])
def test_an_unknown_prefill_gemm_names_the_field_and_its_flag(prog, config, capsys):
    from pdunit.engine.monolith.main import MonolithConfig
    from pdunit.engine.prefill.main import PrefillConfig
    from pdunit.engine.settings import ConfigError

    model = {"PrefillConfig": PrefillConfig, "MonolithConfig": MonolithConfig}[config]
    assert parse_config(model, ["--prefill-gemm", "fp8"], prog, env={}).prefill_gemm == "fp8"
    with pytest.raises(ConfigError, match=r"argument --prefill-gemm: invalid choice: 'int8'"):
        parse_config(model, ["--prefill-gemm", "int8"], prog, env={})
    err = capsys.readouterr().err
    assert "bf16" in err and "fp8" in err  # the choices, listed by argparse


@pytest.mark.parametrize("config", ["DecodeConfig", "MonolithConfig"])
def test_an_unknown_decode_gemm_names_the_field_and_its_flag(config, capsys):
    from pdunit.engine.decode.main import DecodeConfig
    from pdunit.engine.monolith.main import MonolithConfig
    from pdunit.engine.settings import ConfigError

    model = {"DecodeConfig": DecodeConfig, "MonolithConfig": MonolithConfig}[config]
    assert parse_config(model, [], "x", env={}).decode_gemm == "bf16"
    assert parse_config(model, ["--decode-gemm", "fp8"], "x", env={}).decode_gemm == "fp8"
    with pytest.raises(ConfigError, match=r"argument --decode-gemm: invalid choice: 'int8'"):
        parse_config(model, ["--decode-gemm", "int8"], "x", env={})
    err = capsys.readouterr().err
    assert "bf16" in err and "fp8" in err  # the choices, listed by argparse


def test_a_local_unit_passes_the_prefill_options_to_p_and_the_monolith_only(tmp_path):
    from pdunit.engine.local import LocalConfig, LocalUnit

    def argv_of(**kw):
        # the run dir outlives the call: P's config below reads the unit secret drawn there
        unit = LocalUnit(LocalConfig(lb_port=0, guard=False, run_dir=str(tmp_path), **kw))
        return {name: argv for name, argv in unit.commands()}

    pd = argv_of(mode="pd", prefill_gemm="fp8", prefill_graphs=True)
    assert pd["prefill"][-3:] == ["--prefill-gemm", "fp8", "--prefill-graphs"]
    assert not any(a.startswith("--prefill-g") for a in pd["decode"] + pd["lb"])
    mono = argv_of(mode="monolith", prefill_graphs=False)
    assert "--no-prefill-graphs" in mono["monolith"] and "--prefill-gemm" not in mono["monolith"]
    # the defaults add nothing: the commands stay the pod's (engine/unit_layout.py)
    assert not any(a.startswith("--prefill-g") for argv in argv_of(mode="pd").values() for a in argv)
    from pdunit.engine.prefill.main import PrefillConfig

    assert parse_config(PrefillConfig, pd["prefill"][pd["prefill"].index("prefill") + 1:], "p", env={}).prefill_graphs
    mono_argv = mono["monolith"][mono["monolith"].index("monolith") + 1:]
    from pdunit.engine.monolith.main import MonolithConfig

    assert parse_config(MonolithConfig, mono_argv, "m", env={}).prefill_graphs is False


@pytest.mark.parametrize("gpu_path, given, want", [
    (True, {}, (True, 0)),                                    # graphs make fp8 pay from 300 rows
    (False, {}, (False, 1200)),                               # eager fp8 loses under ~1000 rows
    (True, {"prefill_graphs": False}, (False, 1200)),
    (True, {"fp8_min_rows": 64}, (True, 64)),
    (False, {"prefill_graphs": True, "fp8_min_rows": 0}, (True, 0)),  # start_prefill_model refuses it
])
def test_prefill_graphs_and_the_fp8_threshold_default_by_the_models_path(gpu_path, given, want):
    from pdunit.engine.prefill.main import PrefillConfig

    assert PrefillConfig(**given).resolved_prefill(gpu_path) == want


@pytest.mark.parametrize("module", ["pdunit.engine.lb.main", "pdunit.sidecars.quiesce_guard.main",
                                    "pdunit.engine.local"])
def test_processes_without_a_model_do_not_import_torch(module, tmp_path):
    """The LB, the guard and `pdunit local`'s supervisor start fast and stay small: torch
    (seconds, hundreds of MB) is the engines' alone (the operator image's test checks
    the operator and the router)."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_help_shows_a_default_factory_fields_default_not_pydantics_marker():
    from pdunit.engine.prefill.main import PrefillConfig
    from pdunit.engine.settings import build_parser

    text = build_parser(PrefillConfig, "pdunit prefill").format_help()
    assert "PydanticUndefined" not in text
    assert "PDUNIT_PREFILL_GRAPH_ROWS; default []" in " ".join(text.split())
