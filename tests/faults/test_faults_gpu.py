"""The fault-injection suite on GPUs, the pod's way (issue 5): P on one GPU and D on
another, each seeing only its own device node, the nvlink-proxy seeing both, one PID
namespace (tests/gpu/harness/pod_isolate.sh), KV through the proxy. Needs 2 GPUs and
root (mount namespaces): the device tool's nvidia-h200-x2; skipped elsewhere."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from pdunit.bench.fault_unit import FaultsConfig
from pdunit.bench.faults import run
from tests.faults.test_faults import _assert_contract

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="the isolation harness needs root and unshare"),
]


@pytest.mark.timeout(420)
def test_isolated_gpu_unit_keeps_the_page_contract_under_every_fault_kind(tmp_path):
    cfg = FaultsConfig(isolate=True, device="cuda", transfer="proxy",
                       kinds="corrupt,slow,p_stop,lb_stop,p_kill,held_exit,proxy_stop",
                       transfers=500, faults=20, max_seconds=150)
    report = run(cfg, run_dir=str(tmp_path / "unit"))
    _assert_contract(report, 500, 20)
    # the fault schedule is seeded: its first 20 faults include each of these
    assert {"proxy_stop", "p_stop", "p_kill", "held_exit"} <= set(report["faults_by_kind"])
