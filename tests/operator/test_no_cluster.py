"""`pdunit operator` without a cluster says so in one line and exits non-zero (issue 28):
no kubeconfig, a kubeconfig that is not YAML, and an API server that does not answer."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from pdunit.engine.ports import free_port
from tests.operator.envtest import REPO


def _run(kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBECONFIG=str(kubeconfig))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    argv = [str(REPO / ".venv/bin/pdunit"), "operator", "--scaler-port", "0",
            "--metrics-port", "0", "--liveness-port", "0", "--log-level", "warning"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)


def _unreachable(tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{free_port()}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    return path


def _not_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text("clusters: [\n")
    return path


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp: tmp / "missing", "does not exist"),
        (_not_yaml, "is unusable"),
        (_unreachable, "does not answer GET /version"),
    ],
    ids=["no-kubeconfig", "kubeconfig-not-yaml", "api-unreachable"],
)
def test_operator_without_a_cluster_says_so_in_one_line(make, says, tmp_path: Path) -> None:
    out = _run(make(tmp_path))
    assert out.returncode != 0
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("pdunit operator: no Kubernetes cluster:") and says in lines[0]
    assert "KUBECONFIG" in lines[0] or "kubeconfig" in lines[0]
