"""Paged decode attention: the slot table, the split heuristic, the torch reference
against the model's reference attention (CPU), and the Triton kernel against the
reference on fresh random inputs with fragmented tables, from a pool of the model's
dtype or fp8 e4m3 (GPU; CPU via Triton's interpreter)."""

from __future__ import annotations

import inspect
import math
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdunit.engine.model.transformer import ForwardBatch, _paged_attention, _plan
from pdunit.kernels.kv_dtype import FP8_KV, kv_storage_dtype, to_kv
from pdunit.kernels.kv_dtype_names import KV_CACHE_DTYPES
from pdunit.kernels.paged_attention import (
    DECODE_CANDIDATES,
    DECODE_CONFIG,
    MAX_SPLITS,
    build_slot_table,
    choose_splits,
    reference_decode_attention,
)
from tests.kernels import paging as paging_module
from tests.kernels.paging import gpu, paged_slots, run_interpreted

# ------------------------------------------------------------------ slot tables (CPU)


def test_slot_table_pads_each_sequence_to_the_longest_and_records_lengths() -> None:
    ctx = [np.array([7, 3, 9]), torch.tensor([5], dtype=torch.int64), np.array([1, 2, 4, 8, 6])]
    table, lengths = build_slot_table(ctx, align=1)
    assert table.dtype == torch.int32 and lengths.dtype == torch.int32
    assert table.tolist() == [[7, 3, 9, 0, 0], [5, 0, 0, 0, 0], [1, 2, 4, 8, 6]]
    assert lengths.tolist() == [3, 1, 5]


def test_slot_table_width_is_a_multiple_of_16_by_default() -> None:
    """The width is the kernels' row stride: Triton compiles a kernel again for an integer
    argument whose divisibility by 16 is new, so eager forwards keep to one class."""
    for longest, width in ((1, 16), (5, 16), (16, 16), (17, 32), (1025, 1040)):
        table, lengths = build_slot_table([np.arange(longest), np.arange(1)])
        assert table.shape == (2, width) and lengths.tolist() == [longest, 1]
        assert not table[0, longest:].any() and not table[1, 1:].any()  # padding: slot 0, never read


def test_slot_table_fills_a_given_staging_buffer_and_clears_stale_entries() -> None:
    stage = np.full(64, 99, dtype=np.int32)
    table, lengths = build_slot_table([np.array([4, 5]), np.array([6])], width=3, out=stage)
    assert table.tolist() == [[4, 5, 0], [6, 0, 0]]
    assert stage[:6].tolist() == [4, 5, 0, 6, 0, 0]
    assert lengths.tolist() == [2, 1]


