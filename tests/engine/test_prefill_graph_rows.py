"""`--prefill-graph-rows` of P and the monolith: the prefill graphs' row buckets, checked
where the flags are parsed; the default ones stop at the first that holds the largest
forward (`--max-batch-rows`)."""

from __future__ import annotations

import pytest

from pdunit.engine.monolith.main import MonolithConfig
from pdunit.engine.prefill.main import PrefillConfig
from pdunit.engine.settings import PREFILL_GRAPH_ROWS, ConfigError, parse_config, to_argv


@pytest.mark.parametrize("config", [PrefillConfig, MonolithConfig])
def test_default_buckets_stop_at_the_first_that_holds_the_largest_forward(config):
    assert parse_config(config, [], "test", env={}).graph_buckets() == list(PREFILL_GRAPH_ROWS)
    small = parse_config(config, ["--max-batch-rows", "1000"], "test", env={})
    assert small.graph_buckets() == [128, 256, 512, 768, 1024]  # 1024 holds a 1000-row forward
    assert parse_config(config, ["--max-batch-rows", "100"], "test", env={}).graph_buckets() == [128]


@pytest.mark.parametrize("config", [PrefillConfig, MonolithConfig])
def test_given_buckets_are_sorted_and_kept_and_round_trip_as_flags(config):
    cfg = parse_config(config, ["--prefill-graph-rows", "8192,2048,4096,2048"], "test", env={})
    assert cfg.graph_buckets() == [2048, 4096, 8192]
    assert "--prefill-graph-rows=2048,4096,8192" in to_argv(cfg, env={})
    assert parse_config(config, to_argv(cfg, env={}), "test", env={}).graph_buckets() == [2048, 4096, 8192]


@pytest.mark.parametrize(("argv", "says"), [
    (["--prefill-graph-rows", "4096", "--max-batch-rows", "2048"], "larger than --max-batch-rows 2048"),
    (["--prefill-graph-rows", "0,128"], "give positive row counts"),
    (["--prefill-graph-rows", "12x"], "prefill_graph_rows"),
])
def test_bad_buckets_are_refused_naming_the_flag(argv, says, capsys):
    with pytest.raises(ConfigError):
        parse_config(PrefillConfig, argv, "test", env={})
    err = capsys.readouterr().err
    assert "prefill_graph_rows" in err and says in err
