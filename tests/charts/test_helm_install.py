"""`helm install` of the chart into a real kube-apiserver (envtest, RBAC on), then the real
operator and its KEDA scaler run with the chart's ServiceAccount token: the RBAC the
chart grants is enough for a unit's whole life (create, serve, scale to zero with a
drain), and the apiserver accepted every object the chart ships."""

from __future__ import annotations

import json
import logging
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml

from pdunit.engine.ports import free_port
from pdunit.operator.proto import externalscaler_pb2 as pb
from pdunit.operator.proto import externalscaler_pb2_grpc as pb_grpc
from tests.charts.test_helm_chart import CHART, helm
from tests.operator.envtest import (
    Api,
    ControlPlane,
    Kubelet,
    ensure_assets,
    start_operator,
    wait_for,
)

NS = "pdunit-system"
SA = "rel-pdunit-operator"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    assets, why = ensure_assets()
    if assets is None:
        pytest.skip(f"no envtest binaries and they cannot be built here: {why}")
    cp = ControlPlane(assets=assets, workdir=tmp_path_factory.mktemp("envtest-helm"))
    try:
        cp.start()
        out = subprocess.run(
            [
                helm(),
                "install",
                "rel",
                str(CHART),
                "--namespace",
                NS,
                "--create-namespace",
                "--kubeconfig",
                str(cp.kubeconfig),
                "--set",
                "examplePDUnitSet.enabled=true",
                "--set",
                "examplePDUnitSet.device=cpu",
                "--set",
                "examplePDUnitSet.transfer=host",
                "--wait=false",
                "--timeout",
                "60s",
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, f"helm install failed:\n{out.stdout}\n{out.stderr}"
        # NOTES.txt rendered for this install (the example set runs on CPU here).
        assert "NOTES:" in out.stdout and 'The example set "tts" runs on CPU' in out.stdout
        assert "NetworkPolicy rel-pdunit-units" in out.stdout and "no scraper" in out.stdout, out.stdout
        yield cp
    finally:
        cp.stop()


def _sa_kubeconfig(cp: ControlPlane, path: Path) -> Path:
    token = cp.kubectl("create", "token", SA, "-n", NS, "--duration", "1h").stdout.strip()
    config = yaml.safe_load(cp.kubeconfig.read_text())
    config["users"] = [{"name": "operator", "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = "operator"
    path.write_text(yaml.safe_dump(config))
    return path


def test_helm_install_is_accepted_by_the_apiserver(installed: ControlPlane) -> None:
    cp = installed
    names = json.loads(
        cp.kubectl("get", "deploy,svc,sa,role,rolebinding,pdunitset", "-n", NS, "-o", "json").stdout
    )["items"]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in names}
    assert {
        ("Deployment", "rel-pdunit-operator"),
        ("Deployment", "rel-pdunit-router"),
        ("Service", "rel-pdunit-scaler"),
        ("Service", "rel-pdunit-router"),
        ("ServiceAccount", SA),
        ("PDUnitSet", "tts"),
    } <= kinds
    policies = json.loads(cp.kubectl("get", "networkpolicy", "-n", NS, "-o", "json").stdout)["items"]
    assert [p["metadata"]["name"] for p in policies] == ["rel-pdunit-units"]
    cp.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/pdunits.pdunit.dev",
        "crd/pdunitsets.pdunit.dev",
        "--timeout=30s",
    )
    # Least privilege, as the apiserver's RBAC sees it.
    as_sa = f"--as=system:serviceaccount:{NS}:{SA}"
    for verb, resource, allowed in [
        ("create", "pods", "yes"),
        ("delete", "pdunits.pdunit.dev", "yes"),
        ("patch", "pdunitsets.pdunit.dev/status", "yes"),
        ("watch", "customresourcedefinitions", "yes"),
        ("get", "secrets", "yes"),  # each unit's own, by name
        ("create", "secrets", "yes"),
        ("list", "secrets", "no"),
        ("watch", "secrets", "no"),
        ("delete", "secrets", "no"),
        ("patch", "secrets", "no"),
        ("update", "pdunitsets.pdunit.dev/scale", "no"),
        ("delete", "pdunitsets.pdunit.dev", "no"),
        ("create", "deployments.apps", "no"),
    ]:
        out = cp.kubectl("auth", "can-i", verb, resource, "-n", "anywhere", as_sa, check=False)
        assert out.stdout.strip() == allowed, f"{SA} can-i {verb} {resource}: {out.stdout.strip()}"
    # The Lease: its own, in the release namespace, nothing else.
    for args, allowed in [
        (("get", f"leases.coordination.k8s.io/{SA}", "-n", NS), "yes"),
        (("update", f"leases.coordination.k8s.io/{SA}", "-n", NS), "yes"),
        (("create", "leases.coordination.k8s.io", "-n", NS), "yes"),
        (("update", "leases.coordination.k8s.io/kube-scheduler", "-n", NS), "no"),
        (("delete", f"leases.coordination.k8s.io/{SA}", "-n", NS), "no"),
        (("get", f"leases.coordination.k8s.io/{SA}", "-n", "kube-system"), "no"),
    ]:
        out = cp.kubectl("auth", "can-i", *args, as_sa, check=False)
        assert out.stdout.strip() == allowed, f"{SA} can-i {' '.join(args)}: {out.stdout.strip()}"


def test_operator_and_scaler_work_with_only_the_charts_rbac(
    installed: ControlPlane, tmp_path: Path
) -> None:
    cp = installed
    admin = Api(cp.server, cp.token)
    kubelet = Kubelet(admin)
    kubelet.start()
    scaler_port = free_port()
    op, _ = start_operator(
        _sa_kubeconfig(cp, tmp_path / "sa-kubeconfig"), tmp_path, "--scaler-port", str(scaler_port),
        # The chart's leader election: its Lease, in the release namespace.
        f"--lease-name={SA}", f"--lease-namespace={NS}",
    )
    try:

        def units() -> list[dict[str, Any]] | None:
            try:
                return admin.items(f"/apis/pdunit.dev/v1alpha1/namespaces/{NS}/pdunits")
            except httpx.HTTPStatusError as exc:
                # Right after a CRD is installed its storage may still be initialising (429).
                if exc.response.status_code == 429:
                    return None
                raise

        def ready_units() -> list[dict[str, Any]]:
            return [u for u in units() or [] if (u.get("status") or {}).get("ready")]

        (unit,) = wait_for(
            ready_units, 60, "the example set's unit to be ready", describe=lambda: op.tail(20)
        )
        kubelet.lb(NS, unit["metadata"]["name"]).in_flight = 5
        with grpc.insecure_channel(f"127.0.0.1:{scaler_port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            ref = pb.ScaledObjectRef(
                name="tts",
                namespace=NS,
                scalerMetadata={"unitSet": "tts", "targetInFlightPerUnit": "8"},
            )
            resp = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName="m"))
            assert resp.metricValues[0].metricValue == 5
        # Scale to zero: drain (patch spec.draining, POST the drain to the admin port with the
        # token the operator reads from the unit's Secret), then delete the unit and its pod.
        lb = kubelet.lb(NS, unit["metadata"]["name"])
        assert lb.token, "the unit's pod names no Secret with an admin token"
        lb.in_flight = 0
        cp.kubectl("scale", "pdunitset/tts", "-n", NS, "--replicas=0")
        wait_for(
            lambda: units() == [],
            60,
            "the unit to be drained and deleted",
            describe=lambda: op.tail(20),
        )
        assert lb.drain_log and not lb.refused_log, (lb.drain_log, lb.refused_log)
        lease = admin.get(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{SA}")
        assert lease and lease["spec"]["holderIdentity"], lease
        log = op.log.read_text(errors="replace")
        # a 403 as an HTTP status, not as part of a number such as a port (": 40313")
        assert "Forbidden" not in log and not re.search(r"(?<![\d:]) ?\b403\b(?!\d)", log), op.tail(40)
        assert not kubelet.errors, kubelet.errors
    finally:
        code = op.stop()
        kubelet.stop()
        admin.close()
        logging.getLogger(__name__).info("operator exited %s", code)
    assert code == 0, op.tail(40)