@pytest.mark.parametrize(
    ("ctx", "width", "message"),
    [
        ([np.arange(5)], 4, "sequence 0: 5 context slots exceed the table width 4"),
        ([np.arange(3), np.array([], dtype=np.int64)], None, "sequence 1: context slots must be a non-empty"),
        ([np.array([1, -2])], None, "sequence 0: context slots must lie in [0, 2**31)"),
        ([np.array([2**31])], None, "sequence 0: context slots must lie in [0, 2**31)"),
    ],
)
def test_slot_table_rejects_bad_contexts_naming_the_sequence(ctx, width, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_slot_table(ctx, width=width)


def test_fragmented_pages_give_distinct_slots_contiguous_only_inside_a_page() -> None:
    rng = np.random.default_rng(0)
    seqs = paged_slots([37, 16, 5], 16, 512, rng)
    every = np.concatenate(seqs)
    assert len(set(every.tolist())) == every.size
    for s in seqs:
        pages = s // 16
        assert all((s[i + 1] - s[i] == 1) == (pages[i + 1] == pages[i]) for i in range(len(s) - 1))


def test_splits_fill_the_gpu_for_small_batches_and_vanish_for_large_ones() -> None:
    assert choose_splits(1, 8, 132, 8192) == MAX_SPLITS
    assert choose_splits(1, 8, 132, 100) == 2  # never more splits than 64-token tiles
    assert choose_splits(64, 8, 132, 8192) == math.ceil(4 * 132 / 512)
    assert choose_splits(256, 8, 132, 8192) == 1


def test_reference_decode_attention_equals_the_models_reference_attention() -> None:
    """The kernel's reference computes what transformer._paged_attention computes for
    decode rows (float64: only summation order differs)."""
    rng = np.random.default_rng(1)
    hq, hkv, d, n_slots = 8, 2, 32, 300
    lengths = [1, 19, 64, 65]
    ctx = paged_slots(lengths, 4, n_slots, rng)
    kv = torch.randn(2, n_slots, hkv, d, dtype=torch.float64)
    q = torch.randn(len(lengths), hq, d, dtype=torch.float64)
    batch = ForwardBatch.from_sequences([np.zeros((1, 11), np.int64)] * len(ctx), ctx)
    want = _paged_attention(q, kv, _plan(batch, torch.device("cpu")))
    table, lens = build_slot_table(ctx)
    got = reference_decode_attention(q, kv, table, lens)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ the kernel

INTERPRETED_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    torch.set_num_threads(1)
    from pdunit.kernels.decode_settings import checked
    from pdunit.kernels.kv_dtype import kv_storage_dtype, to_kv
    from pdunit.kernels.paged_attention import (
        DECODE_CONFIG, build_slot_table, paged_decode_attention, reference_decode_attention)
    DECODE_CONFIG["kv_as_a"] = KV_AS_A
    DECODE_CONFIG["fp8_dots"] = 0  # exact widening, whatever the default (the fp8 dots: the candidates test)
    DECODE_CONFIG.update(checked(SETTINGS))
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    worst = 0.0
    for page, splits, (hq, hkv) in [(1, 1, (4, 2)), (16, 3, (8, 2)), (4, 2, (4, 4))]:
        lengths = [1, 70, 33]
        ctx = paged_slots(lengths, page, 512, rng)
        kv = to_kv(torch.randn(2, 512, hkv, 32), kv_storage_dtype(KV_CACHE_DTYPE, torch.float16))
        q = torch.randn(3, hq, 32).half()
        table, lens = build_slot_table(ctx, width=130)
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, kv, table, lens, splits, out=out)
        ref = reference_decode_attention(q.double(), kv, table, lens)
        assert torch.isfinite(out).all(), "unwritten output rows"
        worst = max(worst, float((out.double() - ref).norm() / ref.norm()))
    # a negative scale (the lazy softmax applies the scale in the exponent: it needs one > 0)
    out = paged_decode_attention(q, kv, table, lens, 2, scale=-0.2)
    ref = reference_decode_attention(q.double(), kv, table, lens, scale=-0.2)
    worst = max(worst, float((out.double() - ref).norm() / ref.norm()))
    print("worst", worst)
    assert worst < 2e-3, worst
    """
)


@pytest.mark.parametrize("kv_as_a", [0, 1])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_decode_kernel_matches_the_reference_under_tritons_cpu_interpreter(
    tmp_path: Path, kv_cache_dtype, kv_as_a
) -> None:
    """The same kernel source, run by Triton's interpreter on CPU tensors (fp16: the
    interpreter's bf16 dot is wrong), the reference on the same pool (fp8: widened),
    in both operand orders (DECODE_CONFIG's kv_as_a). Runs from tmp_path: the repo
    root would shadow the stdlib `operator` module with the operator/ folder."""
    script = f"KV_CACHE_DTYPE = {kv_cache_dtype!r}\nKV_AS_A = {kv_as_a}\nSETTINGS = {{}}\n" + INTERPRETED_CHECK
    run_interpreted(inspect.getsource(paging_module) + script, tmp_path)


# The fp8 pools' settings (kernels/decode_settings.py), each alone and all together.
FP8_SETTINGS = [{"kv_words": 1}, {"block_g": 8}, {"lazy_softmax": 1}, {"kv_words": 1, "block_g": 8, "lazy_softmax": 1}]


def _settings_id(settings: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in settings.items())


@pytest.mark.parametrize("kv_as_a", [0, 1])
@pytest.mark.parametrize("settings", FP8_SETTINGS, ids=_settings_id)
def test_each_fp8_pool_setting_matches_the_reference_under_tritons_cpu_interpreter(
    tmp_path: Path, settings, kv_as_a
) -> None:
    """K and V widened from 32-bit words (the portable widening: the interpreter runs no
    PTX), 8 query rows per dot, the lazy softmax: each against the reference on an fp8
    pool, exact widening (fp8_dots 0), both operand orders, 1..3 splits, a negative scale."""
    script = f"KV_CACHE_DTYPE = 'fp8_e4m3'\nKV_AS_A = {kv_as_a}\nSETTINGS = {settings!r}\n" + INTERPRETED_CHECK
    run_interpreted(inspect.getsource(paging_module) + script, tmp_path)


FP8_SETTINGS_AGAINST_THE_DEFAULT = textwrap.dedent(
    """
    import numpy as np, torch
    torch.set_num_threads(1)
    from pdunit.kernels.decode_settings import DECODE_DEFAULT, checked
    from pdunit.kernels.kv_dtype import FP8_KV, to_kv
    from pdunit.kernels.paged_attention import DECODE_CONFIG, build_slot_table, paged_decode_attention
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    ctx = paged_slots([1, 70, 33, 129], 4, 1024, rng)
    table, lens = build_slot_table(ctx)
    q = torch.randn(4, 8, 32).half()
    kv16 = torch.randn(2, 1024, 2, 32).half()


    def launch(kv, kv_as_a, fp8_dots, settings):
        DECODE_CONFIG.clear()
        DECODE_CONFIG.update({**DECODE_DEFAULT, "kv_as_a": kv_as_a, "fp8_dots": fp8_dots, **checked(settings)})
        return paged_decode_attention(q, kv, table, lens, 2)


    for kv_as_a in (0, 1):
        # a model-dtype pool ignores them: the same kernel, the same bits
        assert torch.equal(launch(kv16, kv_as_a, 1, SETTINGS), launch(kv16, kv_as_a, 1, {}))
        # with the fp8 dots (the interpreter's e4m3 dots are its own: compared with themselves)
        base = launch(to_kv(kv16, FP8_KV), kv_as_a, 1, {}).double()
        got = launch(to_kv(kv16, FP8_KV), kv_as_a, 1, SETTINGS).double()
        err = float((got - base).norm() / base.norm())
        print(kv_as_a, "against the default", err)
        assert err < 1e-3, err
    """
)


def test_the_fp8_pool_settings_keep_the_fp8_dots_results_and_leave_model_dtype_pools_alone(tmp_path: Path) -> None:
    script = f"SETTINGS = {FP8_SETTINGS[-1]!r}\n" + FP8_SETTINGS_AGAINST_THE_DEFAULT
    out = run_interpreted(inspect.getsource(paging_module) + script, tmp_path)
    assert "against the default" in out, out


# A pool rounded to e4m3 against the model-dtype pool it came from, on the same queries.
# A one-token context returns its V row (softmax weight exactly 1), so there the output
# differs by exactly that row's rounding: nearest with 3 mantissa bits is within 2**-4 of
# the value (relative), or 2**-10 (half the 2**-9 subnormal step) below 2**-6. Longer
# contexts mix many rows through perturbed scores: no such element bound holds, but the
# elements' errors are independent, about 2**-4 / sqrt(3) RMS, and the outputs' relative
# error stays near that (0.02..0.03 on these inputs), so the whole batch must stay within
# 2**-4; a misread byte is off by O(1).
FP8_VS_MODEL_DTYPE_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from pdunit.kernels.kv_dtype import FP8_KV, to_kv
    from pdunit.kernels.paged_attention import DECODE_CONFIG, build_slot_table, paged_decode_attention


    def check_fp8_pool(dtype, device, hq, hkv, d, page, splits):
        # the exact widening: fp8_dots 0, set by the caller (the fp8 dots: the candidates test)
        assert DECODE_CONFIG["fp8_dots"] == 0
        rng = np.random.default_rng(page * 100 + hq)
        torch.manual_seed(page * 100 + hq)
        lengths = [1, 2, 70, 300]
        ctx = paged_slots(lengths, page, 1024, rng)
        table, lens = (x.to(device) for x in build_slot_table(ctx))
        kv = torch.randn(2, 1024, hkv, d, device=device).to(dtype)
        kv8 = to_kv(kv, FP8_KV)
        q = torch.randn(len(lengths), hq, d, device=device).to(dtype)
        out = paged_decode_attention(q, kv, table, lens, splits).double()
        out8 = paged_decode_attention(q, kv8, table, lens, splits)
        # widening is exact: an fp8 pool computes what an fp16 pool of its values does (its
        # dots take fp16 operands whatever the model dtype; a bf16 query widens exactly).
        # Bit for bit interpreted; on a GPU the two compiled kernels may sum the dots in
        # another order (seen <= 1.6e-5 on outputs of ~0.1..1), and a bf16 output rounds
        # the fp16 one again. A bf16 pool is not the comparison: its dots round the
        # probabilities to bf16 (~1e-3 apart, seen on the H200s)
        wide = paged_decode_attention(q.to(torch.float16), kv8.to(torch.float16), table, lens, splits).to(dtype)
        torch.testing.assert_close(out8, wide, rtol=2 * torch.finfo(dtype).eps, atol=2**-12)
        out8 = out8.double()
        bound = torch.clamp(out[0].abs() * 2**-4, min=2**-10)
        assert ((out8[0] - out[0]).abs() <= bound).all(), (out8[0] - out[0]).abs().max()
        err = float((out8 - out).norm() / out.norm())
        print("fp8 vs", dtype, "relative error", err)
        assert err < 2**-4, err
    """
)


