"""The CRDs in crds/ are generated from operator/models.py and must stay current."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from pdunit.operator import crdgen
from pdunit.operator import models as m

REPO = Path(__file__).resolve().parents[2]


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "crds" / name).read_text())


def version(crd: dict[str, Any]) -> dict[str, Any]:
    (v,) = crd["spec"]["versions"]
    return v


def test_crds_folder_matches_the_models(tmp_path: Path) -> None:
    crdgen.main([str(tmp_path)])
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir()}
    committed = {p.name: p.read_text() for p in (REPO / "crds").glob("*.yaml")}
    stale = sorted(n for n in fresh if committed.get(n) != fresh[n])
    extra = sorted(set(committed) - set(fresh))
    assert not stale and not extra, (
        f"crds/ is stale ({stale or extra}): run `make crds` (python -m pdunit.operator.crdgen crds)"
    )


def test_unit_crd_names_status_and_printer_columns() -> None:
    crd = load("pdunit.dev_pdunits.yaml")
    names = crd["spec"]["names"]
    assert (crd["spec"]["group"], names["kind"], names["plural"], names["shortNames"]) == (
        "pdunit.dev",
        "PDUnit",
        "pdunits",
        ["pdu"],
    )
    v = version(crd)
    assert v["name"] == "v1alpha1" and v["subresources"] == {"status": {}}
    cols = {c["name"]: c["jsonPath"] for c in v["additionalPrinterColumns"]}
    assert cols["Phase"] == ".status.phase"
    assert cols["Transfer"] == ".status.transferMode"
    assert cols["In-Flight"] == ".status.inFlight"
    assert cols["Age"] == ".metadata.creationTimestamp"


def test_unit_set_crd_has_the_scale_subresource_for_keda() -> None:
    crd = load("pdunit.dev_pdunitsets.yaml")
    assert crd["spec"]["names"]["shortNames"] == ["pdus"]
    assert version(crd)["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_schema_defaults_and_enums_are_the_contract() -> None:
    spec = version(load("pdunit.dev_pdunits.yaml"))["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    props = spec["properties"]
    assert props["transfer"]["enum"] == [
        "auto",
        "fabric",
        "proxy",
        "ipc",
        "posix-fd",
        "tcp",
        "host",
    ]
    assert props["transfer"]["default"] == "auto"
    assert props["gpuResource"]["default"] == "nvidia.com/gpu"
    assert (props["lbPort"]["default"], props["drainTimeoutSeconds"]["default"]) == (8000, 600)
    assert props["draining"]["default"] is False
    assert spec["required"] == ["image", "model"]
    sset = version(load("pdunit.dev_pdunitsets.yaml"))["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    assert sset["properties"]["replicas"]["minimum"] == 0
    strategy = sset["properties"]["strategy"]["properties"]
    assert (strategy["maxSurge"]["default"], strategy["maxUnavailable"]["default"]) == (1, 0)


def test_status_schema_has_no_defaults() -> None:
    status = version(load("pdunit.dev_pdunits.yaml"))["schema"]["openAPIV3Schema"]["properties"][
        "status"
    ]
    assert "default" not in yaml.safe_dump(status)
    assert set(status["properties"]) >= {
        "phase",
        "podName",
        "podIP",
        "lbPort",
        "ready",
        "draining",
        "transferMode",
        "inFlight",
        "heldPages",
        "conditions",
        "observedGeneration",
        "message",
    }


def test_schemas_are_structural() -> None:
    """Every node has a type (or int-or-string), no $ref/anyOf survive."""

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            assert "$ref" not in node and "anyOf" not in node, path
            if "properties" in node or "items" in node or "additionalProperties" in node:
                assert node.get("type") in ("object", "array"), path
            for key in ("properties",):
                for name, sub in (node.get(key) or {}).items():
                    assert "type" in sub or sub.get("x-kubernetes-int-or-string"), f"{path}.{name}"
                    walk(sub, f"{path}.{name}")
            for key in ("items", "additionalProperties"):
                if isinstance(node.get(key), dict):
                    walk(node[key], f"{path}[]")

    for name in ("pdunit.dev_pdunits.yaml", "pdunit.dev_pdunitsets.yaml"):
        walk(version(load(name))["schema"]["openAPIV3Schema"], name)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"image": "x", "model": "random:tiny:0", "transfer": "rdma"}, "spec.transfer"),
        ({"image": "x", "model": "random:tiny:0", "lbPort": 70000}, "spec.lbPort"),
        ({"image": "", "model": "random:tiny:0"}, "spec.image"),
        ({"image": "x", "model": "random:tiny:0", "gpus": 2}, "spec.gpus"),
        ({"image": "x", "model": "random:tiny:0", "lbPort": 9402}, "spec.metricsPort"),
        ({"image": "x", "model": "random:tiny:0", "lbPort": 8001}, "spec.adminPort"),
        ({"image": "x", "model": "random:tiny:0", "extraArgs": {"prefill": ["--fault-wedge-id", "1"]}},
         "spec.extraArgs.prefill.0"),
        ({"image": "x", "model": "random:tiny:0", "env": [{"name": "PDUNIT_FAULT_INJECTION", "value": "1"}]},
         "spec.env.0.name"),
    ],
)
def test_models_refuse_invalid_specs_naming_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        m.unit_spec(spec)
    assert field in m.validation_message(exc.value)
