"""The CUDA row kernels match kernels/reference.py bit for bit (every dtype, page sizes
1..N, narrow rows), and never touch a row outside the destination slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdunit.kernels import reference

pytestmark = pytest.mark.gpu


def _pool(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _paged_slots(n_pages_pool: int, page_size: int, n_pages: int, rng) -> np.ndarray:
    pages = rng.permutation(n_pages_pool)[:n_pages]
    return (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [128, 3])  # 3 x fp16 = 6-byte rows: the narrow-vector path
def test_copy_rows_matches_reference(dtype, page_size, head_dim):
    from pdunit.kernels import cuda_rows

    rng = np.random.default_rng(page_size * 7 + head_dim)
    shape = (3, 2, 256, 2, head_dim)
    src = _pool(shape, dtype, "cuda:0", 1)
    dst = _pool(shape, dtype, "cuda:0", 2)
    s = _paged_slots(256 // page_size, page_size, 8, rng)
    d = _paged_slots(256 // page_size, page_size, 8, rng)
    want = dst.cpu().clone()
    reference.copy_rows(src.cpu(), torch.from_numpy(s), want, torch.from_numpy(d))
    cuda_rows.copy_rows(src, s, dst, d)
    assert torch.equal(dst.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_then_scatter_matches_reference(dtype):
    from pdunit.kernels import cuda_rows

    rng = np.random.default_rng(3)
    shape = (4, 2, 512, 8, 128)
    src = _pool(shape, dtype, "cuda:0", 3)
    dst = _pool(shape, dtype, "cuda:0", 4)
    s, d = rng.permutation(512)[:100], rng.permutation(512)[:100]
    staging = cuda_rows.gather_rows(src, s)
    assert torch.equal(staging.cpu(), reference.gather_rows(src.cpu(), torch.from_numpy(s)))
    want = dst.cpu().clone()
    reference.scatter_rows(staging.cpu(), want, torch.from_numpy(d))
    cuda_rows.scatter_rows(staging, dst, d)
    assert torch.equal(dst.cpu(), want)


def test_copy_rows_across_two_gpus_over_the_peer_link():
    from pdunit.kernels import cuda_rows

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    rng = np.random.default_rng(5)
    shape = (36, 2, 4096, 8, 128)
    src = _pool((36, 2, 4096, 8, 128), torch.bfloat16, "cuda:0", 5)
    dst = torch.full(shape, -3.0, dtype=torch.bfloat16, device="cuda:1")
    s, d = rng.permutation(4096)[:2048], rng.permutation(4096)[:2048]
    cuda_rows.copy_rows(src, s, dst, d)
    assert torch.equal(dst[:, :, d].cpu(), src[:, :, s].cpu())
    rest = np.setdiff1d(np.arange(4096), d)
    assert bool((dst[:, :, rest] == -3).all())


def test_out_of_range_slot_is_refused_before_launch():
    from pdunit.kernels import cuda_rows

    src = torch.zeros((1, 2, 8, 1, 8), dtype=torch.float16, device="cuda:0")
    dst = torch.ones_like(src)
    with pytest.raises(IndexError, match="out of range"):
        cuda_rows.copy_rows(src, [0, 1], dst, [0, 8])
    assert bool((dst == 1).all())
