"""Triton compiles in an engine process (engine/kernel_compiles.py): counted by phase,
timed, and a serving compile logged with its kernel's name; the hooks chain any hook
installed before them. CPU tests drive Triton's real hook slots (no compile runs on a
CPU); the GPU test compiles a fresh kernel while "serving"."""

from __future__ import annotations

import logging

import pytest

from pdunit.engine import kernel_compiles as kc
from tests.kernels.paging import gpu

knobs = pytest.importorskip("triton").knobs


def _count(metric, phase: str) -> float:
    return next(s.value for s in metric.collect()[0].samples
                if s.name.endswith("_total") and s.labels.get("phase") == phase)


@pytest.fixture
def fresh_hooks():
    """Triton's hook slots and this module's state as they were, after the test."""
    saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, kc._installed, kc._phase)
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    kc._installed, kc._phase = False, "startup"
    yield
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, kc._installed, kc._phase = saved


class _Fn:  # what Triton passes as `fn`: a JitFunctionInfo
    module, name = "pdunit.kernels.paged_attention", "_decode_split_kernel"


def test_compiles_are_counted_by_phase_and_a_serving_one_is_logged_by_name(fresh_hooks, caplog):
    seen: list[str] = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append("before") and None
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append("after")
    assert kc.watch_kernel_compiles() and kc.watch_kernel_compiles()  # idempotent: chained once
    startup, serving = _count(kc.COMPILES, "startup"), _count(kc.COMPILES, "serving")
    serving_s = _count(kc.COMPILE_SECONDS, "serving")

    assert knobs.runtime.jit_cache_hook(key="k1", fn=_Fn(), repr="x") is None  # None: Triton compiles
    knobs.runtime.jit_post_compile_hook(key="k1", fn=_Fn(), repr="x")
    assert _count(kc.COMPILES, "startup") == startup + 1 and not caplog.records
    assert seen == ["before", "after"]  # the hooks installed before ours still run

    kc.serving_started()
    with caplog.at_level(logging.WARNING, logger="pdunit.kernels"):
        knobs.runtime.jit_cache_hook(key="k2", fn=_Fn(), repr="x")
        knobs.runtime.jit_post_compile_hook(key="k2", fn=_Fn(), repr="x")
    assert _count(kc.COMPILES, "serving") == serving + 1
    assert _count(kc.COMPILE_SECONDS, "serving") > serving_s  # the time between the two hooks
    (rec,) = caplog.records
    assert rec.kernel == "pdunit.kernels.paged_attention._decode_split_kernel" and rec.seconds >= 0


def test_a_compile_whose_start_was_not_seen_counts_with_no_seconds(fresh_hooks):
    before = _count(kc.COMPILE_SECONDS, "startup")
    assert kc.compile_finished("never-started", "k") == 0.0
    assert _count(kc.COMPILE_SECONDS, "startup") == before
    assert kc.kernel_name({"repr": "_prefill_kernel[num_warps=4](Q: *bf16)"}) == "_prefill_kernel"


@gpu
def test_a_kernel_first_compiled_while_serving_is_counted_on_the_gpu(fresh_hooks):
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(X, N: tl.constexpr):  # defined here: never compiled before in this process
        offs = tl.arange(0, N)
        tl.store(X + offs, tl.load(X + offs) + 1)

    assert kc.watch_kernel_compiles()
    kc.serving_started()
    before = _count(kc.COMPILES, "serving")
    x = torch.zeros(16, device="cuda")
    _add_one[(1,)](x, 16)
    _add_one[(1,)](x, 16)  # cached: no second compile
    torch.cuda.synchronize()
    assert _count(kc.COMPILES, "serving") == before + 1 and float(x[0]) == 2.0
