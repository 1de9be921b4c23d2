"""FP8 GEMMs of prefill forwards (kernels/fp8_gemm.py): the quantisers' scales and error
bounds, the CPU reference product against an exact one, and on a GPU the Triton row
quantiser and torch._scaled_mm against that reference.

The row quantiser is not checked against torch under Triton's CPU interpreter: its
float32 -> e4m3 conversion drops the carry into the exponent (124.3 at a scale of 1
becomes 64, not 128), so it cannot stand in for the GPU's round-to-nearest-even. The
fused producers (norms, SwiGLU) are checked against it there, conversion for
conversion, and on the GPU."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from pdunit.kernels.fp8_gemm import (
    FP8_MAX,
    MIN_AMAX,
    Fp8Weight,
    fp8_linear,
    fp8_unsupported,
    quantize_rows,
    quantize_rows_reference,
)
from tests.kernels.paging import gpu, run_interpreted

# e4m3 keeps 3 mantissa bits: a normal value rounds within 1/16 of itself; below the
# smallest normal (2^-6 of the scale unit) the spacing is 2^-9 of it.
REL, SUB = 1 / 16, 2.0**-10


def _within_one_rounding(deq: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> None:
    bound = torch.maximum(REL * exact.abs(), SUB * scale)
    worst = ((deq - exact).abs() - bound).max()
    assert worst <= 1e-12, float(worst)


def test_a_weight_quantises_per_output_channel_within_one_rounding():
    torch.manual_seed(0)
    # rows of very different magnitudes: one shared scale would flush the small rows
    w = torch.randn(6, 40) * torch.tensor([1e-3, 1.0, 50.0, 1e-6, 3.0, 0.2])[:, None]
    fw = Fp8Weight.quantize(w)
    assert fw.q.dtype == torch.float8_e4m3fn and fw.scale.shape == (6,)
    assert torch.equal(fw.q.float().abs().amax(dim=1), torch.full((6,), FP8_MAX))
    _within_one_rounding(fw.dequantize(), w, fw.scale[:, None])
    # the rows of a fused matrix are the matrices quantised alone
    part = Fp8Weight.quantize(w[2:5])
    assert torch.equal(fw.rows(2, 5).q.float(), part.q.float()) and torch.equal(fw.rows(2, 5).scale, part.scale)


def test_rows_quantise_each_to_its_own_largest_magnitude_and_a_zero_row_stays_zero():
    torch.manual_seed(1)
    x = torch.randn(4, 33, dtype=torch.float64) * torch.tensor([1.0, 1e4, 1e-5, 0.0], dtype=torch.float64)[:, None]
    q, s = quantize_rows(x)  # CPU: the reference
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 1) and s.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1)[:3], torch.full((3,), FP8_MAX))
    assert torch.equal(q[3].float(), torch.zeros(33)) and float(s[3]) == pytest.approx(MIN_AMAX / FP8_MAX)
    _within_one_rounding(q.double() * s.double(), x, s.double())
    with pytest.raises(ValueError, match="row-major"):
        quantize_rows(x.t())


def test_the_reference_product_is_close_to_the_exact_one():
    torch.manual_seed(2)
    x = torch.randn(9, 256)
    w = torch.randn(48, 256) * torch.linspace(0.01, 5, 48)[:, None]
    exact = x @ w.t()
    got = fp8_linear(x, Fp8Weight.quantize(w))
    assert got.shape == (9, 48) and got.dtype == x.dtype
    # each product term carries two e4m3 roundings (~3% each, independent signs)
    rel = (got - exact).norm() / exact.norm()
    assert 0 < rel < 0.05, float(rel)
    # column n is scaled by weight row n's scale, row m by x row m's: a transposed
    # scale would break the columns of small weights
    col_rel = (got - exact).norm(dim=0) / exact.norm(dim=0)
    assert col_rel.max() < 0.1, col_rel


def test_fp8_is_refused_where_the_gpu_or_the_shape_cannot(monkeypatch):
    assert fp8_unsupported(torch.device("cpu"), {"hidden": 7}) is None  # the reference takes anything
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    assert "8.9+ needed" in fp8_unsupported(torch.device("cuda:0"), {"hidden": 128})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    why = fp8_unsupported(torch.device("cuda:0"), {"hidden": 128, "ffn_hidden": 200})
    assert "multiples of 16" in why and "ffn_hidden" in why and "'hidden'" not in why
    assert fp8_unsupported(torch.device("cuda:0"), {"hidden": 128}) is None


@gpu
def test_the_triton_row_quantiser_matches_the_reference_on_gpu():
    torch.manual_seed(3)
    for k in (128, 2560, 9728):  # one block, and the widths of the 4B shape's GEMM inputs
        x = (torch.randn(300, k, device="cuda") * torch.rand(300, 1, device="cuda") * 20).to(torch.bfloat16)
        x[7] = 0
        q, s = quantize_rows(x)
        qr, sr = quantize_rows_reference(x)
        torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
        # the same rounding; a division rounded differently may move a value by one step
        diff = (q.float() - qr.float()).abs()
        assert (diff > 0).float().mean() < 1e-3
        assert (diff <= REL * 2 * qr.float().abs() + 2.0**-9).all()


@gpu
def test_scaled_mm_matches_the_reference_arithmetic_on_gpu():
    torch.manual_seed(4)
    x = torch.randn(1000, 2560, device="cuda").to(torch.bfloat16)
    w = Fp8Weight.quantize((torch.randn(6144, 2560, device="cuda") * 0.02).to(torch.bfloat16))
    got = fp8_linear(x, w)
    xq, sx = quantize_rows(x)
    want = (xq.float() * sx) @ w.dequantize().t()
    assert got.dtype == torch.bfloat16 and got.shape == (1000, 6144)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    exact = x.float() @ w.dequantize().t()
    assert ((got.float() - exact).norm() / exact.norm()) < 0.05


FUSED_CHECK = textwrap.dedent(
    """
    import torch
    from pdunit.kernels.fp8_gemm import quantize_rows
    from pdunit.kernels.fused_ops import add_rms_norm, rms_norm, silu_mul


    def same(got, want, what):
        assert torch.equal(got.q.float(), want.q.float()), what
        assert torch.equal(got.scale, want.scale), what


    def check(n, f, dtype, device):
        torch.manual_seed(n)
        x = (torch.randn(9, n, device=device) * 3).to(dtype)
        d = torch.randn(9, n, device=device).to(dtype)
        w = torch.rand(n, device=device).to(dtype) + 0.5
        gu = (torch.randn(9, 2 * f, device=device) * 2).to(dtype)
        x[4] = 0  # a zero row: the smallest scale, all zeros
        gu[4] = 0
        # each fused output quantises what the unfused kernel stores
        same(rms_norm(x, w, 1e-6, quant=True), quantize_rows(rms_norm(x, w, 1e-6)), "rms_norm")
        r8, y8 = add_rms_norm(x, d, w, 1e-6, quant=True)
        r, y = add_rms_norm(x, d, w, 1e-6)
        assert torch.equal(r8, r)
        same(y8, quantize_rows(y), "add_rms_norm")
        same(silu_mul(gu, quant=True), quantize_rows(silu_mul(gu)), "silu_mul")
        print("ok", n, f, dtype)
    """
)


def test_fused_quantising_outputs_equal_the_quantiser_on_the_stored_rows_interpreted(tmp_path: Path) -> None:
    script = FUSED_CHECK + "\ntorch.set_num_threads(1)\nfor n, f in [(64, 96), (100, 1500)]:\n" \
        "    check(n, f, torch.float16, 'cpu')\n"
    out = run_interpreted(script, tmp_path)
    assert out.count("ok") == 2, out


@gpu
def test_fused_quantising_outputs_equal_the_quantiser_on_the_stored_rows_on_gpu() -> None:
    scope: dict = {}
    exec(FUSED_CHECK, scope)  # noqa: S102 - the interpreted test's check, in-process
    for n, f in [(2560, 9728), (128, 256), (100, 1500)]:
        scope["check"](n, f, torch.bfloat16, "cuda")
