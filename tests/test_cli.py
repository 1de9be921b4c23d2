"""The `pdunit` command line tells the truth: its help names every command and
benchmark, and a bad flag value is refused by argparse with the choices listed, exit 2,
before anything starts and without a traceback (issue 28 item 5)."""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from typing import Literal

import pytest

from pdunit.bench.main import BENCHES
from pdunit.cli import SUBCOMMANDS
from pdunit.cli import main as cli_main
from pdunit.engine.local import LocalConfig
from pdunit.engine.settings import (
    ConfigError,
    MonolithPolicy,
    TransferMode,
    choices_of,
    parse_config,
)


def test_pdunit_help_lists_every_command_and_every_benchmark(capsys):
    assert cli_main(["--help"]) == 0
    text = capsys.readouterr().out
    for name in [*SUBCOMMANDS, *BENCHES]:
        assert re.search(rf"^  {re.escape(name)}\s+\S", text, re.M), f"`pdunit --help` does not list {name}"


def test_pdunit_without_a_command_prints_its_usage_on_stderr_and_exits_2(capsys):
    assert cli_main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "usage: pdunit <command>" in out.err


def test_choices_are_read_from_literal_fields_only():
    assert choices_of(Literal["a", "b"]) == ["a", "b"]
    assert choices_of(Literal["a", "b"] | None) == ["a", "b"]
    assert choices_of(typing.Optional[Literal["a"]]) == ["a"]  # noqa: UP045 - the other spelling of the same type
    assert choices_of(str) is None
    assert choices_of(Literal[1, 2]) is None  # argparse compares the flag's text: only strings
    assert choices_of(Literal["a"] | Literal["b"] | None) == ["a", "b"]


LITERAL_FIELDS = [name for name, f in LocalConfig.model_fields.items() if choices_of(f.annotation)]


def test_the_choice_like_fields_of_pdunit_local_are_literals():
    assert {"mode", "transfer", "policy", "log_level", "log_format", "kv_cache_dtype"} <= set(LITERAL_FIELDS)


@pytest.mark.parametrize("name", LITERAL_FIELDS)
def test_a_value_outside_a_fields_choices_is_refused_with_the_choices_listed(name, capsys):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigError) as refused:
        parse_config(LocalConfig, [flag, "nvlink-x"], "pdunit local", env={})
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: 'nvlink-x'" in err
    for choice in choices_of(LocalConfig.model_fields[name].annotation) or []:
        assert repr(choice) in err or choice in err.split("choose from", 1)[1]


def test_the_literal_types_list_what_the_engines_build():
    """TransferMode and MonolithPolicy live in settings (imported without torch); the
    engines' own tables decide what runs: they must name the same values."""
    from pdunit.engine.monolith.worker import POLICIES
    from pdunit.engine.transfer.factory import MODES

    assert set(typing.get_args(TransferMode)) == set(MODES)
    assert set(typing.get_args(MonolithPolicy)) == set(POLICIES)


@pytest.mark.parametrize("argv, says", [
    (["--load-prompt-rows", "abc"], "invalid load_prompt_rows (from --load-prompt-rows): load_prompt_rows 'abc': "
                                    "expected N or LOW-HIGH"),
    (["--decode-devices", "cpu,cpu"], "pdunit local: --decode-devices 'cpu,cpu' names 2 devices for 1 D's"),
    (["--lb-port", "9000", "--admin-port", "9000"], "pdunit local: --admin-port 9000 is --lb-port"),
    (["--metrics-port", "9000", "--lb-port", "9002"], "--metrics-port 9000: its block 9000..9003 takes --lb-port 9002"),
    (["--extra-lb-args=--unit-name=x"], "drop --unit-name"),
    (["--speak", "hi"], "pdunit local: --speak needs --codec"),
    (["--load-api", "speech"], "pdunit local: --load-api speech needs --codec"),
])
def test_values_that_fail_only_together_or_later_are_refused_at_parse_time(argv, says, capsys):
    """These were accepted and failed after the children started (a traceback from
    `commands()` or from the short load's row parser), or not at all (an LB that calls
    itself by another name is never recognised as the unit's)."""
    with pytest.raises(ConfigError):
        parse_config(LocalConfig, argv, "pdunit local", env={})
    err = capsys.readouterr().err
    assert says in err and "invalid ?" not in err and "Value error" not in err


@pytest.mark.parametrize("argv, choices", [
    (["--transfer", "nvlink"], "auto', 'fabric', 'proxy', 'ipc', 'posix-fd', 'tcp', 'host"),
    (["--mode", "foo"], "pd', '1p2d', 'monolith"),
])
def test_pdunit_local_refuses_a_bad_choice_before_starting_anything(argv, choices, tmp_path):
    """`--transfer nvlink` started four processes, then ended in D's traceback."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "pdunit.engine.cli", "local", "--run-dir", str(run), *argv],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and f"argument {argv[0]}: invalid choice: '{argv[1]}'" in out.stderr
    assert choices.replace("'", "") in out.stderr.replace("'", "")
    assert out.stdout == "" and not run.exists()  # nothing started: not even the run dir
