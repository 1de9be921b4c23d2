"""`pdunit bench attention`: its points, FLOP count and tile choice on CPU; a short sweep
on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.bench import attention
from tests.kernels.paging import gpu


def test_points_parse_prefixes_and_name_bad_entries() -> None:
    assert attention.parse_points("4x1500, 2x512+1500") == [(4, 1500, 0), (2, 512, 1500)]
    with pytest.raises(ValueError, match="'4x'"):
        attention.parse_points("4x")
    with pytest.raises(ValueError, match="empty"):
        attention.parse_points(" , ")


def test_flops_count_every_visible_entry_once() -> None:
    heads, d, rows, cached = 3, 8, 5, 7
    # new row i (0-based) sees the prefix and new rows 0..i
    visible = sum(cached + i + 1 for i in range(rows))
    assert attention.attention_flops(heads, d, 2, rows, cached) == 4 * heads * d * visible * 2


def test_pool_case_gives_each_prompt_distinct_slots_made_of_whole_pages() -> None:
    ctx = attention.pool_case(3, 10, 5, 4, np.random.default_rng(0))
    assert [len(c) for c in ctx] == [15] * 3
    flat = np.concatenate(ctx)
    assert len(set(flat.tolist())) == flat.size
    for c in ctx:  # a page holds consecutive tokens
        assert all(c[i + 1] == c[i] + 1 for i in range(len(c) - 1) if (i + 1) % 4)


def test_best_tile_is_fastest_across_points_and_errors_disqualify() -> None:
    rows = [
        {"point": "a", "tile": "t1", "ms": 1.0, "err": 1e-4},
        {"point": "a", "tile": "t2", "ms": 2.0, "err": 1e-4},
        {"point": "a", "tile": "t3", "ms": 0.5, "err": 0.5},  # fastest, wrong
        {"point": "b", "tile": "t1", "ms": 3.0, "err": 1e-4},
        {"point": "b", "tile": "t2", "ms": 2.0, "err": 1e-4},
        {"point": "b", "tile": "t3", "ms": 0.5, "err": 1e-4},
        {"point": "b", "tile": None, "ms": 0.1, "err": None},  # sdpa: never a tile
    ]
    s = attention.summarize(rows)
    assert s["best_tile"] == "t1"  # 1.0 and 0.667 beat t2's 0.5 and 1.0 (geomean 0.816 vs 0.707)
    assert s["tiles_with_errors"] == ["t3"]
    assert "t3" not in s["tile_score"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_a_gpu_it_refuses_naming_the_interpreter_tests() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        attention.run_attention_bench(attention.AttentionBenchConfig(), "cmd")


@gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_a_short_sweep_writes_rows_for_every_tile_and_sdpa(tmp_path: Path, kv_dtype: str) -> None:
    rc = attention.main(["--points", "2x300,1x200+300", "--tiles", "64x64w4s2", "--iters", "2", "--warmup", "1",
                         "--kv-cache-dtype", kv_dtype, "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("attention-*.json")).read_text())
    kernels = {(r["point"], r["tile"] or r["kernel"]) for r in doc["rows"]}
    default = doc["summary"]["default_tile"]
    sdpa = "torch sdpa (contiguous K/V)"
    assert {("2x300", "64x64w4s2"), ("2x300", default), ("1x200+300", default), ("2x300", sdpa)} <= kernels
    assert ("1x200+300", sdpa) not in kernels  # contiguous SDPA has no prefix to see
    assert all(r["err"] < 1e-2 for r in doc["rows"] if r["err"] is not None), doc["rows"]  # library rows too
    assert ("2x300", "aten flash varlen (GQA), K/V gathered first") in kernels  # ran (else its label says why)
    assert doc["summary"]["best_tile"] in {"64x64w4s2", default}


def test_sdpa_per_prompt_computes_the_kernels_reference_with_and_without_a_prefix() -> None:
    from pdunit.kernels.prefill_attention import prefill_plan, reference_prefill_attention

    rng = np.random.default_rng(2)
    q_lens = [5, 7]  # prompt 0: 7 cached rows + 5 new (12 in its context); prompt 1: a whole prompt
    ctx = attention.pool_case(1, 12, 0, 4, rng) + [np.arange(20, 27)]
    plan = prefill_plan(q_lens, ctx, [0, 5])
    q = torch.randn(12, 4, 16, dtype=torch.float64)
    kv = torch.randn(2, 32, 2, 16, dtype=torch.float64)
    got = attention.sdpa_per_prompt(q, kv, [(0, 5), (5, 7)], [torch.from_numpy(c) for c in ctx], torch.empty_like(q))
    want = reference_prefill_attention(q, kv, plan["table"], plan["ctx_len"], plan["q_len"], plan["q_start"])
    torch.testing.assert_close(got, want)
