"""`--unit-secret-file` on P and D: the secret that authenticates P to D's tcp KV
listener. Required with `--transfer tcp`; a file that is missing or readable by others
is refused at start, naming the flag; `auto` starts without it (and offers no tcp)."""

from __future__ import annotations

import os

import pytest

from pdunit.engine.decode.main import DecodeConfig
from pdunit.engine.prefill.main import PrefillConfig
from pdunit.engine.security import write_secret_file
from pdunit.engine.settings import ConfigError, parse_config

CONFIGS = [(DecodeConfig, "pdunit decode"), (PrefillConfig, "pdunit prefill")]


@pytest.mark.parametrize(("model", "prog"), CONFIGS)
def test_tcp_without_the_secret_is_refused_naming_the_flag(model, prog):
    with pytest.raises(ConfigError, match="--unit-secret-file"):
        parse_config(model, ["--transfer", "tcp"], prog, env={})


@pytest.mark.parametrize(("model", "prog"), CONFIGS)
def test_a_secret_file_others_can_read_or_that_is_missing_is_refused(model, prog, tmp_path):
    path = str(tmp_path / "unit.secret")
    with pytest.raises(ConfigError, match="--unit-secret-file"):
        parse_config(model, ["--transfer", "auto", "--unit-secret-file", path], prog, env={})
    write_secret_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        parse_config(model, ["--transfer", "tcp", "--unit-secret-file", path], prog, env={})


@pytest.mark.parametrize(("model", "prog"), CONFIGS)
def test_the_unit_secret_comes_from_the_flag_or_the_env(model, prog, tmp_path):
    path = str(tmp_path / "unit.secret")
    write_secret_file(path)
    assert parse_config(model, ["--transfer", "tcp", "--unit-secret-file", path], prog, env={}).unit_secret_file == path
    cfg = parse_config(model, ["--transfer", "tcp"], prog, env={"PDUNIT_UNIT_SECRET_FILE": path})
    assert cfg.unit_secret_file == path
    assert parse_config(model, ["--transfer", "auto"], prog, env={}).unit_secret_file == ""