def test_fp8_pool_decode_stays_within_e4m3_rounding_of_the_model_dtype_pool_interpreted(tmp_path: Path) -> None:
    script = FP8_VS_MODEL_DTYPE_CHECK + textwrap.dedent(
        """
        torch.set_num_threads(1)
        DECODE_CONFIG["fp8_dots"] = 0
        check_fp8_pool(torch.float16, "cpu", 8, 2, 32, 16, 3)
        """
    )
    out = run_interpreted(inspect.getsource(paging_module) + script, tmp_path)
    assert "relative error" in out, out


@gpu
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 8, 128), (16, 16, 64), (8, 1, 128)])
def test_decode_kernel_matches_the_reference_on_fragmented_pages(kv_cache_dtype, dtype, page_size, hq, hkv, d) -> None:
    from pdunit.kernels.paged_attention import paged_decode_attention

    rng = np.random.default_rng(page_size * 1000 + hq)
    dev = torch.device("cuda")
    n_slots = 8192
    lengths = [1, 2, 63, 64, 65, 700, 2049, 17]
    ctx = paged_slots(lengths, page_size, n_slots, rng)
    kv = to_kv(torch.randn(2, n_slots, hkv, d, device=dev), kv_storage_dtype(kv_cache_dtype, dtype))
    table, lens = build_slot_table(ctx, width=2100)
    table, lens = table.to(dev), lens.to(dev)
    ref = None
    for splits in (1, 3, MAX_SPLITS):
        q = torch.randn(len(lengths), hq, d, device=dev).to(dtype)
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, kv, table, lens, splits, out=out)
        # with the fp8 dots on (an fp8 pool), the kernel attends with the quantised query
        dots = kv.dtype == FP8_KV and DECODE_CONFIG["fp8_dots"]  # the live settings: the default here
        ref = reference_decode_attention((quantised_query(q) if dots else q).double(), kv, table, lens)
        assert torch.isfinite(out).all(), f"unwritten rows with {splits} splits"
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < 1e-2, f"{splits} splits: relative error {err}"


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "d", "page", "splits"), [(32, 8, 128, 16, 4), (8, 1, 128, 1, 1), (16, 16, 64, 4, 3)])
def test_fp8_pool_decode_stays_within_e4m3_rounding_of_the_model_dtype_pool_on_gpu(dtype, hq, hkv, d, page, splits) -> None:
    from pdunit.kernels import paged_attention as pa

    scope: dict = {"paged_slots": paged_slots}
    exec(FP8_VS_MODEL_DTYPE_CHECK, scope)  # noqa: S102 - the interpreted test's check, in-process
    saved = dict(pa.DECODE_CONFIG)
    pa.DECODE_CONFIG["fp8_dots"] = 0
    try:
        scope["check_fp8_pool"](dtype, "cuda", hq, hkv, d, page, splits)
    finally:
        pa.DECODE_CONFIG.clear()
        pa.DECODE_CONFIG.update(saved)


