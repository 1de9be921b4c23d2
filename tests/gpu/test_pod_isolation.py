"""The pod-isolation harness on 2 GPUs (root): P, D and the proxy each in its own mount
namespace with only its own GPU's device node; every transfer verified bit for bit by
D (destination rows equal, no other row changed); `auto`'s findings per phase."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest
import torch

pytestmark = pytest.mark.gpu


def _config(tmp_path, phases: list[str], backends: list[str]) -> argparse.Namespace:
    return argparse.Namespace(
        layers=4, kv_heads=8, head_dim=128, dtype="bfloat16", pool_tokens=1024, tokens=256,
        iters=3, warmup=1, per_row_iters=1, tcp_iters=1, tcp_connections=2, backends=backends,
        phases=phases, work=str(tmp_path / "work"), out=str(tmp_path), machine_tag="test",
        phase_timeout_s=300, command="pytest tests/gpu/test_pod_isolation.py")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if torch.cuda.device_count() < 2 or os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs 2 GPUs, root and unshare")
    from pdunit.bench.transfer import BACKENDS, run_transfer

    tmp = tmp_path_factory.mktemp("harness")
    res = run_transfer(_config(tmp, ["none", "pod-shared", "pod-separate"], list(BACKENDS)))
    print(json.dumps(res["summary"], indent=1, default=str))
    return res


def test_every_phase_ran(harness):
    assert harness["summary"]["phase_errors"] == {}


def test_every_measured_row_is_bit_exact_and_touches_nothing_else(harness):
    rows = harness["rows"]
    assert rows, "no verified row at all"
    for r in rows:
        assert r["verified"] and r["check"]["mismatched_dst_slots"] == 0
        assert r["check"]["changed_slots_outside_dst"] == 0


def test_without_isolation_direct_paths_work_in_both_layouts(harness):
    got = {(r["backend"], r["layout"]) for r in harness["rows"] if r["phase"] == "none"}
    for backend in ("ipc", "proxy_single", "proxy_staged", "tcp"):
        assert (backend, "contiguous") in got and (backend, "fragmented") in got


def test_under_pod_isolation_auto_finds_the_proxy_and_direct_paths_fail(harness):
    auto = harness["summary"]["auto"]["pod-shared"]
    assert auto["chosen"] == "proxy"
    results = {r["mode"]: r for r in auto["results"]}
    for mode in ("ipc", "posix-fd"):
        assert not results[mode]["ok"], results[mode]
        assert "CUDA_ERROR" in results[mode]["detail"] or "Error" in results[mode]["detail"]
    got = {(r["backend"], r["layout"]) for r in harness["rows"] if r["phase"] == "pod-shared"}
    assert ("proxy_single", "fragmented") in got and ("proxy_single", "contiguous") in got


def test_pod_without_shared_pid_namespace_is_reported(harness):
    auto = harness["summary"]["auto"]["pod-separate"]
    assert auto is not None and ("results" in auto or "error" in auto)
