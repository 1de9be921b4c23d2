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


# ------------------------------------------------------------------ launch configurations
def _configs():
    from pdunit.kernels.cuda_rows import DEFAULT_CONFIG, CopyConfig

    # the default, narrow/wide blocks, every cache operator, persistent grids, and odd
    # sizes where a block's rows x vectors do not divide evenly among its threads
    return [DEFAULT_CONFIG, CopyConfig(rows=4, threads=64, unroll=8),
            CopyConfig(rows=16, threads=256, unroll=8, hint="cs"),
            CopyConfig(rows=32, threads=512, unroll=8, hint="cg", blocks_per_sm=2),
            CopyConfig(rows=2, threads=128, unroll=1, blocks_per_sm=1),
            CopyConfig(rows=3, threads=96, unroll=2)]


def _layout(kind: str, n_slots: int, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    if kind == "contiguous":
        return np.arange(n) + n_slots // 8, np.arange(n) + n_slots // 2
    return rng.permutation(n_slots)[:n], rng.permutation(n_slots)[:n]


@pytest.mark.parametrize("config", _configs(), ids=str)
@pytest.mark.parametrize("layout", ["fragmented", "contiguous"])
@pytest.mark.parametrize("head_dim", [128, 3])
def test_every_launch_configuration_is_bit_exact_and_leaves_other_rows_alone(config, layout, head_dim):
    from pdunit.kernels import cuda_rows

    rng = np.random.default_rng(head_dim)
    dtype = torch.bfloat16 if head_dim == 128 else torch.float16
    shape = (3, 2, 256, 2, head_dim)
    src = _pool(shape, dtype, "cuda:0", 11)
    dst = _pool(shape, dtype, "cuda:0", 12)
    s, d = _layout(layout, 256, 100, rng)
    want = dst.cpu().clone()  # dst with exactly the destination rows replaced
    reference.copy_rows(src.cpu(), torch.from_numpy(s), want, torch.from_numpy(d))
    cuda_rows.copy_rows(src, s, dst, d, config=config)
    assert torch.equal(dst.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("config", _configs()[:4], ids=str)
@pytest.mark.parametrize("exec_on", ["dst", "src"])  # pull (kernel reads over the link) / push
def test_every_configuration_copies_across_two_gpus_pulling_or_pushing(config, exec_on):
    from pdunit.kernels import cuda_rows

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    rng = np.random.default_rng(9)
    shape = (4, 2, 1024, 8, 128)
    src = _pool(shape, torch.bfloat16, "cuda:0", 13)
    dst = torch.full(shape, -3.0, dtype=torch.bfloat16, device="cuda:1")
    for layout in ("fragmented", "contiguous"):
        s, d = _layout(layout, 1024, 300, rng)
        dst.fill_(-3.0)
        cuda_rows.copy_rows(src, s, dst, d, config=config, exec_device=1 if exec_on == "dst" else 0)
        assert torch.equal(dst[:, :, d].cpu(), src[:, :, s].cpu())
        rest = np.setdiff1d(np.arange(1024), d)
        assert bool((dst[:, :, rest] == -3).all())


def test_back_to_back_launches_do_not_overwrite_slots_still_being_read():
    """Each job's slots go through one pinned buffer per thread with an async upload. A
    job queued behind a long kernel has not read its slots yet when the next job is
    submitted: the next upload must wait instead of overwriting them."""
    from pdunit.kernels import cuda_rows

    rng = np.random.default_rng(4)
    shape = (36, 2, 4096, 8, 128)
    src = _pool(shape, torch.bfloat16, "cuda:0", 14)
    dst = _pool(shape, torch.bfloat16, "cuda:0", 15)
    s_big, d_big = rng.permutation(4096)[:2048], rng.permutation(4096)[:2048]
    free = rng.permutation(np.setdiff1d(np.arange(4096), d_big))
    jobs = [(s_big, d_big), (np.arange(8), free[:8]), (np.arange(8, 16), free[8:16])]
    want = dst.cpu().clone()
    for s, d in jobs:
        reference.copy_rows(src.cpu(), torch.from_numpy(s), want, torch.from_numpy(d))
    row_bytes = 8 * 128 * 2
    c = cuda_rows.copier(0)
    stream = c.stream()
    torch.cuda.synchronize()
    for s, d in jobs:  # no sync in between: the small jobs queue behind the big one
        c.launch(src.data_ptr(), dst.data_ptr(), s, d, len(s), 72, 4096 * row_bytes, 4096 * row_bytes,
                 row_bytes, stream)
    c.sync(stream)
    assert torch.equal(dst.cpu().view(torch.int16), want.view(torch.int16))
