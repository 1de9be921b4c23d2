"""Helpers shared by the kernel tests: fragmented paged slot lists, the gpu marker, and
running a check under Triton's CPU interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def gpu(test):  # noqa: ANN001, ANN201 - a pytest decorator
    """`gpu` marker + skipped without CUDA (CI has none; run through the device tool)."""
    return pytest.mark.gpu(requires_cuda(test))


def paged_slots(
    lengths: list[int], page_size: int, n_slots: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per sequence, `length` pool slots made of whole pages of `page_size` slots taken
    from a random permutation of the pool's pages: consecutive tokens are contiguous
    only inside a page, and pages of different sequences interleave."""
    n_pages = n_slots // page_size
    need = [-(-n // page_size) for n in lengths]
    if sum(need) > n_pages:
        raise ValueError(f"pool of {n_slots} slots too small for {lengths} at page {page_size}")
    pages = rng.permutation(n_pages)
    out, used = [], 0
    for n, k in zip(lengths, need, strict=True):
        mine = pages[used : used + k]
        used += k
        slots = (mine[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)[:n]
        out.append(slots.astype(np.int64))
    return out


def run_interpreted(script: str, cwd: Path, timeout: float = 240) -> str:
    """Runs `script` in a fresh Python with TRITON_INTERPRET=1 (the interpreter is
    chosen when Triton is imported, hence a subprocess), from `cwd`: the repo root would
    shadow the stdlib `operator` module with the operator/ folder. Fails the test with
    the script's output unless it exits 0; returns its stdout."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
