"""kubectl as people type it (issue 27.5): `kubectl get|describe|delete pdunit NAME` against
the real apiserver and the real operator (envtest), the Node column from status.nodeName,
Events from `pdunit-operator`; and the CRDs' names, checked without a cluster."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pdunit.operator import crdgen
from pdunit.operator import models as m
from pdunit.operator.unit_status import unit_status
from tests.operator.envtest import ControlPlane, Kubelet, wait_for
from tests.operator.test_integration import get_pod, get_unit, unit

NODE = "gpu-node-1"


def bind(api: Any, ns: str, pod: str, node: str) -> None:
    """What the scheduler does (envtest has none). The stand-in kubelet leaves pods
    unbound: a bound pod's deletion waits for a kubelet to confirm it, an unbound one's
    does not."""
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": pod},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }
    resp = api.post(f"/api/v1/namespaces/{ns}/pods/{pod}/binding", binding)
    assert resp.status_code == 201, resp.text


def test_no_category_shadows_a_kind_name() -> None:
    """kubectl expands a category before it resolves a kind: a category equal to a name
    of a kind makes `kubectl get <that name> NAME` mean every kind of the category."""
    crds = [crdgen.unit_crd(), crdgen.unit_set_crd()]
    names = set()
    for crd in crds:
        n = crd["spec"]["names"]
        names |= {n["singular"], n["plural"], n["kind"].lower(), *n["shortNames"]}
    for crd in crds:
        assert not set(crd["spec"]["names"]["categories"]) & names, crd["metadata"]["name"]


def test_unit_status_names_the_pods_node() -> None:
    pod = {
        "metadata": {"name": "u1", "uid": "p"},
        "spec": {"nodeName": "gpu-node-7"},
        "status": {"phase": "Pending"},
    }
    body = {"metadata": {"name": "u1", "namespace": "ns", "uid": "u"}, "spec": {}}
    status = unit_status(body, pod, None, None, datetime.now(UTC), port=8000)
    assert status["nodeName"] == "gpu-node-7"
    assert unit_status(body, None, None, None, datetime.now(UTC), port=8000)["nodeName"] is None
    columns = {c["name"]: c["jsonPath"] for c in crdgen.unit_crd()["spec"]["versions"][0][
        "additionalPrinterColumns"]}
    assert columns["Node"] == ".status.nodeName"
    assert "nodeName" in m.PDUnitStatus.model_json_schema(by_alias=True)["properties"]


def test_kubectl_get_describe_delete_a_pdunit_by_name(
    control_plane: ControlPlane, api: Any, kubelet: Kubelet, namespace: str
) -> None:
    cp, ns = control_plane, namespace
    cp.kubectl("apply", "-n", ns, "-f", "-", input=unit("web-1"))
    wait_for(lambda: get_pod(api, ns, "web-1"), 60, "the pod of PDUnit web-1")
    bind(api, ns, "web-1", NODE)

    def scheduled() -> bool:
        return ((get_unit(api, ns, "web-1") or {}).get("status") or {}).get("nodeName") == NODE

    wait_for(scheduled, 60, "status.nodeName of PDUnit web-1")

    got = cp.kubectl("get", "-n", ns, "pdunit", "web-1")
    header, row = got.stdout.splitlines()[:2]
    assert header.split()[:5] == ["NAME", "PHASE", "TRANSFER", "IN-FLIGHT", "NODE"], got.stdout
    assert row.split()[0] == "web-1" and NODE in row.split(), got.stdout

    listed = cp.kubectl("get", "-n", ns, m.CATEGORY, "-o", "name").stdout.split()
    assert "pdunit.pdunit.dev/web-1" in listed

    def described() -> str | None:
        out = cp.kubectl("describe", "-n", ns, "pdunit", "web-1").stdout
        return out if "PodCreated" in out else None

    text = wait_for(described, 30, "the PodCreated Event in kubectl describe")
    event = next(line for line in text.splitlines() if "PodCreated" in line)
    assert "pdunit-operator" in event.split() and "kopf" not in event.split(), event

    lb = kubelet.lb(ns, "web-1")
    lb.in_flight = 0
    cp.kubectl("delete", "-n", ns, "pdunit", "web-1", "--timeout=60s")
    assert cp.kubectl("get", "-n", ns, "pdunit", "web-1", check=False).returncode != 0
    # No kubelet confirms the bound pod's deletion: finish it as one would.
    cp.kubectl("delete", "-n", ns, "pod", "web-1", "--grace-period=0", "--force",
               "--ignore-not-found", check=False)

