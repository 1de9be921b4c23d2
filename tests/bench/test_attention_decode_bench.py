"""`pdunit bench attention`'s decode points: parsing, the variants it times, the summary
that names the fastest correct one (CPU); a short decode sweep on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdunit.bench import attention
from tests.kernels.paging import gpu


def test_decode_points_parse_and_name_bad_entries() -> None:
    assert attention.parse_decode_points("64x2048, 8X100") == [(64, 2048), (8, 100)]
    assert attention.parse_decode_points("") == []
    with pytest.raises(ValueError, match="'64x'"):
        attention.parse_decode_points("64x")
    with pytest.raises(ValueError, match="'0x5'"):
        attention.parse_decode_points("0x5")


def test_decode_variants_are_checked_settings_with_the_default_first_and_once() -> None:
    got = attention.parse_decode_variants("kv_words=1; default; block_g=8,kv_words=1;kv_words=1")
    assert got == ["", "kv_words=1", "kv_words=1,block_g=8"]  # the settings' own order, no repeats
    with pytest.raises(ValueError, match="--decode-kernels: block_g=3"):
        attention.parse_decode_variants("block_g=3")
    assert attention.parse_decode_variants(attention.DECODE_VARIANTS)[0] == ""


def test_decode_summary_scores_variants_against_the_default_and_drops_wrong_ones() -> None:
    def row(point: str, kernel: str, ms: float, err: float) -> dict:
        return {"point": point, "kernel": f"decode {kernel}", "decode_kernel": kernel, "ms": ms, "err": err,
                "of_copy": 1.0 / ms}

    rows = [row("a", "", 2.0, 1e-3), row("a", "kv_words=1", 1.0, 1e-3), row("a", "block_g=8", 0.5, 0.3),
            row("b", "", 4.0, 1e-3), row("b", "kv_words=1", 4.0, 1e-3), row("b", "block_g=8", 1.0, 1e-3),
            {"point": "a", "kernel": "torch sdpa", "ms": 0.1, "err": 1e-3}]  # never a variant
    s = attention.summarize_decode(rows)
    assert s["decode_speedup_over_default"] == {"default": 1.0, "kv_words=1": pytest.approx(2**0.5, rel=1e-3)}
    assert s["decode_best"] == "kv_words=1"  # block_g=8 was wrong at "a": not scored
    assert s["decode_of_copy"]["kv_words=1"] == {"a": 1.0, "b": 0.25}


@gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_a_short_decode_sweep_writes_every_variant_and_torchs_rows(tmp_path: Path, kv_dtype: str) -> None:
    rc = attention.main(["--points", "", "--decode-points", "16x300", "--decode-kernels", "default;kv_words=1",
                         "--kv-cache-dtype", kv_dtype, "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("attention-*.json")).read_text())
    kernels = {r["kernel"] for r in doc["rows"]}
    assert {"decode default", "decode kv_words=1", "torch sdpa, K/V gathered and widened in the call"} <= kernels
    assert all(r["err"] < 5e-2 for r in doc["rows"] if r["err"] is not None), doc["rows"]  # fp8 dots: q in e4m3
    assert doc["summary"]["decode_best"] in {"default", "kv_words=1"}
