"""`--decode-kernel`: the decode attention kernel's settings as D's and the monolith's
flag, checked where the engines' configs are parsed, applied before the first launch."""

from __future__ import annotations

import pytest

from pdunit.engine.decode.main import DecodeConfig
from pdunit.engine.monolith.main import MonolithConfig
from pdunit.engine.settings import ConfigError, parse_config
from pdunit.kernels import decode_settings as ds
from pdunit.kernels import paged_attention as pa


def test_parse_gives_the_changed_settings_as_ints():
    assert ds.parse("kv_as_a=1, fp8_dots=1") == {"kv_as_a": 1, "fp8_dots": 1}
    assert ds.parse("kv_words=1,block_g=8,lazy_softmax=1") == {"kv_words": 1, "block_g": 8, "lazy_softmax": 1}
    assert ds.parse("") == {}
    assert ds.parse(" , ") == {}


@pytest.mark.parametrize(("text", "says"), [
    ("foo=1", "unknown setting 'foo'"),
    ("fp8_dots=2", "fp8_dots=2 is not one of [0, 1]"),
    ("block_n=48", "block_n=48 is not one of [16, 32, 64, 128]"),
    ("block_n", "'block_n' is not KEY=VALUE"),
    ("=3", "'=3' is not KEY=VALUE"),
    ("num_warps=four", "num_warps='four' is not an integer"),
    ("kv_as_a=1,kv_as_a=0", "'kv_as_a' is given twice"),
    ("block_g=4", "block_g=4 is not one of [8, 16]"),
    ("kv_words=2", "kv_words=2 is not one of [0, 1]"),
    ("lazy_softmax=-1", "lazy_softmax=-1 is not one of [0, 1]"),
])
def test_parse_names_what_is_wrong(text, says):
    with pytest.raises(ValueError, match="--decode-kernel") as err:
        ds.parse(text)
    assert says in str(err.value)


def test_render_lists_what_differs_from_the_default_and_parses_back():
    settings = {**ds.DECODE_DEFAULT, "fp8_dots": 0, "kv_as_a": 1}
    text = ds.render(settings)
    assert text == "kv_as_a=1,fp8_dots=0"  # the default's order
    assert {**ds.DECODE_DEFAULT, **ds.parse(text)} == settings
    assert ds.render(ds.DECODE_DEFAULT) == ""


def test_every_tune_candidate_is_a_valid_setting_set():
    for cand in pa.DECODE_CANDIDATES:
        assert ds.checked(cand) == cand
        assert {**ds.DECODE_DEFAULT, **ds.parse(ds.render(cand))} == cand
    with pytest.raises(ValueError, match="unknown setting 'kv_heads'"):
        pa._candidate(kv_heads=2)


def test_configure_decode_sets_the_live_settings_from_the_default():
    saved = dict(pa.DECODE_CONFIG)
    try:
        pa.DECODE_CONFIG["block_n"] = 128  # left over from an earlier change: reset, not kept
        live = pa.configure_decode("fp8_dots=0")
        assert live == {**ds.DECODE_DEFAULT, "fp8_dots": 0} == pa.DECODE_CONFIG
        assert pa.configure_decode("") == ds.DECODE_DEFAULT
        with pytest.raises(ValueError, match="fp8_dots=5"):
            pa.configure_decode("fp8_dots=5")
        assert pa.DECODE_CONFIG == ds.DECODE_DEFAULT  # a refused text changes nothing
    finally:
        pa.DECODE_CONFIG.clear()
        pa.DECODE_CONFIG.update(saved)


@pytest.mark.parametrize("config", [DecodeConfig, MonolithConfig])
def test_engines_take_the_flag_in_canonical_form_and_refuse_a_bad_one(config, capsys):
    cfg = parse_config(config, ["--decode-kernel", "fp8_dots=0,kv_as_a=1,block_n=64"], "test", env={})
    assert cfg.decode_kernel == "kv_as_a=1,fp8_dots=0"  # block_n=64 is the default
    assert parse_config(config, [], "test", env={}).decode_kernel == ""
    with pytest.raises(ConfigError):
        parse_config(config, ["--decode-kernel", "fp8_dots=7"], "test", env={})
    assert "invalid decode_kernel (from --decode-kernel)" in capsys.readouterr().err


def test_bench_compare_checks_the_flag_for_d_and_the_monolith():
    from pdunit.bench.compare import checked_argv

    assert checked_argv("--decode-kernel=fp8_dots=1", "--decode-args", "D", "cpu") == ["--decode-kernel=fp8_dots=1"]
    assert checked_argv("--decode-kernel=fp8_dots=1", "--monolith-args", "monolith", "cpu") == [
        "--decode-kernel=fp8_dots=1"]
    with pytest.raises(SystemExit, match="not a valid set of flags for D"):
        checked_argv("--decode-kernel=fp8_dots=9", "--decode-args", "D", "cpu")
    with pytest.raises(SystemExit, match="not a valid set of flags for P"):  # P runs no decode attention
        checked_argv("--decode-kernel=fp8_dots=1", "--prefill-args", "P", "cpu")
