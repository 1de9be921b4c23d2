"""The checksum kernel (kernels/kv_checksum.py) gives the number engine/kv/checksum.py
defines, bit for bit: on CPU through Triton's interpreter (a subprocess: the interpreter
is chosen when Triton is imported), on a GPU directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdunit.engine.kv.checksum import kv_checksum
from tests.kernels.paging import run_interpreted

INTERPRETED = r"""
import numpy as np, torch
from pdunit.engine.kv.checksum import kv_checksum
from pdunit.kernels.kv_checksum import kv_checksum_device, available

rng = np.random.default_rng(0)
# float8_e4m3fn: an fp8 KV pool, 1-byte words
for dtype, heads, dim in ((torch.bfloat16, 2, 16), (torch.float16, 1, 24), (torch.float32, 2, 8),
                          (torch.float64, 1, 8), (torch.float8_e4m3fn, 2, 16)):
    pool = torch.from_numpy(rng.standard_normal((3, 2, 40, heads, dim))).to(dtype)
    pool.view(-1)[5] = float("nan")  # NaN payloads and signed zeros are words like any other
    pool.view(-1)[6] = -0.0
    assert available(pool)
    slots = torch.from_numpy(rng.permutation(40)[:13].astype(np.int64))
    for every in (1, 3):
        tokens = torch.arange(0, 13, every, dtype=torch.int64)
        got = kv_checksum_device(pool, slots, tokens)
        want = kv_checksum(pool, slots, every)
        assert got == want, (dtype, every, hex(got), hex(want))
    flipped = pool.clone()  # one byte of token 4's V row in layer 0, one bit of it
    flipped.view(torch.int8)[0, 1, int(slots[4]) * 1, 0, 0] ^= 1 if dtype != torch.float64 else 1
    assert kv_checksum_device(flipped, slots, torch.arange(13)) != kv_checksum(pool, slots)
    assert kv_checksum_device(flipped, slots, torch.arange(13)) == kv_checksum(flipped, slots)
print("ok")
"""


def test_kernel_matches_the_definition_in_the_interpreter(tmp_path):
    assert run_interpreted(INTERPRETED, tmp_path).strip().endswith("ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_kernel_matches_the_host_reference_on_the_gpu(dtype):
    rng = np.random.default_rng(1)
    pool = torch.from_numpy(rng.standard_normal((36, 2, 4096, 8, 128), dtype=np.float32)).to(dtype)
    slots = rng.permutation(4096)[:1500].astype(np.int64)
    for every in (1, 7):
        assert kv_checksum(pool.cuda(), slots, every) == kv_checksum(pool, slots, every)
