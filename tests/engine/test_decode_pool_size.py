"""D's pool size: `--pool-tokens N`, or 0 for as many pages as the device's free memory
holds once `--pool-reserve-gib` is left out (the arithmetic; the free memory is what
`torch.cuda.mem_get_info` reports on the engine's device)."""

from __future__ import annotations

import pytest

from pdunit.engine.decode.main import DecodeConfig, pool_pages
from pdunit.engine.model.config import CONFIGS
from pdunit.engine.settings import ConfigError, parse_config

GIB = 2**30
KV_4B_BF16 = CONFIGS["qwen3-4b-shape"].kv_bytes_per_token()  # 144 KiB


def test_a_given_token_count_is_the_pool_whatever_the_device_holds():
    cfg = DecodeConfig(pool_tokens=4096, page_size=16)
    assert pool_pages(cfg, KV_4B_BF16, free_bytes=0) == 256


def test_zero_fills_the_free_memory_less_the_reserve_in_whole_pages():
    cfg = DecodeConfig(device="cuda:1", pool_tokens=0, pool_reserve_gib=8, page_size=16)
    pages = pool_pages(cfg, KV_4B_BF16, free_bytes=int(130 * GIB))
    assert pages == (122 * GIB) // (KV_4B_BF16 * 16)  # 54,613 pages: 873,808 tokens of bf16 KV
    assert pages * 16 * KV_4B_BF16 <= 122 * GIB < (pages + 1) * 16 * KV_4B_BF16
    half = pool_pages(cfg, KV_4B_BF16 // 2, free_bytes=int(130 * GIB))  # an fp8 pool: twice the tokens
    assert half in (2 * pages, 2 * pages + 1)


def test_zero_with_no_room_left_names_both_flags():
    cfg = DecodeConfig(device="cuda", pool_tokens=0, pool_reserve_gib=8)
    with pytest.raises(ValueError, match="--pool-reserve-gib 8.0.*lower the reserve or give --pool-tokens"):
        pool_pages(cfg, KV_4B_BF16, free_bytes=int(7.9 * GIB))


def test_zero_on_a_cpu_device_is_refused_naming_the_field(capsys):
    with pytest.raises(ConfigError):
        parse_config(DecodeConfig, ["--pool-tokens", "0"], "pdunit decode", env={})
    err = capsys.readouterr().err
    assert "invalid pool_tokens (from --pool-tokens)" in err and "'cpu' is not one" in err
    assert parse_config(DecodeConfig, ["--device", "cuda:0", "--pool-tokens", "0"], "pdunit decode",
                        env={}).pool_tokens == 0
