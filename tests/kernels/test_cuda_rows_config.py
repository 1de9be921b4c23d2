"""The row-copy kernel's launch configuration (CPU: NVRTC compiles without a GPU):
bad values are refused naming the field, the text form round-trips (it travels as
proxy flags), and every configuration the tuning sweep can pick compiles."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from pdunit.bench.transfer import TUNE_BASE, proxy_args_for  # noqa: E402
from pdunit.kernels.cuda_rows import (  # noqa: E402
    DEFAULT_CONFIG,
    HINTS,
    CopyConfig,
    compile_cubin,
    kernel_name,
    kernel_source,
)


@pytest.mark.parametrize("field, value", [("rows", 0), ("rows", 65), ("threads", 100), ("threads", 2048),
                                          ("unroll", 0), ("unroll", 17), ("hint", "nt"),
                                          ("blocks_per_sm", -1)])
def test_a_bad_launch_configuration_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}" if field == "hint" else f"{field}={value}"):
        CopyConfig(**{field: value})


def test_the_default_is_the_configuration_measured_first_on_h200():
    assert (DEFAULT_CONFIG.rows, DEFAULT_CONFIG.threads, DEFAULT_CONFIG.unroll) == (8, 128, 8)
    assert DEFAULT_CONFIG.hint == "none" and DEFAULT_CONFIG.blocks_per_sm == 0


def test_text_form_round_trips_and_names_unknown_keys():
    cfg = CopyConfig(rows=16, threads=256, unroll=4, hint="cs", blocks_per_sm=8)
    assert CopyConfig.parse(str(cfg)) == cfg
    assert CopyConfig.parse("threads=64") == dataclasses.replace(DEFAULT_CONFIG, threads=64)
    with pytest.raises(ValueError, match="'warps=4'"):
        CopyConfig.parse("warps=4")


def test_persistent_grid_shares_the_compiled_kernel():
    cfg = CopyConfig(rows=8, threads=128, unroll=8, blocks_per_sm=16)
    assert cfg.kernel_key == DEFAULT_CONFIG.kernel_key
    assert kernel_source((cfg, DEFAULT_CONFIG), (16,)).count("DEFINE(copy_rows_16_r8_t128_u8_h0,") == 1


def test_every_configuration_the_sweep_can_pick_compiles():
    base = [CopyConfig(rows=r, threads=t, unroll=u) for r, t, u in TUNE_BASE]
    hinted = [dataclasses.replace(c, hint=h) for c in base[:2] for h in HINTS]
    cubin = compile_cubin("sm_90", tuple(base + hinted), (16,))
    for c in base + hinted:
        assert kernel_name(16, c.kernel_key).encode() in cubin


def test_narrow_vector_kernels_compile_for_every_width():
    cubin = compile_cubin("sm_90", (CopyConfig(rows=3, threads=96, unroll=3, hint="cg"),))
    for w in (16, 8, 4, 2, 1):
        assert f"copy_rows_{w}_r3_t96_u3_h2".encode() in cubin


def test_the_sweep_hands_the_proxy_flags_that_reproduce_its_choice():
    from pdunit.sidecars.nvlink_proxy.main import ProxyConfig

    plan = {"config": str(CopyConfig(rows=16, threads=256, unroll=8, hint="cg", blocks_per_sm=4)),
            "device": "split", "split": 0.6}
    flags = proxy_args_for(plan)
    from pdunit.engine.settings import parse_config

    config = parse_config(ProxyConfig, flags, prog="pdunit proxy", env={})
    assert (config.copy_rows, config.copy_threads, config.copy_unroll, config.copy_hint,
            config.copy_blocks_per_sm) == (16, 256, 8, "cg", 4)
    assert (config.copy_device, config.copy_split) == ("split", 0.6)


class _FakeTuner:
    """Stands in for bench.transfer._Tuner: synthetic timings; one configuration is the
    fastest but fails verification, so the sweep must not pick it."""

    nbytes, n = 288 << 20, 2048

    def __init__(self, args) -> None:
        self.loaded: set = set()

    def load(self, configs) -> None:
        self.loaded |= {c.kernel_key for c in configs}

    def peer_copy_ms(self, iters: int) -> float:
        return 0.78

    def measure(self, cfg, device, split, iters, stage):
        assert cfg.kernel_key in self.loaded, f"{cfg} measured before it was compiled"
        ms = 0.87 + 0.01 * cfg.unroll / 8 + (0.35 if device == "src" else 0.0)
        if device == "split":
            ms = 0.80 + abs(split - 0.6)
        if (cfg.rows, cfg.threads) == (16, 256):
            ms -= 0.1
        if (cfg.rows, cfg.threads, cfg.unroll) == (2, 128, 2):
            return {"stage": stage, "config": str(cfg), "device": device, "split": split, "ms": 0.5,
                    "verified": False}
        return {"stage": stage, "config": str(cfg), "device": device, "split": split, "ms": round(ms, 4),
                "verified": True}


def test_the_sweep_picks_the_fastest_verified_plan_and_reports_every_point(tmp_path, monkeypatch):
    import argparse
    import json

    from pdunit.bench import transfer

    monkeypatch.setattr(transfer, "_Tuner", _FakeTuner)
    args = argparse.Namespace(result=str(tmp_path / "tune.json"), tune_iters=3, tune_budget_s=30.0)
    assert transfer.role_tune(args) == 0
    res = json.loads((tmp_path / "tune.json").read_text())
    stages = {r["stage"] for r in res["rows"]}
    assert stages == {"A", "B", "C"}
    assert len([r for r in res["rows"] if r["stage"] == "A"]) == 2 * len(TUNE_BASE)
    chosen = res["chosen"]
    assert chosen["verified"] and CopyConfig.parse(chosen["config"]).rows == 16
    assert not any(r["config"] == chosen["config"] and r["device"] == chosen["device"]
                   and r["split"] == chosen["split"] and not r["verified"] for r in res["rows"])
    assert res["default"]["config"] == str(DEFAULT_CONFIG) and res["default"]["device"] == "dst"
    assert res["proxy_args"] == proxy_args_for(chosen)
    assert res["skipped_for_time"] == []
    md = transfer.to_markdown({"machine": {}, "summary": {"auto": {}, "failed": []}, "command": "x",
                               "config": {"tokens": 2048, "layers": 36, "kv_heads": 8, "head_dim": 128,
                                          "dtype": "bfloat16", "pool_tokens": 8192},
                               "rows": [], "date": "d", "tune": res})
    assert " ".join(res["proxy_args"]) in md and "| final |" in md


def test_the_sweep_stops_starting_points_when_its_budget_is_spent(tmp_path, monkeypatch):
    import argparse
    import json

    from pdunit.bench import transfer

    monkeypatch.setattr(transfer, "_Tuner", _FakeTuner)
    args = argparse.Namespace(result=str(tmp_path / "tune.json"), tune_iters=3, tune_budget_s=0.0)
    assert transfer.role_tune(args) == 1  # nothing measured: nothing chosen, said so
    res = json.loads((tmp_path / "tune.json").read_text())
    assert res["chosen"] is None and res["proxy_args"] == [] and res["skipped_for_time"]