# Each setting in the fp8 pools' operand order (kv_as_a 1), all of them in the other too.
GPU_FP8_CASES = [(settings, 1) for settings in FP8_SETTINGS] + [
    ({"kv_words": 1, "block_g": 8, "lazy_softmax": 1, "block_n": 128}, 1), (FP8_SETTINGS[-1], 0)]


@gpu
@pytest.mark.parametrize("fp8_dots", [0, 1])
@pytest.mark.parametrize(("settings", "kv_as_a"), GPU_FP8_CASES,
                         ids=[f"{_settings_id(s)}-kv_as_a={a}" for s, a in GPU_FP8_CASES])
def test_each_fp8_pool_setting_computes_what_the_default_kernel_computes_on_gpu(settings, kv_as_a, fp8_dots) -> None:
    """On the GPU the words are widened by cvt.rn.f16x2.e4m3x2 (sm_89+): a value misplaced
    in a tile would be off by O(1); the same widened values and dots leave the outputs
    within a rounding of the output dtype (the lazy softmax rounds its exponent once)."""
    from pdunit.kernels import paged_attention as pa

    saved = dict(pa.DECODE_CONFIG)
    dev = torch.device("cuda")
    rng = np.random.default_rng(11)
    ctx = paged_slots([1, 2, 63, 64, 65, 700, 2049, 17], 16, 8192, rng)
    table, lens = (t.to(dev) for t in build_slot_table(ctx))
    kv = to_kv(torch.randn(2, 8192, 8, 128, device=dev), FP8_KV)
    dtype = torch.bfloat16
    q = torch.randn(len(ctx), 32, 128, device=dev).to(dtype)
    try:
        for splits in (1, 3):
            pa.configure_decode(f"kv_as_a={kv_as_a},fp8_dots={fp8_dots}")
            base = pa.paged_decode_attention(q, kv, table, lens, splits)
            pa.DECODE_CONFIG.update(settings)
            got = pa.paged_decode_attention(q, kv, table, lens, splits)
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(got, base, rtol=2 * eps, atol=2**-10)
            ref = reference_decode_attention((quantised_query(q) if fp8_dots else q).double(), kv, table, lens)
            assert float((got.double() - ref).norm() / ref.norm()) < 1e-2
    finally:
        pa.DECODE_CONFIG.clear()
        pa.DECODE_CONFIG.update(saved)


