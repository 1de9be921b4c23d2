"""The fused q/k norm + RoPE + pool-store kernel against the model's torch reference
(RMSNorm, rotate-half RoPE, index_copy_ into the pool), under Triton's CPU interpreter
and on a GPU: head counts that do not fill the kernel's head blocks, and negative write
slots (CUDA-graph padding rows) that must write nothing."""

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


    def check(hq, hkv, d, dtype, device):
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
        q = qk_norm_rope_store(qkv, qn.weight, kn.weight, 1e-6, cos, sin, pos, write, kv, hq, hkv, d)

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
        print("ok", hq, hkv, d, dtype)
    """
)

INTERPRETED = CHECK + textwrap.dedent(
    """
    torch.set_num_threads(1)
    for hq, hkv in [(4, 2), (5, 1), (16, 8), (3, 3)]:
        check(hq, hkv, 32, torch.float16, "cpu")
    """
)


def test_qk_norm_rope_store_matches_the_reference_under_tritons_cpu_interpreter(tmp_path: Path) -> None:
    out = run_interpreted(inspect.getsource(paging_module) + INTERPRETED, tmp_path)
    assert out.count("ok") == 4, out


@gpu
def test_qk_norm_rope_store_matches_the_reference_on_gpu() -> None:
    scope: dict = {}
    exec(CHECK, scope)  # noqa: S102 - the same check as the interpreted test, in-process
    for hq, hkv in [(32, 8), (5, 1), (16, 8)]:
        for dtype in (torch.bfloat16, torch.float16):
            scope["check"](hq, hkv, 128, dtype, "cuda")


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
