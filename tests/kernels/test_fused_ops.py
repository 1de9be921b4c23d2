"""The fused q/k norm + RoPE + pool-store kernel against the model's torch reference
(RMSNorm, rotate-half RoPE, index_copy_ into the pool), under Triton's CPU interpreter
and on a GPU: head counts that do not fill the kernel's head blocks, negative write slots
(CUDA-graph padding rows) that must write nothing, and an fp8 pool that must get exactly
`kv_dtype.to_kv` of what a model-dtype pool gets."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import torch

from tests.kernels import paging as paging_module
from tests.kernels.paging import gpu, run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from pdunit.engine.model.transformer import RMSNorm, _rope
    from pdunit.kernels.fused_ops import qk_norm_rope_store


    def check(hq, hkv, d, dtype, device, qk_norm=True):
        # qk_norm False: a model without q/k norm (csm's Llama backbone), RoPE + store only
        torch.manual_seed(hq * 100 + hkv)
        t, slots = 7, 32
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=device).to(dtype)
        qn, kn = RMSNorm(d, 1e-6, dtype, device), RMSNorm(d, 1e-6, dtype, device)
        with torch.no_grad():
            qn.weight.uniform_(0.5, 1.5)
            kn.weight.uniform_(0.5, 1.5)
        pos = torch.tensor([0, 3, 9, 1, 20, 5, 7], device=device)
        write = torch.tensor([4, -1, 17, 0, 31, -1, 9], device=device)
        ang = torch.arange(64).double()[:, None] * (1e4 ** (-torch.arange(0, d, 2).double() / d))
        cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
        kv = torch.full((2, slots, hkv, d), 7.0, device=device).to(dtype)
        qw, kw = (qn.weight, kn.weight) if qk_norm else (None, None)
        q = qk_norm_rope_store(qkv, qw, kw, 1e-6, cos, sin, pos, write, kv, hq, hkv, d)
        if not qk_norm:
            qn = kn = lambda x: x

        xq, xk, xv = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
        c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
        want_q = _rope(qn(xq.view(t, hq, d)), c, s)
        want_k = _rope(kn(xk.view(t, hkv, d)), c, s)
        want_kv = torch.full_like(kv, 7.0)
        keep = write >= 0
        want_kv[0].index_copy_(0, write[keep], want_k[keep])
        want_kv[1].index_copy_(0, write[keep], xv.view(t, hkv, d)[keep])
        # equal up to one rounding of the model dtype (same rounding points, fp32 inside)
        tol = dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(q.float(), want_q.float(), **tol)
        torch.testing.assert_close(kv.float(), want_kv.float(), **tol)  # padding rows wrote nothing
        print("ok", hq, hkv, d, dtype, qk_norm)
    """
)

INTERPRETED = CHECK + textwrap.dedent(
    """
    torch.set_num_threads(1)
    for hq, hkv in [(4, 2), (5, 1), (16, 8), (3, 3)]:
        check(hq, hkv, 32, torch.float16, "cpu")
    """
)


FP8_CHECK = textwrap.dedent(
    """
    import torch
    from pdunit.kernels.fused_ops import qk_norm_rope_store
    from pdunit.kernels.kv_dtype import FP8_KV, to_kv


    def check_fp8(dtype, device):
        # The same inputs into a model-dtype pool and an fp8 pool: the fp8 pool must hold
        # exactly to_kv of the other's rows. V (the raw projection) carries every 16-bit
        # pattern of the model dtype but NaN (ties, subnormals, carries into the exponent,
        # values beyond +-448, +-inf); a k norm weight of ~1000 on every 4th dim puts K
        # values beyond +-448 too. Row 64 is a padding row (slot -1).
        hq, hkv, d, t, slots = 1, 8, 128, 65, 80
        torch.manual_seed(0)
        words = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
        qkv[:64, (hq + hkv) * d:] = words.masked_fill(words.isnan(), 0.0).view(64, hkv * d)
        qkv = qkv.to(device)
        qw = (torch.rand(d) + 0.5).to(dtype).to(device)
        kw = torch.rand(d) + 0.5
        kw[::4] *= 1000
        kw = kw.to(dtype).to(device)
        pos = torch.arange(t, device=device) % 64
        write = torch.randperm(slots)[:t].to(device)
        write[64] = -1
        ang = torch.arange(64).double()[:, None] * (1e4 ** (-torch.arange(0, d, 2).double() / d))
        cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
        kv = torch.full((2, slots, hkv, d), 7.0, device=device).to(dtype)
        kv8 = to_kv(kv, FP8_KV)
        q = qk_norm_rope_store(qkv, qw, kw, 1e-6, cos, sin, pos, write, kv, hq, hkv, d)
        q8 = qk_norm_rope_store(qkv, qw, kw, 1e-6, cos, sin, pos, write, kv8, hq, hkv, d)
        assert torch.equal(q8, q), "the returned q depends on the pool's dtype"
        assert kv[0].float().abs().max() > 448 and kv[1].float().abs().max() > 448, "nothing saturated"
        want = to_kv(kv, FP8_KV)
        bad = kv8.view(torch.uint8) != want.view(torch.uint8)
        assert not bad.any(), (int(bad.sum()), kv[bad][:8].tolist(), kv8[bad][:8].float().tolist())
        print("ok fp8", dtype)
    """
)


