"""Fused prefill attention over the paged pool: whole prompts, prompts after a cached
prefix, several sequences in one launch, fragmented pages, a pool of the model's dtype or
fp8 e4m3; against the torch reference (GPU; CPU via Triton's interpreter), and the
reference against the model's own."""

from __future__ import annotations

import inspect
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pdunit.engine.model.transformer import ForwardBatch, _paged_attention, _plan
from pdunit.kernels.kv_dtype import kv_storage_dtype, to_kv
from pdunit.kernels.kv_dtype_names import KV_CACHE_DTYPES
from pdunit.kernels.prefill_attention import prefill_plan, reference_prefill_attention
from tests.kernels import paging as paging_module
from tests.kernels.paging import gpu, paged_slots, run_interpreted


def packed_case(
    q_lens: list[int], ctx_lens: list[int], page: int, n_slots: int, seed: int
) -> tuple[list[np.ndarray], list[int], int]:
    """Context slots per sequence, each sequence's first row in a packed q with one
    unused row before, between and after the sequences, and the packed row count."""
    ctx = paged_slots(ctx_lens, page, n_slots, np.random.default_rng(seed))
    starts, row = [], 1
    for n in q_lens:
        starts.append(row)
        row += n + 1
    return ctx, starts, row


def test_prefill_reference_equals_the_models_reference_attention() -> None:
    """Cached prefix + new rows, and a whole prompt: the kernel's reference computes the
    model's reference attention (float64)."""
    q_lens, ctx_lens = [5, 12], [20, 12]
    ctx = paged_slots(ctx_lens, 4, 256, np.random.default_rng(0))
    batch = ForwardBatch.from_sequences(
        [np.zeros((n, 11), np.int64) for n in q_lens], ctx
    )
    q = torch.randn(sum(q_lens), 8, 32, dtype=torch.float64)
    kv = torch.randn(2, 256, 2, 32, dtype=torch.float64)
    want = _paged_attention(q, kv, _plan(batch, torch.device("cpu")))
    plan = prefill_plan(q_lens, ctx, [0, 5])
    got = reference_prefill_attention(
        q, kv, plan["table"], plan["ctx_len"], plan["q_len"], plan["q_start"]
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_prefill_plan_rejects_more_new_rows_than_context() -> None:
    with pytest.raises(ValueError, match="1 <= q_len <= ctx_len"):
        prefill_plan([4], [np.arange(3)], [0])


INTERPRETED_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    torch.set_num_threads(1)
    from pdunit.kernels.kv_dtype import kv_storage_dtype, to_kv
    from pdunit.kernels.prefill_attention import (
        PrefillTile, paged_prefill_attention, prefill_plan, reference_prefill_attention)
    rng = np.random.default_rng(5)
    # a whole prompt, 3 new rows after a prefix, a tiny prompt
    q_lens, ctx_lens = [70, 3, 2], [70, 100, 2]
    ctx = paged_slots(ctx_lens, 16, 512, rng)
    starts = [1, 72, 76]
    plan = prefill_plan(q_lens, ctx, starts)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
    # (query heads, kv heads, tile): GQA groups of 2 and 4, one that does not divide the
    # tile (3), no GQA (1); small tiles run both the unmasked and the masked loops
    for hq, hkv, tile in [(4, 2, "128x64w4s2"), (8, 2, "16x16w1s1"), (6, 2, "16x16w1s1"), (2, 2, "32x16w1s1")]:
        q = torch.randn(79, hq, 32).half()
        kv = to_kv(torch.randn(2, 512, hkv, 32), kv_storage_dtype(KV_CACHE_DTYPE, torch.float16))
        out = torch.full_like(q, float("nan"))
        paged_prefill_attention(q, kv, plan["table"], plan["ctx_len"], plan["q_len"], plan["q_start"],
                                plan["max_q_len"], out, tile=PrefillTile.parse(tile))
        ref = reference_prefill_attention(q.double(), kv, plan["table"], plan["ctx_len"], plan["q_len"],
                                          plan["q_start"])
        assert torch.isfinite(out[rows]).all(), ("unwritten rows", hq, hkv, tile)
        assert torch.isnan(out[0]).all() and torch.isnan(out[71]).all(), "wrote a row of no sequence"
        err = float((out[rows].double() - ref[rows]).norm() / ref[rows].norm())
        print(hq, hkv, tile, "err", err)
        assert err < 2e-3, (hq, hkv, tile, err)
    """
)


def test_prefill_tile_parses_and_names_bad_shapes() -> None:
    from pdunit.kernels.prefill_attention import PrefillTile

    assert PrefillTile.parse("64x32w4s2") == PrefillTile(64, 32, 4, 2)
    assert str(PrefillTile.parse(" 128x64w8s3")) == "128x64w8s3"
    with pytest.raises(ValueError, match="BLOCK_MxBLOCK_N"):
        PrefillTile.parse("128x64")
    with pytest.raises(ValueError, match="block_n = 48"):
        PrefillTile(128, 48)
    with pytest.raises(ValueError, match="num_warps 3"):
        PrefillTile(num_warps=3)


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_prefill_kernel_matches_the_reference_under_tritons_cpu_interpreter(tmp_path: Path, kv_cache_dtype) -> None:
    """fp16 (the interpreter's bf16 dot is wrong); the reference reads the same pool."""
    script = f"KV_CACHE_DTYPE = {kv_cache_dtype!r}\n" + INTERPRETED_CHECK
    run_interpreted(inspect.getsource(paging_module) + script, tmp_path)


def test_prefill_kernel_refuses_a_pool_of_another_dtype_naming_both(monkeypatch) -> None:
    """Checked before the launch, on CPU tensors let through as under the interpreter
    (the interpreted test above runs an fp8 pool under an fp16 q)."""
    from pdunit.kernels import prefill_attention as pf

    monkeypatch.setattr(pf, "INTERPRET", True)
    plan = prefill_plan([3], [np.arange(3)], [0])
    q = torch.zeros(3, 4, 32, dtype=torch.bfloat16)
    kv = torch.zeros(2, 8, 2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match=re.escape(
        "dtypes q=torch.bfloat16 kv_layer=torch.float16 out=torch.bfloat16: need a bf16/fp16 q, out of q's dtype "
        "and a kv_layer of q's dtype or torch.float8_e4m3fn"
    )):
        pf.paged_prefill_attention(q, kv, plan["table"], plan["ctx_len"], plan["q_len"], plan["q_start"],
                                   plan["max_q_len"], torch.empty_like(q))


@gpu
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (8, 8), (24, 8)])
@pytest.mark.parametrize("tile", ["default", "64x32w4s2"])
def test_prefill_kernel_matches_the_reference_on_fragmented_pages(kv_cache_dtype, dtype, page_size, hq, hkv, tile) -> None:
    from pdunit.kernels.prefill_attention import DEFAULT_TILE, PrefillTile, paged_prefill_attention

    dev = torch.device("cuda")
    # whole prompt, cached prefix + chunk, tiny chunk after a long prefix, 2 new rows
    q_lens, ctx_lens = [300, 129, 3, 2], [300, 1000, 2000, 2]
    ctx, starts, t = packed_case(q_lens, ctx_lens, page_size, 8192, seed=page_size + hq)
    plan = prefill_plan(q_lens, ctx, starts)
    dplan = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in plan.items()}
    kv = to_kv(torch.randn(2, 8192, hkv, 128, device=dev), kv_storage_dtype(kv_cache_dtype, dtype))
    q = torch.randn(t, hq, 128, device=dev).to(dtype)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(
        q, kv, dplan["table"], dplan["ctx_len"], dplan["q_len"], dplan["q_start"],
        dplan["max_q_len"], out, tile=DEFAULT_TILE if tile == "default" else PrefillTile.parse(tile),
    )
    ref = reference_prefill_attention(
        q.double(), kv, dplan["table"], dplan["ctx_len"], dplan["q_len"], dplan["q_start"]
    )
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens, strict=True)]).to(dev)
    assert torch.isfinite(out[rows]).all(), "unwritten rows"
    gaps = torch.tensor([s - 1 for s in starts] + [t - 1], device=dev)
    assert torch.isnan(out[gaps]).all(), "wrote rows that belong to no sequence"
    err = float((out[rows].double() - ref[rows]).norm() / ref[rows].norm())
    assert err < 1e-2, err