@gpu
def test_decode_kernel_reads_only_the_first_length_slots_of_each_row() -> None:
    """Slots past a row's length hold poison (inf) in the pool: it must not leak in."""
    from pdunit.kernels.paged_attention import paged_decode_attention

    dev = torch.device("cuda")
    kv = torch.randn(2, 1024, 8, 128, device=dev).bfloat16()
    kv[:, 1000:] = float("inf")
    rng = np.random.default_rng(3)
    ctx = [rng.permutation(1000)[:n] for n in (5, 300)]
    table, lens = build_slot_table(ctx, width=512)
    table[:, 300:] = 1000  # beyond every length: poison slots
    table[0, 5:] = 1001
    q = torch.randn(2, 32, 128, device=dev).bfloat16()
    out = paged_decode_attention(q, kv, table.to(dev), lens.to(dev), 4)
    assert torch.isfinite(out).all()
    ref = reference_decode_attention(q.double(), kv.double(), table.to(dev), lens.to(dev))
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


@gpu
def test_decode_kernel_rejects_a_float32_pool_naming_the_fix() -> None:
    from pdunit.kernels.paged_attention import paged_decode_attention

    dev = torch.device("cuda")
    kv = torch.randn(2, 16, 2, 64, device=dev)
    q = torch.randn(1, 4, 64, device=dev)
    table, lens = build_slot_table([np.arange(3)])
    with pytest.raises(ValueError, match="bf16 or fp16"):
        paged_decode_attention(q, kv, table.to(dev), lens.to(dev), 1)