def test_qk_norm_rope_store_into_an_fp8_pool_stores_to_kv_of_the_rows_interpreted(tmp_path: Path) -> None:
    script = FP8_CHECK + textwrap.dedent(
        """
        torch.set_num_threads(1)
        for dtype in (torch.float16, torch.bfloat16):
            check_fp8(dtype, "cpu")
        """
    )
    out = run_interpreted(script, tmp_path)
    assert out.count("ok fp8") == 2, out


@gpu
def test_qk_norm_rope_store_into_an_fp8_pool_stores_to_kv_of_the_rows_on_gpu() -> None:
    scope: dict = {}
    exec(FP8_CHECK, scope)  # noqa: S102 - the interpreted test's check, in-process
    for dtype in (torch.bfloat16, torch.float16):
        scope["check_fp8"](dtype, "cuda")


def test_qk_norm_rope_store_matches_the_reference_under_tritons_cpu_interpreter(tmp_path: Path) -> None:
    out = run_interpreted(inspect.getsource(paging_module) + INTERPRETED, tmp_path)
    assert out.count("ok") == 4, out


def test_rope_store_without_qk_norm_matches_the_reference_under_tritons_cpu_interpreter(tmp_path: Path) -> None:
    """A model without q/k norm (csm): the same kernel with its norm compiled out ropes
    the raw projections (no norm applied, the weights never read) and stores as before."""
    script = CHECK + textwrap.dedent(
        """
        torch.set_num_threads(1)
        for hq, hkv, dtype in [(4, 2, torch.float16), (5, 1, torch.bfloat16), (3, 3, torch.float16)]:
            check(hq, hkv, 16, dtype, "cpu", qk_norm=False)
        """
    )
    out = run_interpreted(script, tmp_path)
    assert out.count("ok") == 3 and out.count("False") == 3, out


@gpu
def test_qk_norm_rope_store_matches_the_reference_on_gpu() -> None:
    scope: dict = {}
    exec(CHECK, scope)  # noqa: S102 - the same check as the interpreted test, in-process
    for hq, hkv in [(32, 8), (5, 1), (16, 8)]:
        for dtype in (torch.bfloat16, torch.float16):
            scope["check"](hq, hkv, 128, dtype, "cuda")
            scope["check"](hq, hkv, 64, dtype, "cuda", qk_norm=False)


def test_input_checks_format_their_message_only_when_they_fail():
    import pytest

    from pdunit.kernels.fused_ops import _need, _on_device, rms_norm

    _need(True, lambda: str(1 / 0))  # a passing check never builds its message
    with pytest.raises(ValueError, match="^x is wrong$"):
        _need(False, lambda: "x is wrong")
    with pytest.raises(ValueError, match="fused op input on cpu: every input must be on one CUDA device"):
        _on_device(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="fused op input on cpu"):
        rms_norm(torch.zeros(2, 4), torch.ones(4), 1e-6)


def test_qk_norm_rope_store_takes_both_norm_weights_or_neither():
    import pytest

    from pdunit.kernels.fused_ops import qk_norm_rope_store

    z = torch.zeros(1, 48)
    with pytest.raises(ValueError, match="give both q/k norm weights or neither"):
        qk_norm_rope_store(z, torch.ones(16), None, 1e-6, z, z, z, z, z, 1, 1, 16)
