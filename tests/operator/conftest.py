"""Session fixtures of the operator integration suite: one envtest control plane, the
CRDs, the real `pdunit operator` and a stand-in kubelet, all torn down at the end.
Each test works in a namespace of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.operator.envtest import (
    REPO,
    Api,
    ControlPlane,
    Kubelet,
    Operator,
    ensure_assets,
    start_operator,
    wait_for,
)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    assets, why = ensure_assets()
    if assets is None:
        pytest.skip(f"no envtest binaries and they cannot be built here: {why}")
    cp = ControlPlane(assets=assets, workdir=tmp_path_factory.mktemp("envtest"))
    try:
        cp.start()
        cp.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        cp.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/pdunits.pdunit.dev",
            "crd/pdunitsets.pdunit.dev",
        )
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def api(control_plane: ControlPlane) -> Iterator[Api]:
    client = Api(control_plane.server, control_plane.token)
    yield client
    client.close()


@pytest.fixture(scope="session")
def kubelet(api: Api) -> Iterator[Kubelet]:
    k = Kubelet(api)
    k.start()
    yield k
    k.stop()


@pytest.fixture(scope="session")
def operator(
    control_plane: ControlPlane, kubelet: Kubelet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    op, liveness = start_operator(
        control_plane.kubeconfig, tmp_path_factory.mktemp("operator"), "--scaler-port", "0"
    )

    def alive() -> bool:
        if op.proc.poll() is not None:
            raise AssertionError(f"operator exited {op.proc.returncode}:\n{op.tail()}")
        try:
            return httpx.get(f"http://127.0.0.1:{liveness}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(alive, 60, "the operator's liveness endpoint")
        yield op
    finally:
        code = op.stop()
        # Graceful SIGTERM is part of the contract; print the log tail on a bad exit.
        assert code == 0, f"operator exit code {code}:\n{op.tail()}"


@pytest.fixture
def namespace(control_plane: ControlPlane, operator: Operator, kubelet: Kubelet) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name)
    yield name
    # envtest has no namespace or garbage collector: remove what the test left so the
    # session's operator does not keep reconciling it. Empty LBs make the drains quick.
    for key, lb in list(kubelet.lbs.items()):
        if key.startswith(f"{name}/"):
            lb.in_flight = 0
    control_plane.kubectl(
        "delete", "-n", name, "pdunitsets,pdunits", "--all", "--wait=false", check=False
    )


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """On an integration failure, show the operator's last log lines."""
    if (
        call.when == "call"
        and call.excinfo is not None
        and "operator" in getattr(item, "fixturenames", ())
    ):
        op = item.funcargs.get("operator")  # type: ignore[attr-defined]
        if isinstance(op, Operator) and Path(op.log).exists():
            item.add_report_section("call", "operator log", op.tail(80))