def test_decode_kernel_accepts_an_fp8_pool_and_names_both_dtypes_otherwise(monkeypatch) -> None:
    """The launch checks, on CPU tensors (let through as under the interpreter): an fp8
    pool under a bf16 q passes; an fp16 one is refused naming both dtypes and what is
    accepted."""
    from pdunit.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "INTERPRET", True)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    table, lens = build_slot_table([np.arange(3)])
    pa._check(q, torch.zeros(2, 16, 2, 64, dtype=torch.float8_e4m3fn), table, lens)
    with pytest.raises(ValueError, match=re.escape(
        "dtypes q=torch.bfloat16 kv_layer=torch.float16: the kernel takes a bf16 or fp16 q and a kv_layer "
        "of q's dtype or torch.float8_e4m3fn"
    )):
        pa._check(q, torch.zeros(2, 16, 2, 64, dtype=torch.float16), table, lens)


def test_sdpa_reference_and_kernel_reference_agree_on_gqa_grouping() -> None:
    """Query head h reads kv head h // group in both references (a mix-up between
    repeat_interleave and repeat would pass every other CPU test)."""
    torch.manual_seed(0)
    q = torch.randn(1, 8, 16, dtype=torch.float64)
    kv = torch.randn(2, 10, 2, 16, dtype=torch.float64)
    table, lens = build_slot_table([np.arange(10)])
    got = reference_decode_attention(q, kv, table, lens)
    k = kv[0].transpose(0, 1)[None]  # [1, Hkv, L, D]
    v = kv[1].transpose(0, 1)[None]
    want = F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(got, want)


def quantised_query(q: torch.Tensor) -> torch.Tensor:
    """q as the fp8-dots kernel sees it: each head row scaled by its largest |value| / 448
    into e4m3 and back (float32)."""
    q32 = q.float()
    amax = q32.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (q32 / scale).to(FP8_KV).float() * scale


def test_the_quantised_query_keeps_each_rows_largest_value_and_zero_rows():
    q = torch.tensor([[[1.0, -3.0, 0.5, 0.013]], [[0.0, 0.0, 0.0, 0.0]]])
    got = quantised_query(q)
    assert got[0, 0, 1] == -3.0  # the row's largest |value| maps to 448: exact
    rel = ((got[0, 0] - q[0, 0]).abs() / q[0, 0].abs())
    assert bool((rel <= 1 / 16).all()) and float(rel.max()) > 0  # e4m3 rounding: 3 mantissa bits
    assert torch.equal(got[1], q[1])  # an all-zero row stays zero (scale 1, no division by 0)


@gpu
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("candidate", range(len(DECODE_CANDIDATES)))
def test_every_tunable_launch_configuration_computes_the_same_attention(candidate, kv_cache_dtype) -> None:
    """`pdunit bench step --tune` may apply any of these, to either pool: each must be
    correct. On an fp8 pool a candidate with fp8 dots computes with a query quantised
    per head row: checked against the reference on `quantised_query`, to the same 1e-2."""
    from pdunit.kernels import paged_attention as pa

    saved = dict(pa.DECODE_CONFIG)
    pa.DECODE_CONFIG.update(pa.DECODE_CANDIDATES[candidate])
    try:
        dev = torch.device("cuda")
        rng = np.random.default_rng(candidate)
        lengths = [1, 130, 2048, 77, 1000, 64]
        ctx = paged_slots(lengths, 16, 16384, rng)
        kv = to_kv(torch.randn(2, 16384, 8, 128, device=dev), kv_storage_dtype(kv_cache_dtype, torch.bfloat16))
        table, lens = build_slot_table(ctx)
        table, lens = table.to(dev), lens.to(dev)
        q = torch.randn(len(lengths), 32, 128, device=dev).bfloat16()
        splits = pa.choose_splits(len(lengths), 8, 132, 2048)
        out = torch.full_like(q, float("nan"))
        pa.paged_decode_attention(q, kv, table, lens, splits, out=out)
        fp8_dots = pa.DECODE_CONFIG["fp8_dots"] if kv.dtype == FP8_KV else 0
        ref = reference_decode_attention((quantised_query(q) if fp8_dots else q).double(), kv.double(), table, lens)
        assert torch.isfinite(out).all()
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    finally:
        pa.DECODE_CONFIG.clear()
        pa.DECODE_CONFIG.update(saved)
